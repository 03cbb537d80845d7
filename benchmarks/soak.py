"""Soak: a freshly started `baton serve` under concurrent load on every API at once.

C client threads send a fixed budget of requests to one fresh server, through the OpenAI HTTP API
(completions with n > 1 and sampling, seeded, chat, chat streams, structured output), gRPC
(Baton's Generate, streamed and unary) and KServe v2 (tritonclient), with a third of the streams
dropped by the client after a few chunks and a share of bad requests. The load opens with a burst
of chat requests on the cold server, the moment a load balancer's first wave hits it.

What it records: every request's outcome (ok; refused, for a bad request that got its 4xx or
INVALID_ARGUMENT; server_error for a 5xx / INTERNAL / UNAVAILABLE; dropped for a lost connection;
unexpected for anything else) and latency, and every half second the server's RSS, KV blocks in
use, calls queued for admission and sequences waiting in the engine. Afterwards: the KV pool must
drain to zero blocks in use, health must be SERVING, a greedy answer must be what it was before,
and the server's log must hold exactly one `outcome=` line per request sent.

tests/serve/test_soak.py runs the short form of this in the suite (a few hundred requests);
this script runs the long one and writes DIR/soak.{json,png} with a table over time.
Usage: python benchmarks/soak.py [--requests N] [--clients C] [--smoke] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
import openai

from baton.serve.client import BatonClient

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["The quick brown fox", "def f(x):", "Émigré naïve café", "The lazy dog jumps over", "return x * 2"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something about foxes."}]
# ChatML-like; <|endoftext|> (the BPE tokenizer's special token) ends each turn
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
MAX_TOKENS = 12
# Request kinds and their weights in the mix after the opening burst. Streams: 6 kinds, 3 dropped.
KINDS = {
    "completion_n": 3,
    "completion_greedy": 2,
    "completion_stream_dropped": 2,
    "chat": 3,
    "chat_stream": 2,
    "chat_stream_dropped": 2,
    "structured": 2,
    "http_bad": 2,
    "grpc_stream": 2,
    "grpc_stream_dropped": 2,
    "grpc_unary": 2,
    "grpc_bad": 1,
    "kserve": 2,
    "kserve_stream_dropped": 1,
}
BAD = {"http_bad", "grpc_bad"}


@dataclass
class Result:
    kind: str
    outcome: str  # ok | refused | server_error | dropped | unexpected
    detail: str
    start: float  # seconds since the load began
    latency: float


class Client:
    """One client thread's connections: an OpenAI client (its own HTTP pool), a gRPC channel, a
    KServe client."""

    def __init__(self, http_port: int, grpc_target: str, model: str):
        import tritonclient.grpc as tc

        self.model = model
        self.oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        self.grpc = BatonClient(grpc_target, timeout=300)
        self.tc, self.triton = tc, tc.InferenceServerClient(grpc_target)

    def close(self) -> None:
        self.oa.close()
        self.grpc.close()
        self.triton.close()

    # ------------------------------------------------------------------------------ requests
    def send(self, kind: str, i: int) -> str:
        """Run request i of this kind; returns a detail string, raises on failure."""
        prompt, seed = PROMPTS[i % len(PROMPTS)], i
        oa, m = self.oa, self.model
        if kind == "completion_n":
            r = oa.completions.create(model=m, prompt=prompt, n=3, temperature=0.9, seed=seed, max_tokens=MAX_TOKENS)
            assert len(r.choices) == 3, r
        elif kind == "completion_greedy":
            r = oa.completions.create(model=m, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
        elif kind == "completion_stream_dropped":
            kw = dict(max_tokens=64, stream=True, extra_body={"ignore_eos": True})
            with oa.completions.create(model=m, prompt=prompt, **kw) as s:
                _take(s, 2)
        elif kind == "chat":
            r = oa.chat.completions.create(model=m, messages=CHAT, temperature=0.7, seed=seed, max_tokens=MAX_TOKENS)
            assert r.choices[0].message.role == "assistant", r
        elif kind == "chat_stream":
            with oa.chat.completions.create(model=m, messages=CHAT, max_tokens=MAX_TOKENS, stream=True) as s:
                chunks = _take(s, None)
            assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1:]
        elif kind == "chat_stream_dropped":
            kw = dict(max_tokens=64, stream=True, extra_body={"ignore_eos": True})
            with oa.chat.completions.create(model=m, messages=CHAT, **kw) as s:
                _take(s, 2)
        elif kind == "structured":
            fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
            r = oa.chat.completions.create(model=m, messages=CHAT, response_format=fmt, max_tokens=16, seed=seed)
            assert r.choices[0].message.content.startswith("{"), r
        elif kind == "http_bad":
            bad = [dict(temperature=-1.0), dict(n=0), dict(max_tokens=0), dict(model="no-such-model")][i % 4]
            oa.completions.create(**{"model": m, "prompt": prompt, "max_tokens": MAX_TOKENS, **bad})
            raise AssertionError(f"a bad request was accepted: {bad}")
        elif kind == "grpc_stream":
            msgs = list(self.grpc.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.8, seed=seed))
            assert msgs[-1].finished, msgs[-1]
        elif kind == "grpc_stream_dropped":
            stream = self.grpc.generate(prompt, max_tokens=64, ignore_eos=True)
            next(stream), next(stream)
            stream.close()  # cancels the call
        elif kind == "grpc_unary":
            r = self.grpc.complete(prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert r.finished, r
        elif kind == "grpc_bad":
            list(self.grpc.generate(prompt, max_tokens=MAX_TOKENS, temperature=-1.0))
            raise AssertionError("a bad gRPC request was accepted")
        elif kind == "kserve":
            out = self.triton.infer(m, self._triton_inputs(prompt, seed))
            assert out.as_numpy("text_output")[0].decode().startswith(prompt)
        elif kind == "kserve_stream_dropped":
            self._kserve_stream_dropped(prompt, seed, i)
        else:
            raise ValueError(f"unknown request kind {kind!r}")
        return ""

    def _triton_inputs(self, prompt: str, seed: int, stream: bool = False, max_tokens: int = MAX_TOKENS) -> list:
        tc = self.tc
        ins = [tc.InferInput("text_input", [1], "BYTES"), tc.InferInput("sampling_parameters", [1], "BYTES")]
        ins.append(tc.InferInput("stream", [1], "BOOL"))
        sampling = {"temperature": 0.8, "seed": seed, "max_tokens": max_tokens, "ignore_eos": stream}
        ins[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        ins[1].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
        ins[2].set_data_from_numpy(np.array([stream]))
        return ins

    def _kserve_stream_dropped(self, prompt: str, seed: int, i: int) -> None:
        """A KServe stream closed by the client after its first response."""
        first: list = []  # the first callback's error (None: a response); later ones are our own cancel
        got = threading.Event()

        def callback(result, error) -> None:
            if not got.is_set():
                first.append(error)
                got.set()

        self.triton.start_stream(callback=callback)
        try:
            self.triton.async_stream_infer(self.model, self._triton_inputs(prompt, seed, True, 64), request_id=str(i))
            assert got.wait(300), "no response on the KServe stream"
        finally:
            self.triton.stop_stream(cancel_requests=True)
        if first[0] is not None:
            raise first[0]


def _take(stream, n: int | None) -> list:
    """The first n chunks of an OpenAI stream (all of them for None)."""
    return list(itertools.islice(stream, n))


def classify(kind: str, e: BaseException | None) -> tuple[str, str]:
    """(outcome, detail) of one request. A bad request must be refused with a 4xx / INVALID_ARGUMENT;
    everything else must succeed."""
    if e is None:
        return ("unexpected", "a bad request was accepted") if kind in BAD else ("ok", "")
    if isinstance(e, openai.APIStatusError):
        code = e.status_code
        if code >= 500:
            return "server_error", f"HTTP {code}: {e.message}"
        return ("refused" if kind in BAD else "unexpected"), f"HTTP {code}: {e.message}"
    if isinstance(e, (openai.APIConnectionError, ConnectionError)):
        return "dropped", repr(e)
    if isinstance(e, grpc.RpcError):
        code = e.code()
        detail = f"{code.name}: {e.details()}"
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
            return "server_error", detail
        return ("refused" if kind in BAD and code == grpc.StatusCode.INVALID_ARGUMENT else "unexpected"), detail
    text = f"{type(e).__name__}: {e}"
    if "StatusCode.INTERNAL" in text or "StatusCode.UNAVAILABLE" in text:  # tritonclient's own exception
        return "server_error", text
    return "unexpected", text


def schedule(requests: int, burst: int, seed: int = 0) -> list[str]:
    """The request kinds in order: `burst` chats first (half streamed), then the weighted mix."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    opening = ["chat" if j % 2 == 0 else "chat_stream" for j in range(min(burst, requests))]
    return opening + rng.choices(kinds, weights, k=requests - len(opening))


def run_load(http_port: int, grpc_target: str, model: str, kinds: list[str], clients: int, burst: int) -> list[Result]:
    """Every request in `kinds` from `clients` threads; the first `burst` leave together."""
    results: list[Result | None] = [None] * len(kinds)
    gate = threading.Barrier(min(burst, clients)) if burst else None
    counter = itertools.count()
    t0 = time.monotonic()

    def worker(w: int) -> None:
        client = Client(http_port, grpc_target, model)
        try:
            while (i := next(counter)) < len(kinds):
                if gate is not None and i < gate.parties:
                    gate.wait(120)
                start = time.monotonic()
                err = None
                try:
                    client.send(kinds[i], i)
                except Exception as e:  # noqa: BLE001 - classified below, whatever it is
                    err = e
                outcome, detail = classify(kinds[i], err)
                results[i] = Result(kinds[i], outcome, detail, start - t0, time.monotonic() - start)
        finally:
            client.close()

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(worker, w) for w in range(clients)]:
            f.result()
    return [r for r in results if r is not None]


# ------------------------------------------------------------------------------ the server's side
def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples, by name with labels (e.g. 'baton_kv_blocks{state="used"}')."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


class Sampler:
    """Every `every` seconds while the load runs: RSS, KV blocks in use, calls queued, sequences waiting."""

    def __init__(self, pid: int, metrics_url: str, every: float = 0.5):
        self.pid, self.url, self.every = pid, metrics_url, every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            m = metrics(self.url)
            self.samples.append(
                {
                    "t": time.monotonic() - self.t0,
                    "rss_mib": rss_mib(self.pid),
                    "kv_used": m.get('baton_kv_blocks{state="used"}', 0.0),
                    "queued": m.get("baton_queued_calls", 0.0),
                    "waiting": m.get("baton_engine_waiting_seqs", 0.0),
                }
            )


def wait_kv_idle(metrics_url: str, timeout: float = 60) -> float:
    """KV blocks in use once the server is idle (dropped streams are aborted asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        used = metrics(metrics_url).get('baton_kv_blocks{state="used"}', -1.0)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def requests_logged(log: str) -> dict[str, int]:
    """`outcome=` lines in a server log, by outcome."""
    counts: dict[str, int] = {}
    for outcome in re.findall(r"^.*\brequest id=\S+ .*\boutcome=(\w+)", log, flags=re.M):
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def greedy(grpc_target: str) -> list[int]:
    with BatonClient(grpc_target, timeout=120) as c:
        return list(c.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).completions[0].token_ids)


def summarize(results: list[Result], windows: int = 10) -> dict:
    by_outcome: dict[str, int] = {}
    for r in results:
        by_outcome[r.outcome] = by_outcome.get(r.outcome, 0) + 1
    span = max((r.start + r.latency for r in results), default=0.0)
    rows = []
    for w in range(windows):
        lo, hi = span * w / windows, span * (w + 1) / windows
        lat = sorted(r.latency for r in results if lo <= r.start < hi and r.kind not in BAD)
        if lat:
            rows.append(
                {
                    "from_s": lo,
                    "to_s": hi,
                    "requests": len(lat),
                    "p50_ms": 1e3 * statistics.median(lat),
                    "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                }
            )
    return {"by_outcome": by_outcome, "seconds": span, "latency_windows": rows}


# ------------------------------------------------------------------------------ the benchmark
def start_server(ckpt: Path, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str, int, str]:
    """A fresh `baton serve` with every front: (process, gRPC target, HTTP port, metrics URL)."""
    cmd = [sys.executable, "-m", "baton.common.cli", "serve", "--model", str(ckpt), "--served-model-name", "soak"]
    cmd += ["--port", "0", "--http-port", "0", "--metrics-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    pattern = r"ready: .* grpc=([\d.]+:\d+) .* metrics=(http://[\d.]+:\d+/metrics) http=[\d.]+:(\d+)"
    deadline = time.monotonic() + 300
    while not (m := re.search(pattern, log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"baton serve did not become ready:\n{log.read_text()}")
        time.sleep(0.05)
    return proc, m[1], int(m[3]), m[2]


def checkpoint(tmp: Path, smoke: bool) -> Path:
    """A random-weight Llama with a BPE tokenizer and a ChatML-like chat template."""
    from baton.common.checkpoint import METADATA_FILE, save_model, sha256_file
    from baton.common.config import ModelConfig
    from baton.common.model import build_model
    from baton.common.tokenizer import train_bpe

    corpus = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    text = corpus.read_text()[:200_000] if corpus.is_file() else "The quick brown fox jumps over the lazy dog. " * 4000
    size = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2) if smoke else {}
    model = {**dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4), **size}
    model |= dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    tok = train_bpe([text], vocab_size=model["vocab_size"])
    ckpt = save_model(tmp / "model", build_model(ModelConfig(**model, eos_token_id=tok.eos_token_id)), tokenizer=tok)
    cfg_path = ckpt / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": CHAT_TEMPLATE}))
    meta = json.loads((ckpt / METADATA_FILE).read_text())
    meta["sha256"]["tokenizer_config.json"] = sha256_file(cfg_path)
    (ckpt / METADATA_FILE).write_text(json.dumps(meta))
    return ckpt


def plot(samples: list[dict], windows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    t = [s["t"] for s in samples]
    ax[0].plot(t, [s["rss_mib"] for s in samples])
    ax[0].set(title="server RSS", xlabel="s", ylabel="MiB")
    ax[1].plot(t, [s["kv_used"] for s in samples], label="KV blocks in use")
    ax[1].plot(t, [s["queued"] for s in samples], label="calls queued")
    ax[1].plot(t, [s["waiting"] for s in samples], label="sequences waiting")
    ax[1].set(title="engine load", xlabel="s")
    ax[1].legend()
    mid = [(w["from_s"] + w["to_s"]) / 2 for w in windows]
    ax[2].plot(mid, [w["p50_ms"] for w in windows], "o-", label="p50")
    ax[2].plot(mid, [w["p99_ms"] for w in windows], "o-", label="p99")
    ax[2].set(title="request latency (by start time)", xlabel="s", ylabel="ms")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="default 30000 (--smoke: 200)")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--burst", type=int, default=48, help="chat requests that open the load together")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model and 200 requests")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.requests is None:
        args.requests = 200 if args.smoke else 30000
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = checkpoint(tmp, args.smoke)
        log = tmp / "serve.log"
        proc, target, http_port, murl = start_server(ckpt, log, ["--max-queued", str(4 * args.requests)])
        try:
            rss_start = rss_mib(proc.pid)
            kinds = schedule(args.requests, args.burst)
            print(f"soak: {len(kinds)} requests from {args.clients} clients on a fresh server", flush=True)
            with Sampler(proc.pid, murl) as sampler:
                results = run_load(http_port, target, "soak", kinds, args.clients, args.burst)
            kv_after = wait_kv_idle(murl)
            with BatonClient(target, timeout=30) as c:
                health = c.health()
            logged = requests_logged(log.read_text())
        finally:
            proc.terminate()
            proc.wait(60)
    summary = summarize(results)
    samples = sampler.samples
    report = {
        "requests": len(results),
        "clients": args.clients,
        "burst": args.burst,
        "model": "smoke" if args.smoke else "4 layers, hidden 256, vocab 2048",
        **summary,
        "rss_mib": {"start": rss_start, "peak": max(s["rss_mib"] for s in samples), "end": samples[-1]["rss_mib"]},
        "kv_used_after": kv_after,
        "health_after": health,
        "log_lines": sum(logged.values()),
        "log_outcomes": logged,
        "failures": [asdict(r) for r in results if r.outcome not in ("ok", "refused")][:20],
        "samples": samples,
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(samples, summary["latency_windows"], args.out / "soak.png")
    print(f"outcomes: {summary['by_outcome']}; log lines {report['log_lines']} for {len(results)} requests")
    print(f"RSS MiB start/peak/end: {rss_start:.0f}/{report['rss_mib']['peak']:.0f}/{report['rss_mib']['end']:.0f}")
    print(f"KV blocks in use afterwards: {kv_after:.0f}; health: {health}")
    print("| window (s) | requests | p50 ms | p99 ms |\n|---|---|---|---|")
    for w in summary["latency_windows"]:
        print(f"| {w['from_s']:.1f}-{w['to_s']:.1f} | {w['requests']} | {w['p50_ms']:.0f} | {w['p99_ms']:.0f} |")
    bad = {k: v for k, v in summary["by_outcome"].items() if k not in ("ok", "refused")}
    sys.exit(1 if bad or kv_after != 0 or health != "SERVING" or report["log_lines"] != len(results) else 0)


if __name__ == "__main__":
    main()
