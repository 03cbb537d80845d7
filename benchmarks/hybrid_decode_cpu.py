"""Decode cost against context length: the Bamba hybrid (Mamba2 mixers, 2 attention layers of 8)
against an attention-only Llama of similar size, on CPU, with common/hybrid_cache.py's simple cache
(dense K/V for attention layers, carried recurrent state for mixers).

For each context length the prompt is prefilled in pieces, then single-token decode steps are timed
(best of --rounds, each of --steps steps). Also the cache's bytes: K/V grows with the context, the
mixers' state does not. This is the model-level cost, not the server's (which has paged attention
and no state slots yet); the attention layers' part grows with the context in both models.

Usage: python benchmarks/hybrid_decode_cpu.py [--contexts 512 2048 8192] [--clock wall|thread]
       [--rounds 3] [--smoke] [--out DIR]   (writes DIR/hybrid_decode_cpu.{json,png})
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from baton.common.config import ModelConfig
from baton.common.hybrid_cache import HybridCache
from baton.common.model import build_model

RESULTS = Path(__file__).resolve().parent / "results"
COMMON = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536}  # fmt: skip
HYBRID = {"model_type": "bamba", "attn_layer_indices": [3, 7], "mamba_n_heads": 8, "mamba_d_state": 64,
          "mamba_chunk_size": 256, "mamba_expand": 1}  # fmt: skip


def models(smoke: bool) -> dict[str, ModelConfig]:
    common = {**COMMON, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256} if smoke else COMMON
    hybrid = {**HYBRID, "mamba_d_state": 16, "mamba_chunk_size": 16} if smoke else HYBRID
    return {"attention (llama)": ModelConfig(**common), "hybrid (bamba)": ModelConfig(**common, **hybrid)}


@torch.inference_mode()
def measure(cfg: ModelConfig, context: int, steps: int, rounds: int, clock) -> dict:
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=g)
    cache = HybridCache()
    for i in range(0, context, 512):
        logits = cache.forward(model, prompt[:, i : i + 512])
    token = logits[:, -1].argmax(-1, keepdim=True)
    best = float("inf")
    for _ in range(rounds):  # every round continues the same sequence: contexts grow by `steps`
        t = clock()
        for _ in range(steps):
            token = cache.forward(model, token)[:, -1].argmax(-1, keepdim=True)
        best = min(best, (clock() - t) / steps)
    kv = sum(t.numel() * t.element_size() for pair in cache.kv.values() for t in pair)
    state = sum(t.numel() * t.element_size() for s in cache.recurrent.values() for t in (s.conv, s.ssm))
    return {"ms_per_token": best * 1e3, "cache_mb": (kv + state) / 2**20, "state_mb": state / 2**20}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in result["models"].items():
        xs = [r["context"] for r in rows]
        a.plot(xs, [r["ms_per_token"] for r in rows], marker="o", label=name)
        b.plot(xs, [r["cache_mb"] for r in rows], marker="o", label=name)
    for ax, label in ((a, "decode ms / token"), (b, "cache MB (K/V + recurrent state)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Decode cost vs context on CPU ({result['clock']} clock, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "thread"), default="thread")
    ap.add_argument("--smoke", action="store_true", help="tiny models and contexts (the test's mode)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.steps, args.rounds = [16, 64], 2, 1
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    result = {"clock": args.clock, "threads": 1, "steps": args.steps, "rounds": args.rounds, "models": {}}
    print(f"{'model':<20} {'params':>8} {'context':>8} {'ms/token':>9} {'cache MB':>9} {'state MB':>9}")
    for name, cfg in models(args.smoke).items():
        rows = result["models"][name] = []
        for context in args.contexts:
            r = {
                "context": context,
                "params_m": cfg.num_parameters() / 1e6,
                **measure(cfg, context, args.steps, args.rounds, clock),
            }
            rows.append(r)
            print(
                f"{name:<20} {r['params_m']:>7.2f}M {context:>8} {r['ms_per_token']:>9.2f} {r['cache_mb']:>9.2f} {r['state_mb']:>9.3f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_decode_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "hybrid_decode_cpu.png")


if __name__ == "__main__":
    main()
