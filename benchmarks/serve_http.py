"""OpenAI HTTP front overhead: the same closed-loop load through HTTP, through gRPC, and straight
into the engine.

For each concurrency level, C clients each send their next request as soon as the previous one
finishes (benchmarks/serve_grpc.py's driver). The same requests run (a) in this process against
AsyncLLMEngine, no server; (b) over gRPC and (c) over HTTP (POST /v1/completions, stream: true,
server-sent events, read with aiohttp) against ONE `baton serve --http-port` subprocess, so both
fronts share the engine and the difference between them is the protocol's cost. TTFT is send ->
first token, ITL the gap between streamed pieces, both seen by the client. Greedy texts over HTTP
are checked against the offline engine's (LLM.generate), and HTTP usage against the tokens made.

Usage: python benchmarks/serve_http.py [--smoke] [--out DIR]
(writes DIR/serve_http.{json,png}, default benchmarks/results; the model: random weights and a
BPE tokenizer trained here, so the HTTP path detokenizes as it would in use)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from baton.common.checkpoint import save_model
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.common.tokenizer import train_bpe
from baton.serve.llm import LLM
from baton.serve.sampling_params import SamplingParams

from serve_engine import MODEL, RESULTS  # noqa: E402 - the script dir is on sys.path
from serve_grpc import KV_MB, MAX_SEQS, closed_loop, engine_config, engine_runner, in_thread, plot, run_grpc, workload

SMOKE_MODEL = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"  # ../shared beside the repo
PATHS = (
    ("engine", "engine, no server", "C0"),
    ("grpc", "baton serve, gRPC", "C1"),
    ("http", "baton serve, HTTP", "C2"),
)


def checkpoint(tmp: Path, model: dict) -> Path:
    text = CORPUS.read_text()[:200_000] if CORPUS.is_file() else "The quick brown fox jumps over the lazy dog. " * 4000
    tok = train_bpe([text], vocab_size=model["vocab_size"])
    return save_model(tmp / "model", build_model(ModelConfig(**model), seed=0), tokenizer=tok)


def start_server(ckpt: Path, log: Path) -> tuple[subprocess.Popen, str, int]:
    """One `baton serve` with both fronts: (process, gRPC target, HTTP port)."""
    cmd = [sys.executable, "-m", "baton.common.cli", "serve", "--model", str(ckpt), "--port", "0", "--http-port", "0"]
    cmd += ["--metrics-port", "-1", "--kv-cache-mb", str(KV_MB), "--max-num-seqs", str(MAX_SEQS)]
    cmd += ["--max-concurrent", str(MAX_SEQS)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not (m := re.search(r"ready: .* grpc=([\d.]+:\d+) .* http=[\d.]+:(\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text())
        time.sleep(0.1)
    return proc, m[1], int(m[2])


def run_http(port: int, prompts, concurrency: int, max_tokens: int) -> dict:
    """The closed loop over HTTP+SSE. One chunk is one engine step's piece (one token without
    speculation); the texts and the usage come back for the checks."""
    import aiohttp

    texts, usage = {}, {}

    async def main():
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

            async def one(prompt):
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                parts = []
                async with session.post(url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    async for line in resp.content:
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            parts.append(chunk["choices"][0]["text"])
                            yield [0]
                        else:
                            usage[id(prompt)] = chunk["usage"]["completion_tokens"]
                texts[id(prompt)] = "".join(parts)

            return await closed_loop(prompts, concurrency, one)

    r = asyncio.run(main())
    r["texts"] = [texts[id(p)] for p in prompts]
    r["usage_tokens"] = sum(usage[id(p)] for p in prompts)
    r["tokens"] = r["usage_tokens"]
    r["tok_per_s"] = r["tokens"] / r["wall_s"]
    return r


def table(results: dict) -> str:
    head = f"| clients | path | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | vs engine |\n|{'---|' * 8}"
    rows = [head]
    for c in results["concurrency"]:
        run = results["runs"][str(c)]
        for key, _, _ in PATHS:
            r = run[key]
            ratio = r["tok_per_s"] / run["engine"]["tok_per_s"]
            rows.append(
                f"| {c} | {key} | {r['tok_per_s']:.0f} | {r['ttft_p50_ms']:.1f} ms | {r['ttft_p99_ms']:.1f} ms | "
                f"{r['itl_p50_ms']:.2f} ms | {r['itl_p99_ms']:.2f} ms | {ratio:.2f} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest is kept (shared machine)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 8 requests of 8 tokens, 1 and 4 clients, once")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    model = MODEL
    if args.smoke:
        args.requests, args.max_tokens, args.concurrency, args.repeats, model = 8, 8, [1, 4], 1, SMOKE_MODEL
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    ckpt = checkpoint(tmp, model)
    prompts = workload(args.requests, model["vocab_size"])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    llm = LLM(ckpt, engine_config())
    in_thread(llm.generate, prompts, params)  # warm-up: CPU kernels are slow the first time they meet a shape
    offline_s = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ref = in_thread(llm.generate, prompts, params)
        offline_s = min(offline_s, time.perf_counter() - t0)
    ref_ids, ref_texts = [o.outputs[0].token_ids for o in ref], [o.outputs[0].text for o in ref]
    del llm
    results = {
        "model": model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "offline_tok_per_s": sum(map(len, ref_ids)) / offline_s,
        # uvicorn's HTTP parser: httptools (C) where installed, else h11 (pure Python, slower per event)
        "http_parser": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "runs": {},
    }
    run_engine, stop_engine = engine_runner(ckpt, params)
    proc, target, port = start_server(ckpt, tmp / "serve.log")
    drop = ("outputs", "ttft", "itl", "texts")
    try:
        run_engine(prompts, max(args.concurrency))  # the same warm-up for every path
        run_grpc(target, prompts, max(args.concurrency), args.max_tokens)
        run_http(port, prompts, max(args.concurrency), args.max_tokens)
        for c in args.concurrency:
            best = {
                "engine": max((run_engine(prompts, c) for _ in range(args.repeats)), key=lambda r: r["tok_per_s"]),
                "grpc": max(
                    (run_grpc(target, prompts, c, args.max_tokens) for _ in range(args.repeats)),
                    key=lambda r: r["tok_per_s"],
                ),
                "http": max(
                    (run_http(port, prompts, c, args.max_tokens) for _ in range(args.repeats)),
                    key=lambda r: r["tok_per_s"],
                ),
            }
            results["runs"][str(c)] = {k: {m: v for m, v in r.items() if m not in drop} for k, r in best.items()}
            results["runs"][str(c)]["http_texts_differing_from_offline"] = sum(
                a != b for a, b in zip(best["http"]["texts"], ref_texts)
            )
            results["runs"][str(c)]["grpc_outputs_differing_from_offline"] = sum(
                a != b for a, b in zip(best["grpc"]["outputs"], ref_ids)
            )
            results["runs"][str(c)]["http_usage_equals_tokens_made"] = best["http"]["usage_tokens"] == sum(
                map(len, ref_ids)
            )
    finally:
        stop_engine()
        proc.terminate()
        proc.wait(60)
    results["table"] = table(results)
    print(
        f"\n{args.requests} requests, prompts 16-128 tokens, {args.max_tokens} output tokens each; "
        f"offline LLM.generate: {results['offline_tok_per_s']:.0f} tok/s; HTTP parser {results['http_parser']}\n"
        f"{results['table']}"
    )
    for c in args.concurrency:
        run = results["runs"][str(c)]
        print(
            f"clients {c}: HTTP texts differing from offline {run['http_texts_differing_from_offline']}, gRPC "
            f"outputs differing {run['grpc_outputs_differing_from_offline']}, HTTP usage = tokens made: "
            f"{run['http_usage_equals_tokens_made']}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_http.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(
        results,
        args.out / "serve_http.png",
        PATHS,
        "OpenAI HTTP front vs gRPC front vs engine, same closed-loop load (CPU, 2 cores)",
    )
    print(f"wrote {args.out / 'serve_http.json'} and {args.out / 'serve_http.png'}")


if __name__ == "__main__":
    main()
