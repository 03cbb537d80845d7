"""Structured outputs: what xgrammar's constraint costs per generated token (serve/grammar.py).

  1. end to end: a batch of JSON-schema requests through the engine, then the same prompts
     unconstrained, each with max_tokens (and ignore_eos) set to the token count its constrained
     run produced, so both runs generate the same tokens in the same batches. Overhead per token =
     (constrained - unconstrained seconds) / tokens, in wall and process-CPU time; interleaved
     repeats, best of each.
  2. the sampler alone: sample() over [batch, vocab] logits with and without a matcher per row
     (mask fill + apply + accept), so the grammar's share of a step is visible without the forward
  3. compiling: a schema's first compile against the tokenizer, and a cached lookup

Usage: python benchmarks/structured.py [--smoke] [--out DIR] [--vocabs 2048 8192] [--repeats 3]
(writes DIR/structured.{json,png};
DIR defaults to benchmarks/results). --smoke: a tiny random model, one short round (that it runs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.common.tokenizer import train_bpe
from baton.serve.core.sequence import Sequence
from baton.serve.core.structured import StructuredOutputs
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.grammar import GrammarCache
from baton.serve.sampler import sample
from baton.serve.sampling_params import SamplingParams
from serve_engine import MODEL, RESULTS  # noqa: E402 - the engine benchmark's model (script dir is on sys.path)

SHAKESPEARE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
)  # ../shared beside the repo
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


def make_checkpoint(out: Path, vocab: int, smoke: bool) -> Path:
    text = SHAKESPEARE.read_text()[: 50_000 if smoke else 400_000] if SHAKESPEARE.is_file() else "To be or not. " * 400
    tok = train_bpe([text], vocab_size=vocab)
    cfg = dict(MODEL, vocab_size=vocab)
    if smoke:
        cfg.update(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
    model = build_model(ModelConfig(**cfg), seed=0).eval()
    model.config.eos_token_id = tok.eos_token_id
    return save_model(out / f"v{vocab}", model, tokenizer=tok)


def run(engine: LLMEngine, reqs: list[tuple[str, str, SamplingParams]]) -> tuple[dict[str, int], float, float]:
    """Generated tokens per request, and wall and process-CPU seconds for the whole batch (all
    admitted at once). CPU seconds are the steadier number on a loaded machine."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    counts, t0, c0 = {}, time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                counts[out.request_id] = len(out.outputs[0].token_ids)
    return counts, time.perf_counter() - t0, time.process_time() - c0


def end_to_end(ckpt: Path, batch: int, repeats: int, speculative=None) -> dict:
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=2048, speculative=speculative))
    so = StructuredOutputs(json=SCHEMA)
    prompts = [f"Record {i}: " for i in range(batch)]
    constrained = [
        (f"c{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured=so))
        for i, p in enumerate(prompts)
    ]
    counts = run(engine, constrained)[0]  # warm-up; the seeds make every repeat generate the same tokens
    free = [
        (f"u{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=counts[f"c{i}"], ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    tc, tu = [], []
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        tc.append(run(engine, constrained)[1:])
        got, *t = run(engine, free)
        tu.append(t)
        assert got == {f"u{k[1:]}": v for k, v in counts.items()}
    tokens = sum(counts.values())
    (c, c_cpu), (u, u_cpu) = [tuple(min(x) for x in zip(*t)) for t in (tc, tu)]
    return dict(
        batch=batch,
        speculative=speculative is not None,
        tokens=tokens,
        constrained_ms_per_token=c / tokens * 1e3,
        unconstrained_ms_per_token=u / tokens * 1e3,
        overhead_us_per_token=(c - u) / tokens * 1e6,
        overhead_pct=100 * (c - u) / u,
        cpu_constrained_ms_per_token=c_cpu / tokens * 1e3,
        cpu_unconstrained_ms_per_token=u_cpu / tokens * 1e3,
        cpu_overhead_us_per_token=(c_cpu - u_cpu) / tokens * 1e6,
    )


def sampler_only(ckpt: Path, batch: int, steps: int, repeats: int) -> dict:
    """sample() on random logits for `steps` tokens per row, with a matcher per row vs none. A row
    whose grammar terminates starts again (a fresh matcher), so every step masks every row."""
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=16))
    cache: GrammarCache = engine.grammars
    so = StructuredOutputs(json=SCHEMA)
    vocab = engine.vocab_size
    logits = torch.randn(steps, batch, vocab) * 3
    params = SamplingParams(temperature=1.0, seed=0)

    def go(constrained: bool) -> float:
        seqs = [Sequence(i, str(i), 0, [1], params) for i in range(batch)]
        for s in seqs:
            s.make_generator()
            s.grammar = cache.matcher(so) if constrained else None
        t0 = time.process_time()  # CPU seconds: steadier on a loaded machine
        for step in range(steps):
            for s, r in zip(seqs, sample(logits[step], seqs)):
                if s.grammar is not None:
                    s.grammar.accept(r.token_id)
                    if s.grammar.terminated:
                        s.grammar = cache.matcher(so)
        return time.process_time() - t0

    c = min(go(True) for _ in range(repeats))
    u = min(go(False) for _ in range(repeats))
    tokens = steps * batch
    return dict(
        batch=batch,
        vocab=vocab,
        sample_us_per_token=u / tokens * 1e6,
        constrained_sample_us_per_token=c / tokens * 1e6,
        overhead_us_per_token=(c - u) / tokens * 1e6,
    )


def compile_cost(ckpt: Path) -> dict:
    engine = LLMEngine.from_checkpoint(ckpt, EngineConfig(num_kv_blocks=16))
    so = StructuredOutputs(json=SCHEMA)
    t0 = time.perf_counter()
    engine.grammars.compile(so)  # the first one also builds the tokenizer info and the compiler
    first = time.perf_counter() - t0
    other = StructuredOutputs(json={**SCHEMA, "required": ["name", "age"]})
    t0 = time.perf_counter()
    engine.grammars.compile(other)
    second = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        engine.grammars.compile(so)
    cached = (time.perf_counter() - t0) / 100
    return dict(vocab=engine.vocab_size, first_ms=first * 1e3, another_schema_ms=second * 1e3, cached_us=cached * 1e6)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for vocab, rows in results["end_to_end"].items():
        for spec in (False, True):
            sel = [r for r in rows if r["speculative"] is spec]
            if sel:
                a.plot(
                    [r["batch"] for r in sel],
                    [r["cpu_overhead_us_per_token"] for r in sel],
                    marker="o" if not spec else "s",
                    label=f"vocab {vocab}{', n-gram speculation' if spec else ''}",
                )
    a.set(xscale="log", xlabel="batch", ylabel="us per token", title="Engine: constrained - unconstrained (CPU time)")
    a.legend()
    for vocab, rows in results["sampler"].items():
        b.plot(
            [r["batch"] for r in rows], [r["overhead_us_per_token"] for r in rows], marker="o", label=f"vocab {vocab}"
        )
    b.set(xscale="log", xlabel="batch", ylabel="us per token", title="sample(): mask fill + apply + accept (CPU time)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, one short round")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from baton.serve.speculative import SpeculativeConfig

    vocabs = (320,) if args.smoke else args.vocabs
    batches = (1, 4) if args.smoke else (1, 8, 32)
    repeats = 1 if args.smoke else args.repeats
    results = dict(end_to_end={}, sampler={}, compile=[])
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in vocabs:
            ckpt = make_checkpoint(Path(tmp), vocab, args.smoke)
            rows = []
            for b, spec in [(b, None) for b in batches] + [(batches[-1], SpeculativeConfig("ngram", 4))]:
                rows.append(end_to_end(ckpt, b, repeats, spec))
                print(json.dumps(dict(vocab=vocab, **rows[-1])), flush=True)
            results["end_to_end"][vocab] = rows
            results["sampler"][vocab] = [sampler_only(ckpt, b, 8 if args.smoke else 64, repeats) for b in batches]
            results["compile"].append(compile_cost(ckpt))
    print(
        f"{'vocab':>6} {'batch':>5} {'spec':>5} {'tokens':>7} {'unconstr ms/tok':>15} {'constr ms/tok':>13} {'overhead us/tok':>15} {'%':>6}"
    )
    for vocab, rows in results["end_to_end"].items():
        for r in rows:
            print(
                f"{vocab:>6} {r['batch']:>5} {'ngram' if r['speculative'] else '-':>5} {r['tokens']:>7} "
                f"{r['unconstrained_ms_per_token']:>15.3f} {r['constrained_ms_per_token']:>13.3f} "
                f"{r['overhead_us_per_token']:>15.1f} {r['overhead_pct']:>5.1f}% "
                f"{r['cpu_unconstrained_ms_per_token']:>13.3f} {r['cpu_constrained_ms_per_token']:>7.3f} "
                f"{r['cpu_overhead_us_per_token']:>15.1f}"
            )
    print(f"\n{'vocab':>6} {'batch':>5} {'sample us/tok':>13} {'constrained us/tok':>18} {'overhead us/tok':>15}")
    for vocab, rows in results["sampler"].items():
        for r in rows:
            print(
                f"{vocab:>6} {r['batch']:>5} {r['sample_us_per_token']:>13.1f} "
                f"{r['constrained_sample_us_per_token']:>18.1f} {r['overhead_us_per_token']:>15.1f}"
            )
    for c in results["compile"]:
        print(
            f"compile, vocab {c['vocab']}: first {c['first_ms']:.1f} ms, another schema {c['another_schema_ms']:.1f} ms, cached {c['cached_us']:.1f} us"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / "structured.png")
    print(f"wrote {args.out / 'structured.json'} and structured.png")


if __name__ == "__main__":
    main()
