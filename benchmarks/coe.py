"""Composition of Experts: router accuracy, routing overhead, and throughput of 3 experts vs 1.

Three random-weight experts of growing size (poet < coder < generalist) share one tokenizer; a
router (common/router.py) on the smallest one's hidden states is trained on labelled prompts of
three kinds (tinyshakespeare lines -> poet, code-like lines -> coder, standard-library docstrings
-> generalist) and scored on held-out ones, as a classifier and as kNN. Routing overhead: the
router's own time per prompt, and the client-seen latency of a one-token request through the
CoE's name minus the same request naming the expert. Throughput: a mixed workload (the three kinds
in equal parts, greedy, ignore_eos) through `--coe` with the router choosing, against the same
server holding only the largest expert, which then serves everything. Both run in this process
over gRPC on loopback (serve/coe/server.py), C clients in a closed loop.

Usage: python benchmarks/coe.py [--requests 96] [--max-tokens 32] [--concurrency 8] [--rounds 2]
       [--smoke] [--out DIR]                        (writes DIR/coe.{json,png})
       python benchmarks/coe.py --write-prompts FILE  (labelled prompts for configs/router-demo.yaml)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import yaml

from baton.common.config import ModelConfig
from baton.common.corpus import iter_docstrings
from baton.common.checkpoint import save_model
from baton.common.model import build_model
from baton.common.router import load_router
from baton.common.tokenizer import train_bpe
from baton.serve.client import BatonClient
from baton.serve.coe.server import CoEServer, coe_server_config
from baton.serve.engine import EngineConfig
from baton.serve.server import ServerConfig
from baton.train.router import RouterTrainConfig, train_router

RESULTS = Path(__file__).resolve().parent / "results"
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SIZES = {"poet": (128, 2), "coder": (256, 4), "generalist": (384, 8)}  # hidden size, layers
SMOKE_SIZES = {"poet": (32, 1), "coder": (48, 2), "generalist": (64, 3)}


def code_line(rng: random.Random) -> str:
    a, b, c = rng.randint(0, 999), rng.randint(0, 99), rng.randint(0, 9)
    return rng.choice([f"x{a} = {b} * {a} + {c}", f"def f{a}(x): return x + {b}", f"for i in range({a}): print(i)",
                       f"if x{c} > {a}: y = [{b}, {c}]", f"{a} {b} {a * b} {a + b}"])  # fmt: skip


def prompts(n_train: int, n_held: int, seed: int = 0) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Disjoint training and held-out prompts of each kind, keyed by the expert that should answer."""
    rng, n = random.Random(seed), n_train + n_held
    lines = [s.strip() for s in SHAKESPEARE.read_text().splitlines() if len(s.strip()) > 20]
    firsts = (d.split("\n")[0] for d in iter_docstrings())
    docs = list(itertools.islice((d for d in firsts if len(d) > 20), 4 * n))  # parsing the stdlib is slow
    kinds = {
        "poet": rng.sample(lines, n),
        "coder": [code_line(rng) for _ in range(n)],
        "generalist": rng.sample(docs, n),
    }
    return {k: v[:n_train] for k, v in kinds.items()}, {k: v[n_train:] for k, v in kinds.items()}


def write_prompts(path: Path, n: int = 300) -> None:
    """Labelled prompts for the demo router: shakespeare -> poet, docstrings and code -> docs."""
    kinds = prompts(n, 0)[0]
    rows = [{"text": t, "expert": "poet"} for t in kinds["poet"]]
    rows += [{"text": t, "expert": "docs"} for t in kinds["generalist"] + kinds["coder"][: n // 2]]
    random.Random(0).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} labelled prompts to {path}")


def build(tmp: Path, smoke: bool, n_train: int) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """The experts and the labelled training file; returns (checkpoints, held-out prompts by expert)."""
    train, held = prompts(n_train, max(20, n_train // 5))
    tok = train_bpe(["\n".join(itertools.chain(*train.values()))], vocab_size=512 if smoke else 2048)
    ckpts = {}
    for i, (name, (hidden, layers)) in enumerate((SMOKE_SIZES if smoke else SIZES).items()):
        cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, eos_token_id=None)  # fmt: skip
        ckpts[name] = save_model(tmp / name, build_model(cfg, seed=i), tokenizer=tok)
    for name, kinds in (("prompts.jsonl", train), ("held_out.jsonl", held)):
        rows = [{"text": t, "expert": e} for e, ts in kinds.items() for t in ts]
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpts, held


class CoEThread:
    def __init__(self, path: Path):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        base = ServerConfig(model="", port=0, metrics_port=None, engine=EngineConfig(block_size=16))
        self.server = CoEServer(*coe_server_config(str(path), base))
        self.run(self.server.start())
        self.run(self.server.load(), 600)
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.drain_and_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def coe_file(tmp: Path, name: str, experts: dict[str, Path], router: Path | None, kv_mb: int) -> Path:
    spec = {"name": "coe", "kv_cache_mb": kv_mb, "fallback": "generalist",
            "experts": [{"name": n, "checkpoint": str(p)} for n, p in experts.items()]}  # fmt: skip
    if router is not None:
        spec["router"] = {"path": str(router), "threshold": 0.5}
    (tmp / name).write_text(yaml.safe_dump(spec))
    return tmp / name


def closed_loop(target: str, work: list[str], concurrency: int, max_tokens: int) -> dict:
    """Every prompt through the CoE name, `concurrency` clients; tokens/s and who served what."""
    todo, served, tokens = list(work), [], 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal tokens
        with BatonClient(target, timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                r = c.complete(prompt, model="coe", max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                with lock:
                    served.append(r.model)
                    tokens += len(r.completions[0].token_ids)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: client(), range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {"tok_per_s": tokens / elapsed, "seconds": elapsed, "served": {m: served.count(m) for m in set(served)}}


def latency_pairs(target: str, texts: list[str]) -> tuple[float, float]:
    """Median client-seen latency of a one-token request through the CoE's name, and of the same
    request naming the expert the router chose (alternating which goes first)."""
    routed, named = [], []
    with BatonClient(target, timeout=120) as c:
        for i, t in enumerate(texts):
            expert = c.complete(t, model="coe", max_tokens=1, temperature=0.0).model  # also warms this prompt
            for model, times in sorted([("coe", routed), (expert, named)], reverse=bool(i % 2)):
                t0 = time.perf_counter()
                c.complete(t, model=model, max_tokens=1, temperature=0.0)
                times.append(time.perf_counter() - t0)
    return statistics.median(routed) * 1e3, statistics.median(named) * 1e3


def route_times(router, texts: list[str]) -> list[float]:
    times = []
    for t in texts:
        t0 = time.perf_counter()
        router.route([t])
        times.append(time.perf_counter() - t0)
    return times


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    ckpts, held = build(tmp, args.smoke, args.train_prompts)
    result = {"experts": {n: {"hidden": h, "layers": ly} for n, (h, ly) in (SMOKE_SIZES if args.smoke else SIZES).items()},
              "requests": args.requests, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "router": {}}  # fmt: skip
    pairs = [(t, e) for e, ts in held.items() for t in ts]
    for kind in ("classifier", "knn"):
        data, val = str(tmp / "prompts.jsonl"), str(tmp / "held_out.jsonl")
        cfg = RouterTrainConfig(base=str(ckpts["poet"]), data=data, out=str(tmp / kind), kind=kind, val_path=val)
        train_router(cfg)
        router = load_router(cfg.out)
        picks = router.route([t for t, _ in pairs])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # as the server runs it: off the main thread
            single = pool.submit(route_times, router, [t for t, _ in pairs[:: max(1, len(pairs) // 30)]]).result()
        acc = sum(p == e for (p, _), (_, e) in zip(picks, pairs)) / len(pairs)
        by_kind = {k: sum(p == e for (p, _), (_, e) in zip(picks, pairs) if e == k) / len(held[k]) for k in held}
        result["router"][kind] = {"held_out_accuracy": acc, "held_out": len(pairs), "by_expert": by_kind,
                                  "train_accuracy": router.config.train_accuracy,
                                  "route_ms": statistics.median(single) * 1e3}  # fmt: skip
        per = ", ".join(f"{k} {v:.2f}" for k, v in by_kind.items())
        print(f"router {kind:<10} held-out accuracy {acc:.3f} ({len(pairs)} prompts: {per}), "
              f"{result['router'][kind]['route_ms']:.2f} ms/prompt")  # fmt: skip
    rng = random.Random(2)
    work = [rng.choice(held[rng.choice(list(held))]) for _ in range(args.requests)]
    setups = {
        "coe (3 experts, routed)": coe_file(tmp, "coe.yaml", ckpts, tmp / "classifier", args.kv_mb),
        "largest expert only": coe_file(tmp, "one.yaml", {"generalist": ckpts["generalist"]}, None, args.kv_mb),
    }
    result["throughput"] = {}
    for label, path in setups.items():
        server = CoEThread(path)
        try:
            closed_loop(server.target, work[: args.concurrency], args.concurrency, 2)  # warm-up
            runs = [closed_loop(server.target, work, args.concurrency, args.max_tokens) for _ in range(args.rounds)]
            best = max(runs, key=lambda r: r["tok_per_s"])
            result["throughput"][label] = {**best, "runs_tok_per_s": [r["tok_per_s"] for r in runs]}
            print(f"{label:<26} {best['tok_per_s']:8.1f} tok/s (best of {args.rounds}), served {best['served']}")
            if label.startswith("coe"):
                sample = [t for t, _ in pairs[:: max(1, len(pairs) // 30)]]
                routed, named = latency_pairs(server.target, sample)
                with BatonClient(server.target) as c:
                    in_server = c.server_info().coe.mean_route_ms
                result["latency_ms"] = {"named_expert": named, "via_router": routed, "overhead": routed - named,
                                        "router_in_server": in_server}  # fmt: skip
                print(
                    f"one-token latency: named {named:.2f} ms, via the router {routed:.2f} ms (+{routed - named:.2f})"
                )
        finally:
            server.stop()
    tp = result["throughput"]
    result["speedup"] = tp["coe (3 experts, routed)"]["tok_per_s"] / tp["largest expert only"]["tok_per_s"]
    print(f"CoE / largest-only throughput: {result['speedup']:.2f}x")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(result["router"])
    a.bar(kinds, [result["router"][k]["held_out_accuracy"] for k in kinds], color=["tab:blue", "tab:orange"])
    a.set_ylim(0, 1)
    a.set_ylabel("held-out routing accuracy")
    a.set_title("router (3 kinds of prompt)")
    labels = list(result["throughput"])
    b.bar(labels, [result["throughput"][k]["tok_per_s"] for k in labels], color=["tab:green", "tab:gray"])
    b.set_ylabel("generated tokens / s (best run)")
    b.set_title(
        f"mixed workload, {result['requests']} requests x {result['max_tokens']} tokens, C={result['concurrency']}"
    )
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--train-prompts", type=int, default=200, help="labelled training prompts per kind")
    ap.add_argument("--kv-mb", type=int, default=64, help="the KV budget the experts share")
    ap.add_argument("--smoke", action="store_true", help="tiny experts, few requests (the test's mode)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--write-prompts", type=Path, default=None, help="only write labelled demo prompts here")
    args = ap.parse_args()
    if args.write_prompts is not None:
        write_prompts(args.write_prompts)
        return
    if args.smoke:
        args.requests, args.max_tokens, args.concurrency, args.rounds, args.train_prompts = 12, 4, 4, 1, 60
        args.kv_mb = 8
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coe.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "coe.png")
    print(f"wrote {args.out / 'coe.json'} and coe.png")


if __name__ == "__main__":
    main()
