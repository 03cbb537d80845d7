"""Tool-call grammars: what enforcing hermes-style tool calls (an xgrammar structural tag over N tools'
JSON schemas, serve/grammar.py) costs per generated token, and what compiling one costs.

  1. end to end: a batch of requests whose output must be calls (`<tool_call>\\n{"name": ...,
     "arguments": ...}\\n</tool_call>`, newline-separated, at least one) to N random tools (N = 1,
     10, 50) through the engine at temperature 1; then the same prompts unconstrained, each with
     max_tokens (and ignore_eos) set to the token count its constrained run produced, so both runs
     generate the same tokens in the same batches. Overhead per token = (constrained -
     unconstrained seconds) / tokens, wall and process-CPU; interleaved repeats, best of each. Every
     constrained output that completed is checked: its calls name given tools and their arguments
     validate (jsonschema).
  2. the sampler alone: sample() over random [batch, vocab] logits with the tag's matcher per row vs
     none (mask fill + apply + accept), the grammar's share of a step without the forward.
  3. compiling: the tool set's first compile (a miss), a cached lookup (canonicalising the tag's
     JSON included), and the compile cache's hits and misses over this benchmark's requests
     (GrammarCache.stats(): one tool set per batch, reused by every repeat).

Usage: python benchmarks/tool_call_grammar.py [--smoke] [--out DIR] [--tools 1 10 50] [--batches 1 16]
[--repeats 3] (writes DIR/tool_call_grammar.{json,png}; DIR defaults to benchmarks/results).
--smoke: a tiny random model, one short round (that it runs).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

import jsonschema
import torch
import xgrammar as xgr
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import SequenceGrammar, StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.sampler import sample
from baton.serve.sampling_params import SamplingParams
from serve_engine import RESULTS  # noqa: E402 - the script dir is on sys.path
from structured import make_checkpoint, run  # noqa: E402 - the structured-outputs benchmark's model and loop

WORDS = ["alpha", "river", "stone", "cloud", "ember", "maple", "orbit", "pixel", "quartz", "tiger"]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>(?:\n|$)", re.S)


def random_tools(n: int, seed: int) -> dict[str, dict]:
    """n tools, each an object schema of 1-5 properties of mixed kinds (bounded, so a random model
    can finish them), some required."""
    rng = random.Random(seed)

    def prop() -> dict:
        kind = rng.choice(["int", "enum", "bool", "str", "array", "object"])
        if kind == "int":
            lo = rng.randint(-100, 100)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
        if kind == "enum":
            return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "str":
            return {"type": "string", "maxLength": rng.randint(2, 12)}
        if kind == "array":
            return {"type": "array", "items": {"enum": rng.sample(WORDS, 3)}, "maxItems": rng.randint(1, 4)}
        inner = {w: {"type": "integer", "minimum": 0, "maximum": 99} for w in rng.sample(WORDS, 2)}
        return {"type": "object", "properties": inner, "required": list(inner)}

    tools = {}
    for i in range(n):
        names = rng.sample(WORDS, rng.randint(1, 5))
        props = {name: prop() for name in names}
        required = rng.sample(names, rng.randint(1, len(names)))
        tools[f"{rng.choice(WORDS)}_{i}"] = {"type": "object", "properties": props, "required": required}
    return tools


def hermes_tag(tools: dict[str, dict]) -> dict:
    """tool_choice "required" in the hermes format: one call or more, newline-separated, nothing
    else; at most one whitespace character between JSON tokens (a random model would pad forever)."""
    tags = [
        {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": "}\n</tool_call>",
        }
        for name, schema in tools.items()
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True},
    }


def check_calls(text: str, tools: dict[str, dict]) -> int:
    """The number of calls in a completed output, each validated against its tool's schema."""
    at, calls = 0, 0
    while at < len(text):
        m = CALL.match(text, at)
        assert m, text
        call = json.loads(m[1])
        jsonschema.validate(call["arguments"], tools[call["name"]])
        at, calls = m.end(), calls + 1
    assert calls, text
    return calls


def end_to_end(engine: LLMEngine, tools: dict[str, dict], batch: int, repeats: int) -> dict:
    so = StructuredOutputs(structural_tag=hermes_tag(tools))
    prompts = [f"Call {i}: " for i in range(batch)]
    constrained = [
        (f"c{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured=so))
        for i, p in enumerate(prompts)
    ]
    for rid, p, params in constrained:  # warm-up, and the outputs' check
        engine.add_request(rid, p, params)
    counts, calls, completed = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                counts[out.request_id] = len(c.token_ids)
                if c.finish_reason == "stop":
                    calls, completed = calls + check_calls(c.text, tools), completed + 1
    free = [
        (f"u{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=counts[f"c{i}"], ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    tc, tu = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike; the seeds repeat the tokens
        got, *t = run(engine, constrained)
        assert got == counts
        tc.append(t)
        got, *t = run(engine, free)
        assert got == {f"u{k[1:]}": v for k, v in counts.items()}
        tu.append(t)
    tokens = sum(counts.values())
    (c, c_cpu), (u, u_cpu) = [tuple(min(x) for x in zip(*t)) for t in (tc, tu)]
    return dict(
        tools=len(tools),
        batch=batch,
        tokens=tokens,
        completed=completed,
        calls=calls,
        constrained_ms_per_token=c / tokens * 1e3,
        unconstrained_ms_per_token=u / tokens * 1e3,
        overhead_us_per_token=(c - u) / tokens * 1e6,
        overhead_pct=100 * (c - u) / u,
        cpu_constrained_ms_per_token=c_cpu / tokens * 1e3,
        cpu_unconstrained_ms_per_token=u_cpu / tokens * 1e3,
        cpu_overhead_us_per_token=(c_cpu - u_cpu) / tokens * 1e6,
    )


def sampler_only(engine: LLMEngine, tools: dict[str, dict], batch: int, steps: int, repeats: int) -> dict:
    """sample() on random logits, `steps` tokens per row, with the tag's matcher per row vs none. A
    row whose grammar terminates starts again (a fresh matcher), so every step masks every row."""
    compiled = engine.grammars.compile(StructuredOutputs(structural_tag=hermes_tag(tools)))
    fresh = lambda: SequenceGrammar(xgr.GrammarMatcher(compiled))  # noqa: E731 - not counted as requests
    logits = torch.randn(steps, batch, engine.vocab_size) * 3
    params = SamplingParams(temperature=1.0, seed=0)

    def go(constrained: bool) -> float:
        seqs = [Sequence(i, str(i), 0, [1], params) for i in range(batch)]
        for s in seqs:
            s.make_generator()
            s.grammar = fresh() if constrained else None
        t0 = time.process_time()
        for step in range(steps):
            for s, r in zip(seqs, sample(logits[step], seqs)):
                if s.grammar is not None:
                    s.grammar.accept(r.token_id)
                    if s.grammar.terminated:
                        s.grammar = fresh()
        return time.process_time() - t0

    c = min(go(True) for _ in range(repeats))
    u = min(go(False) for _ in range(repeats))
    tokens = steps * batch
    return dict(
        tools=len(tools),
        batch=batch,
        sample_us_per_token=u / tokens * 1e6,
        constrained_sample_us_per_token=c / tokens * 1e6,
        overhead_us_per_token=(c - u) / tokens * 1e6,
    )


def compile_cost(engine: LLMEngine, tools: dict[str, dict], lookups: int = 100) -> dict:
    """A new tool set's compile (the engine's compiler is built beforehand), and a cached lookup of
    the same tool set sent again (a new request's spec: its canonical key is computed afresh)."""
    engine.grammars.prepare()
    so = StructuredOutputs(structural_tag=hermes_tag(tools))
    t0 = time.perf_counter()
    engine.grammars.compile(so)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()  # xgrammar's own compile of the same tag (no string fix: one parse less)
    engine.grammars._get_compiler().compile_structural_tag(json.dumps(so.structural_tag))
    stock = time.perf_counter() - t0
    again = [StructuredOutputs(structural_tag=hermes_tag(tools)) for _ in range(lookups)]
    t0 = time.perf_counter()
    for spec in again:
        engine.grammars.compile(spec)
    cached = (time.perf_counter() - t0) / lookups
    kb = len(json.dumps(so.structural_tag)) / 1024
    return dict(
        tools=len(tools), tag_json_kb=kb, compile_ms=first * 1e3, stock_compile_ms=stock * 1e3, cached_us=cached * 1e6
    )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for batch in sorted({r["batch"] for r in results["end_to_end"]}):
        rows = [r for r in results["end_to_end"] if r["batch"] == batch]
        a.plot(
            [r["tools"] for r in rows],
            [r["cpu_overhead_us_per_token"] for r in rows],
            marker="o",
            label=f"batch {batch}",
        )
    a.set(xscale="log", xlabel="tools", ylabel="us per token", title="Engine: tool-call grammar - unconstrained (CPU)")
    a.legend()
    for batch in sorted({r["batch"] for r in results["sampler"]}):
        rows = [r for r in results["sampler"] if r["batch"] == batch]
        b.plot(
            [r["tools"] for r in rows], [r["overhead_us_per_token"] for r in rows], marker="o", label=f"batch {batch}"
        )
    b.set(xscale="log", xlabel="tools", ylabel="us per token", title="sample(): mask fill + apply + accept (CPU)")
    b.legend()
    rows = results["compile"]
    c.plot([r["tools"] for r in rows], [r["compile_ms"] * 1e3 for r in rows], marker="o", label="first compile (miss)")
    c.plot([r["tools"] for r in rows], [r["cached_us"] for r in rows], marker="s", label="cached lookup (hit)")
    c.set(xscale="log", yscale="log", xlabel="tools", ylabel="us", title="Compiling the tool set's grammar")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, one short round")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--tools", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    vocab = 320 if args.smoke else args.vocab
    tool_counts = (1, 10) if args.smoke else args.tools
    batches = (1, 4) if args.smoke else args.batches
    repeats = 1 if args.smoke else args.repeats
    results: dict = dict(vocab=vocab, end_to_end=[], sampler=[], compile=[])
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp), vocab, args.smoke)
        engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=2048))
        for n in tool_counts:
            results["compile"].append(compile_cost(engine, random_tools(n, seed=1000 + n)))  # a set used nowhere else
            tools = random_tools(n, seed=n)
            for b in batches:
                results["end_to_end"].append(end_to_end(engine, tools, b, repeats))
                print(json.dumps(results["end_to_end"][-1]), flush=True)
                results["sampler"].append(sampler_only(engine, tools, b, 8 if args.smoke else 64, repeats))
        stats = engine.grammars.stats()
    hits, misses = stats.hits.get("structural_tag", 0), stats.misses.get("structural_tag", 0)
    results["cache"] = dict(hits=hits, misses=misses, hit_rate=hits / max(hits + misses, 1))
    print(
        f"{'tools':>5} {'batch':>5} {'tokens':>6} {'done':>4} {'calls':>5} {'free ms/tok':>11} {'tools ms/tok':>12} "
        f"{'overhead us/tok':>15} {'%':>6} {'CPU free':>8} {'CPU tools':>9} {'CPU overhead us/tok':>19}"
    )
    for r in results["end_to_end"]:
        print(
            f"{r['tools']:>5} {r['batch']:>5} {r['tokens']:>6} {r['completed']:>4} {r['calls']:>5} "
            f"{r['unconstrained_ms_per_token']:>11.3f} {r['constrained_ms_per_token']:>12.3f} "
            f"{r['overhead_us_per_token']:>15.1f} {r['overhead_pct']:>5.1f}% "
            f"{r['cpu_unconstrained_ms_per_token']:>8.3f} {r['cpu_constrained_ms_per_token']:>9.3f} "
            f"{r['cpu_overhead_us_per_token']:>19.1f}"
        )
    print(f"\n{'tools':>5} {'batch':>5} {'sample us/tok':>13} {'with tag us/tok':>15} {'overhead us/tok':>15}")
    for r in results["sampler"]:
        print(
            f"{r['tools']:>5} {r['batch']:>5} {r['sample_us_per_token']:>13.1f} "
            f"{r['constrained_sample_us_per_token']:>15.1f} {r['overhead_us_per_token']:>15.1f}"
        )
    print(f"\n{'tools':>5} {'tag KB':>7} {'compile ms':>10} {'xgrammar own ms':>15} {'cached us':>9}")
    for r in results["compile"]:
        print(
            f"{r['tools']:>5} {r['tag_json_kb']:>7.1f} {r['compile_ms']:>10.2f} {r['stock_compile_ms']:>15.2f} "
            f"{r['cached_us']:>9.1f}"
        )
    c = results["cache"]
    print(f"compile cache over these requests: {c['hits']} hits, {c['misses']} misses ({100 * c['hit_rate']:.1f}%)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tool_call_grammar.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "tool_call_grammar.png")
    print(f"wrote {args.out / 'tool_call_grammar.json'} and tool_call_grammar.png")


if __name__ == "__main__":
    main()
