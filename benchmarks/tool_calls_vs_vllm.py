"""Tool calls over the OpenAI chat API, Baton against vLLM's CPU backend side by side on this machine.

One checkpoint both load: serve_vs_vllm.write_checkpoint's random HF Llama with a BPE tokenizer
trained here (Qwen3's markers: <|im_start|>/<|im_end|> special, <tool_call>/</tool_call> added
tokens kept in the text), chats rendered on both sides by our Qwen3-format template
(tests/serve/openai/templates/qwen3.jinja). Each engine runs alone as an OpenAI server on loopback
with serve_vs_vllm's threads, KV budget and scheduler limits, the same dtype, prefix caching on,
`--chat-template T --enable-auto-tool-choice --tool-call-parser hermes` (`baton serve --http-port`,
`vllm.entrypoints.openai.api_server`). The `openai` client sends, for 1, 10 and 50 random tools
(tool_call_grammar.random_tools, each `strict: true`: vLLM 0.32 enforces a non-strict tool's call
envelope only, not its arguments), at 1 client and a few (closed loop), temperature 1:

  1. tool_choice "required" (parallel_tool_calls false, fixed max_tokens), which each engine
     enforces with its own xgrammar structural tag; then the same requests with tool_choice "none"
     (same prompt, no grammar, nothing parsed), each with ignore_eos and max_tokens = the tokens its
     required run just made. Per token (wall / completion tokens, best of --repeats after a
     warm-up): both runs' cost and the grammar's overhead; and the required answers (all runs) that
     are a complete call whose arguments validate against its schema (jsonschema), with why the
     others are not. Plain chat without tools is the reference row. No seeds: vLLM 0.32's CPU
     runner dies ("CPU Generator does not use offset", EngineDeadError, every request in flight a
     500) when a seeded request's prompt is prefilled in chunks, as 50 tools' is.
  2. Time to first token (max_tokens=1) for tool sets the server has not seen: "none" (cold
     prefix), "none" (cached prefix), "required" (compile: a miss), "required" (a cache hit); miss -
     hit is the compile as a client sees it. Baton's /metrics adds its grammar cache counters.
  3. Streaming parser cost: a long hermes call tokenised by the checkpoint's tokenizer, fed a token
     a delta (cut at whole characters) to Baton's hermes parser and, in the vLLM venv, to vLLM's
     serving-layer parser (built as vllm_parser_reference.py builds it); us per token, and the
     streamed arguments checked against the call's JSON.

    .venv/bin/python benchmarks/tool_calls_vs_vllm.py [--model 25M] [--dtype fp32] [--tools 1 10 50]
        [--concurrency 1 8] [--requests 8] [--max-tokens 192] [--repeats 2] [--no-vllm] [--smoke] [--out DIR]
writes DIR/tool_calls_vs_vllm.{json,png} (default benchmarks/results/) and prints markdown tables;
--smoke: the tiny model, 2 tool counts, a few requests (with --no-vllm, what tests/benchmarks runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import jsonschema
import serve_vs_vllm as svv  # the script's folder is on sys.path; it and the next import only the stdlib
import vllm_parser_reference as ref
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEMPLATE = ROOT / "tests" / "serve" / "openai" / "templates" / "qwen3.jinja"
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"  # ../shared beside the repo
SPECIAL = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")  # end of text first (Qwen3's eos), then padding
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # Qwen3's: added tokens, not special
CONTEXT = 8192  # 50 tools render to ~6.6k prompt tokens here; RoPE has no position table: raising it is free
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MODEL_NAME = "m"


# ---------------------------------------------------------------------------------- the checkpoint
def openai_tools(tools: dict[str, dict]) -> list[dict]:
    return [
        {"type": "function", "function": {"name": n, "description": f"Tool {n}.", "parameters": s, "strict": True}}
        for n, s in tools.items()
    ]


def checkpoint(tmp: Path, model: str, dtype: str, smoke: bool) -> Path:
    """serve_vs_vllm's random Llama with a tokenizer and Qwen3's end of turn as its eos. The BPE
    learns from Shakespeare and from tool JSON of seeds no run uses, so a tool list costs tokens
    like a real tokenizer's would."""
    from baton.common.tokenizer import train_bpe
    from tokenizers import AddedToken
    from tool_call_grammar import random_tools

    path = svv.write_checkpoint(tmp, model, dtype)
    text = CORPUS.read_text()[: 20_000 if smoke else 300_000] if CORPUS.is_file() else "To be, or not to be. " * 999
    seeds = range(90_000, 90_010 if smoke else 90_100)
    corpus = [text] + [json.dumps(openai_tools(random_tools(20, seed=s))) for s in seeds]
    tok = train_bpe(corpus, vocab_size=svv.VOCAB - len(MARKERS), special_tokens=SPECIAL)
    tok.hf.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    tok.save(path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg.update(eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
        if name == "config.json":
            cfg["max_position_embeddings"] = CONTEXT
        (path / name).write_text(json.dumps(cfg, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------- the servers
def answers(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200
    return False


class Server:
    """One OpenAI server on loopback, its log in a file; `url` is its /v1 base."""

    def __init__(self, engine: str, cmd: list[str], log: Path, port: int | None = None):
        self.engine, self.metrics, t0 = engine, None, time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=svv.thread_env())
        while not (port and answers(f"http://127.0.0.1:{port}/v1/models")):  # the model list: loaded, serving
            if self.proc.poll() is not None or time.perf_counter() - t0 > 900:
                self.stop()
                raise RuntimeError(f"{engine} did not start:\n{log.read_text()[-5000:]}")
            if port is None and (m := re.search(r"ready: .* metrics=(\S+) http=[\d.]+:(\d+)", log.read_text())):
                self.metrics, port = m[1], int(m[2])
            time.sleep(0.5)
        self.url, self.startup_s = f"http://127.0.0.1:{port}/v1", time.perf_counter() - t0

    def grammar_stats(self) -> dict[str, float]:
        """Baton's grammar cache counters for tool sets (serve/metrics.py GrammarCollector)."""
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        out = {}
        for key, name in (("hits", "cache_hits"), ("misses", "cache_misses"), ("compile_seconds", "compile_seconds")):
            m = re.search(rf'^baton_grammar_{name}(?:_total)?{{kind="structural_tag"}} (\S+)$', text, re.M)
            out[key] = float(m[1]) if m else 0.0
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(engine: str, python: str, ckpt: Path, dtype: str, log: Path) -> Server:
    common = ["--max-model-len", str(CONTEXT), "--enable-prefix-caching", "--chat-template", str(TEMPLATE)]
    common += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dtype", DTYPES[dtype]]
    common += ["--served-model-name", MODEL_NAME]
    common += [f"--{k.replace('_', '-')}={v}" for k, v in svv.LIMITS.items()]
    if engine == "baton":
        cmd = [python, "-m", "baton.common.cli", "serve", "--model", str(ckpt), "--port", "0", "--http-port", "0"]
        cmd += ["--metrics-port", "0", "--kv-cache-mb", str(svv.KV_GIB * 1024), "--max-concurrent", "256"]
        return Server(engine, cmd + common, log)
    with socket.socket() as s:  # vLLM takes a port number, not 0
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--host", "127.0.0.1"]
    return Server(engine, cmd + ["--port", str(port), "--seed", "0"] + common, log, port)


# ---------------------------------------------------------------------------------- the client side
def chat(i: int, tools: list | None, choice: str | None, max_tokens: int, ignore_eos: bool = False) -> dict:
    """Request i's kwargs for chat.completions.create (the same conversation but for its number)."""
    user = f"Request {i}: pick a tool and fill in its arguments."
    kw = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=1.0)  # no seed: see the docstring
    kw["messages"] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": user}]
    if tools:  # one call an answer: a random model would otherwise write calls until max_tokens
        kw.update(tools=tools, tool_choice=choice, parallel_tool_calls=False)
    if ignore_eos:
        kw["extra_body"] = {"ignore_eos": True}
    return kw


def closed_loop(url: str, requests: list[dict], concurrency: int) -> tuple[float, list]:
    """`concurrency` clients, each sending its next request when its last one is answered: the wall
    time and the responses, in order."""

    async def main():
        out, todo = [None] * len(requests), list(enumerate(requests))
        async with AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800) as client:

            async def worker():
                while todo:
                    i, kw = todo.pop(0)
                    out[i] = await client.chat.completions.create(**kw)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - t0, out

    return asyncio.run(main())


def invalid(resp, schemas: dict[str, dict]) -> str | None:
    """Why a required answer is not a complete call, each naming a given tool with arguments that
    validate against its schema (None: it is): truncated, no call parsed, or the schema's error."""
    choice = resp.choices[0]
    if choice.finish_reason == "length":
        return "truncated"
    if not choice.message.tool_calls:
        return "no call parsed"
    for call in choice.message.tool_calls:
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        except (KeyError, ValueError, jsonschema.ValidationError) as e:
            return f"schema: {type(e).__name__}"
    return None


def tool_cell(url: str, n: int, c: int, first: int, args) -> dict:
    """Required vs the same requests unconstrained (tool_choice none, the same token counts)."""
    from tool_call_grammar import random_tools

    schemas = random_tools(n, seed=n)
    tools, ids = openai_tools(schemas), range(first, first + args.requests * c)
    required = [chat(i, tools, "required", args.max_tokens) for i in ids]
    answers = closed_loop(url, required, c)[1]  # warm-up: the tool set's compile, the prompt's prefix
    best_c = best_u = float("inf")
    for _ in range(args.repeats):
        wall_c, outs = closed_loop(url, required, c)
        answers, counts = answers + outs, [r.usage.completion_tokens for r in outs]
        wall_u, outs_u = closed_loop(url, [chat(i, tools, "none", k, True) for i, k in zip(ids, counts)], c)
        assert [r.usage.completion_tokens for r in outs_u] == counts, f"{n} tools: ignore_eos did not hold"
        best_c, best_u = min(best_c, wall_c / sum(counts)), min(best_u, wall_u / sum(counts))
    bad = [(w, r.choices[0].message) for r in answers if (w := invalid(r, schemas))]
    out = dict(tools=n, concurrency=c, requests=len(required), answers=len(answers), valid=len(answers) - len(bad))
    out |= dict(required_ms_per_token=best_c * 1e3, free_ms_per_token=best_u * 1e3)
    out |= dict(required_tok_per_s=1 / best_c, free_tok_per_s=1 / best_u)
    out |= dict(overhead_us_per_token=(best_c - best_u) * 1e6, overhead_pct=100 * (best_c - best_u) / best_u)
    out["invalid"] = {w: sum(x == w for x, _ in bad) for w in sorted({w for w, _ in bad})}
    out["invalid_examples"] = [{"why": w, **m.model_dump(include={"content", "tool_calls"})} for w, m in bad[:2]]
    return out


def plain_cell(url: str, c: int, args) -> dict:
    reqs = [chat(i, None, None, args.max_tokens, True) for i in range(args.requests * c)]
    closed_loop(url, reqs, c)
    best = min(closed_loop(url, reqs, c)[0] for _ in range(args.repeats)) / (len(reqs) * args.max_tokens)
    return dict(tools=0, concurrency=c, free_ms_per_token=best * 1e3, free_tok_per_s=1 / best)


def ttft_cell(server: Server, n: int, sets: int) -> dict:
    """Latency of max_tokens=1 for new tool sets: cold prefix, cached prefix, grammar miss, hit."""
    from tool_call_grammar import random_tools

    steps = (("cold", "none"), ("free", "none"), ("miss", "required"), ("hit", "required"))
    got: dict[str, list[float]] = {k: [] for k, _ in steps}
    before = server.grammar_stats() if server.metrics else None
    for k in range(sets):
        tools = openai_tools(random_tools(n, seed=50_000 + 100 * n + k))  # a set this server has not seen
        for key, choice in steps:
            got[key].append(closed_loop(server.url, [chat(k, tools, choice, 1)], 1)[0])
    out = {"tools": n, "engine": server.engine} | {f"ttft_{k}_ms": 1e3 * sorted(v)[len(v) // 2] for k, v in got.items()}
    out["compile_ms"] = out["ttft_miss_ms"] - out["ttft_hit_ms"]
    if before is not None:
        after = server.grammar_stats()
        out["server"] = {k: after[k] - before[k] for k in after}
        out["server_compile_ms"] = 1e3 * out["server"]["compile_seconds"] / max(out["server"]["misses"], 1)
    return out


def measure(server: Server, args) -> dict:
    out = {"startup_s": server.startup_s, "tool_calls": [], "plain": [], "ttft": []}
    for n in args.tools:
        out["ttft"].append(ttft_cell(server, n, args.ttft_sets))
        print(f"{server.engine} TTFT {json.dumps(out['ttft'][-1])}", flush=True)
    first = 0
    for c in args.concurrency:
        out["plain"].append(plain_cell(server.url, c, args))
        for n in args.tools:
            out["tool_calls"].append(tool_cell(server.url, n, c, first, args))
            print(f"{server.engine} {json.dumps(out['tool_calls'][-1])}", flush=True)
        first += args.requests * c  # each concurrency its own requests
    if server.metrics:
        out["grammar_cache"] = server.grammar_stats()
    return out


# ---------------------------------------------------------------------------------- streaming parsers
def long_call(items: int) -> tuple[list[dict], dict, str]:
    """One hermes call with `items` rows of arguments (mixed kinds, escapes, non-ASCII)."""
    kinds = {"id": "integer", "name": "string", "score": "number", "ok": "boolean"}
    row = {"type": "object", "properties": {k: {"type": v} for k, v in kinds.items()}}
    row["properties"]["tags"] = {"type": "array", "items": {"type": "string"}}
    schema = {"type": "object", "properties": {"rows": {"type": "array", "items": row}}, "required": ["rows"]}
    rows = [{"id": i, "name": f'"{i}" à\n', "score": i / 7, "ok": i % 2 == 0, "tags": [f"t{i}"]} for i in range(items)]
    call = json.dumps({"name": "record_rows", "arguments": {"rows": rows}}, ensure_ascii=False)
    tools = [{"type": "function", "function": {"name": "record_rows", "parameters": schema}}]
    return tools, {"rows": rows}, f"<tool_call>\n{call}\n</tool_call>"


def parser_result(stream_s: float, unary_s: float, job: dict, pieces: list[tuple[str | None, str | None]]) -> dict:
    """Per-token costs, and whether the streamed pieces (id, argument fragment) make the call."""
    arguments, n = "".join(a or "" for _, a in pieces), len(job["chunks"])
    ok = arguments != "" and json.loads(arguments) == job["arguments"]
    out = dict(tokens=n, stream_us_per_token=stream_s / n * 1e6, unary_us_per_token=unary_s / n * 1e6)
    return out | dict(streamed_arguments_equal=ok, ids_sent=sum(i is not None for i, _ in pieces))


def best_time(repeats: int, setup, run) -> tuple[float, object]:
    """The fastest of `repeats` run(setup()) (setup not timed: a new parser each time), and a result."""
    best = float("inf")
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter()
        got = run(state)
        best = min(best, time.perf_counter() - t0)
    return best, got


def baton_parser_cost(job: dict) -> dict:
    from baton.serve.openai.tool_parsers import tool_parser_class

    cls, texts = tool_parser_class("hermes"), [t for t, _ in job["chunks"]]

    def stream(p):
        return [d for t in texts for d in p.feed(t).tool_calls] + p.finish().tool_calls

    stream_s, pieces = best_time(job["repeats"], lambda: cls(job["tools"]), stream)
    unary_s, _ = best_time(job["repeats"], lambda: cls(job["tools"]), lambda p: p.parse(job["text"]))
    return parser_result(stream_s, unary_s, job, [(d.id, d.arguments) for d in pieces])


def vllm_parser_cost(job: dict) -> dict:
    """Runs in the vLLM venv: vLLM's serving-layer hermes parser, as vllm_parser_reference builds it."""
    import logging

    from transformers import AutoTokenizer

    logging.disable(logging.WARNING)
    tok, case = AutoTokenizer.from_pretrained(job["ckpt"]), {"parser": "hermes", "tools": job["tools"]}
    chunks = [(i == len(job["chunks"]) - 1, t, ids) for i, (t, ids) in enumerate(job["chunks"])]

    def new():
        request = ref.build_request(case)
        return ref.make_parser(case, tok, request), request

    def stream(state):
        parser, request = state
        deltas = [parser.parse_delta(t, ids, request, [], finished=last) for last, t, ids in chunks]
        return [c for d in deltas if d is not None for c in d.tool_calls or []]

    def unary(state):
        return state[0].parse(job["text"], state[1], enable_auto_tools=True, model_output_token_ids=job["ids"])

    stream_s, calls = best_time(job["repeats"], new, stream)
    unary_s, _ = best_time(job["repeats"], new, unary)
    return parser_result(stream_s, unary_s, job, [(c.id, c.function.arguments if c.function else "") for c in calls])


def parser_costs(ckpt: Path, items: int, repeats: int, vllm_python: str | None, tmp: Path) -> dict:
    from transformers import AutoTokenizer

    tools, arguments, text = long_call(items)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok.encode(text, add_special_tokens=False)
    chunks = ref.char_aligned_chunks(tok, ids, 1)  # one token a delta, grown to whole characters
    job = dict(ckpt=str(ckpt), tools=tools, arguments=arguments, text=text, ids=ids, chunks=chunks, repeats=repeats)
    out = {"chars": len(text), "baton": baton_parser_cost(job)}
    if vllm_python:
        (tmp / "parser_job.json").write_text(json.dumps(job))
        cmd = [vllm_python, __file__, "--parser-driver", str(tmp / "parser_job.json"), str(tmp / "parser_out.json")]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"vLLM parser driver failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
        out["vllm"] = json.loads((tmp / "parser_out.json").read_text())
    return out


# ---------------------------------------------------------------------------------- the report
def row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def cost_cells(x: dict) -> list[str]:
    if "required_ms_per_token" not in x:  # plain chat: nothing to require
        return [f"{x['free_ms_per_token']:.2f}", "-", "-", "-"]
    over = f"{x['overhead_us_per_token']:.0f} ({x['overhead_pct']:+.0f}%)"
    return [f"{x['free_ms_per_token']:.2f}", f"{x['required_ms_per_token']:.2f}", over, f"{x['valid']}/{x['answers']}"]


def table(results: dict) -> str:
    sides, e = results["sides"], results["engines"]
    kinds = ("none ms/tok", "required ms/tok", "overhead us/tok", "valid")
    head = ["tools", "clients", *(f"{s} {k}" for s in sides for k in kinds)]
    head += ["required tok/s Baton/vLLM", "none tok/s Baton/vLLM"] if "vllm" in e else []
    lines = ["Per-token cost (wall / completion tokens, best run):", "", row(head), row(["---"] * len(head))]
    for part in ("tool_calls", "plain"):
        for i, r in enumerate(e["baton"][part]):
            cells = [r["tools"] or "no tools", r["concurrency"], *(c for s in sides for c in cost_cells(e[s][part][i]))]
            if "vllm" in e:
                v = e["vllm"][part][i]
                cells += [f"{r[k] / v[k]:.2f}x" if k in r else "-" for k in ("required_tok_per_s", "free_tok_per_s")]
            lines.append(row(cells))
    head = ["tools", "engine", "cold prefix", "cached prefix", "grammar miss", "grammar hit", "miss - hit"]
    lines += ["", "Time to first token, ms (max_tokens=1, median over new tool sets):", ""]
    lines += [row(head + ["server compile"]), row(["---"] * 8)]
    keys = ("ttft_cold_ms", "ttft_free_ms", "ttft_miss_ms", "ttft_hit_ms", "compile_ms", "server_compile_ms")
    for i, r in enumerate(e["baton"]["ttft"]):
        for t in (e[s]["ttft"][i] for s in sides):
            lines.append(row([r["tools"], t["engine"], *(f"{t[k]:.1f}" if k in t else "-" for k in keys)]))
    p = results["parsers"]
    head = ["parser", "tokens", "stream us/token", "unary us/token", "streamed args = JSON", "ids sent"]
    lines += ["", f"Streaming hermes parser, one call of {p['chars']} characters fed token by token:", ""]
    lines += [row(head), row(["---"] * 6)]
    keys = ("tokens", "stream_us_per_token", "unary_us_per_token", "streamed_arguments_equal", "ids_sent")
    lines += [row([s, *(f"{x:.2f}" if isinstance(x, float) else x for x in map(p[s].get, keys))]) for s in sides]
    if "grammar_cache" in e["baton"]:
        g = e["baton"]["grammar_cache"]
        lines.append(f"\nBaton's tool-set grammar cache, whole run: {g['hits']:.0f} hits, {g['misses']:.0f} misses")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e, sides, colors = results["engines"], results["sides"], {"baton": "C0", "vllm": "C1"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for s in sides:
        for cc, style in zip(sorted({r["concurrency"] for r in e[s]["tool_calls"]}), ("-", "--")):
            rows = [r for r in e[s]["tool_calls"] if r["concurrency"] == cc]
            for key, mark, alpha in (("required", "o", 1.0), ("free", "x", 0.5)):
                y = [r[f"{key}_ms_per_token"] for r in rows]
                label = f"{s} {'none' if key == 'free' else key}, clients={cc}"
                a.plot([r["tools"] for r in rows], y, style, marker=mark, alpha=alpha, color=colors[s], label=label)
        x = [r["tools"] for r in e[s]["ttft"]]
        for key, style in (("miss", "-"), ("hit", "--")):
            y = [r[f"ttft_{key}_ms"] for r in e[s]["ttft"]]
            b.plot(x, y, style, marker="o", color=colors[s], label=f"{s} grammar {key}")
    a.set(xscale="log", xlabel="tools", ylabel="ms per completion token", title="required vs none (same tokens)")
    b.set(xscale="log", yscale="log", xlabel="tools", ylabel="ms", title="Time to first token, a new tool set")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    p = results["parsers"]
    for key, alpha in (("stream", 1.0), ("unary", 0.5)):
        y = [p[s][f"{key}_us_per_token"] for s in sides]
        c.bar([f"{s}\n{key}" for s in sides], y, color=[colors[s] for s in sides], alpha=alpha)
    c.set(ylabel="us per token", title=f"hermes parser, a {p['baton']['tokens']}-token call")
    fig.suptitle(f"Tool calls over the OpenAI API, {results['model']} {results['dtype']}, {results['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_model() -> str:
    names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    return f"{names[0] if names else 'unknown CPU'} x{len(os.sched_getaffinity(0))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="25M", help="a serve_vs_vllm.MODELS name")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--tools", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=8, help="requests per client in a tool-call run")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cell after a warm-up (best kept)")
    ap.add_argument("--ttft-sets", type=int, default=5, help="new tool sets per TTFT measurement (median)")
    ap.add_argument("--parser-items", type=int, default=60, help="rows in the streamed call's arguments")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "baton" / "vllm-venv")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, a few requests (Baton alone: --no-vllm)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--parser-driver", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.parser_driver:  # in the vLLM venv
        job = json.loads(Path(args.parser_driver[0]).read_text())
        return Path(args.parser_driver[1]).write_text(json.dumps(vllm_parser_cost(job)))
    if args.smoke:
        args.model, args.tools, args.concurrency = "tiny", [1, 10], [1, 2]
        args.requests, args.max_tokens, args.repeats, args.ttft_sets, args.parser_items = 1, 64, 1, 1, 10
    sides = {"baton": sys.executable}
    if not args.no_vllm:
        sides["vllm"] = str(svv.ensure_vllm_venv(args.vllm_venv))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "vllm_venv", "parser_driver")}
    results = dict(model=args.model, dtype=args.dtype, cpu=cpu_model(), load_at_start=os.getloadavg()[0])
    results |= dict(vllm=svv.VLLM_VERSION, sides=list(sides), settings=settings, engines={})
    out = args.out / "tool_calls_vs_vllm.json"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ckpt = checkpoint(tmp, args.model, args.dtype, args.smoke)
        for side, python in sides.items():
            server = start(side, python, ckpt, args.dtype, tmp / f"{side}.log")
            try:
                results["engines"][side] = measure(server, args)
            except Exception:  # the server's side of the story (the tmp dir goes away)
                print((tmp / f"{side}.log").read_text()[-5000:], file=sys.stderr)
                raise
            finally:
                server.stop()
            out.write_text(json.dumps(results, indent=1) + "\n")  # a run killed midway keeps what it measured
        results["parsers"] = parser_costs(ckpt, args.parser_items, 3 if args.smoke else 20, sides.get("vllm"), tmp)
    results["table"] = table(results)
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"{results['table']}\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
