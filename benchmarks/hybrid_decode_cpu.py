"""Decode cost against context length through the serving engine: the Bamba hybrid (Mamba2 mixers,
2 attention layers of 8) against an attention-only Llama of similar size, on CPU.

For each context length one request's prompt is prefilled (chunked, 512 tokens a step), then
LLMEngine.step() is timed while it decodes alone (best of --rounds, each of --steps steps): the
paged KV pool for the attention layers (the engine's decode kernels) and, for the hybrid, its
recurrent-state slot (serve/runner/state_pool.py), updated in place. The mixers' share of each step is
timed apart (PagedHybridAttention.mix wrapped with the same clock): it should not grow with the
context. Memory: the KV bytes the sequence's blocks hold, and the state slot's bytes.

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
from baton.common.model import build_model
from baton.serve.engine import EngineConfig, LLMEngine
from baton.serve.engine.sizing import state_slot_bytes
from baton.serve.runner.model_runner import kv_block_bytes
from baton.serve.sampling_params import SamplingParams
from baton.serve.scheduling.scheduler import SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results"
COMMON = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536}  # fmt: skip
HYBRID = {"model_type": "bamba", "attn_layer_indices": [3, 7], "mamba_n_heads": 8, "mamba_d_state": 64,
          "mamba_chunk_size": 256, "mamba_expand": 1}  # fmt: skip


def models(smoke: bool) -> dict[str, ModelConfig]:
    common = {**COMMON, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256} if smoke else COMMON
    hybrid = {**HYBRID, "mamba_d_state": 16, "mamba_chunk_size": 16} if smoke else HYBRID
    return {"attention (llama)": ModelConfig(**common), "hybrid (bamba)": ModelConfig(**common, **hybrid)}


BLOCK = 16


def measure(cfg: ModelConfig, context: int, steps: int, rounds: int, clock) -> dict:
    model = build_model(cfg, seed=0).eval()
    total = context + steps * rounds + 1
    config = EngineConfig(
        num_kv_blocks=-(-total // BLOCK) + 1,
        block_size=BLOCK,
        max_model_len=total + 1,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512),
    )
    engine = LLMEngine(model, None, config)
    mixer_time = [0.0]
    attn = engine.runner.attn
    if cfg.is_hybrid:  # the mixers' share of each step, on the same clock
        mix = attn.mix

        def timed(mixer, x):
            t = clock()
            out = mix(mixer, x)
            mixer_time[0] += clock() - t
            return out

        attn.mix = timed
    prompt = torch.randint(0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=steps * rounds + 2, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_output_tokens == 0:  # prefill (in chunks) up to the first token
        engine.step()
    best = best_mix = float("inf")
    for _ in range(rounds):  # every round continues the same sequence: contexts grow by `steps`
        mixer_time[0] = 0.0
        t = clock()
        for _ in range(steps):
            engine.step()
        best = min(best, (clock() - t) / steps)
        best_mix = min(best_mix, mixer_time[0] / steps)
    p = next(model.parameters())
    kv = len(seq.block_table) * kv_block_bytes(model, BLOCK, p.dtype)
    state = state_slot_bytes(cfg, p.dtype) if cfg.is_hybrid else 0
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "ms_per_token": best * 1e3,
        "mixer_ms_per_token": best_mix * 1e3 if cfg.is_hybrid else 0.0,
        "cache_mb": (kv + state) / 2**20,
        "state_mb": state / 2**20,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in result["models"].items():
        xs = [r["context"] for r in rows]
        a.plot(xs, [r["ms_per_token"] for r in rows], marker="o", label=name)
        b.plot(xs, [r["cache_mb"] for r in rows], marker="o", label=name)
        if any(r["mixer_ms_per_token"] for r in rows):
            a.plot(xs, [r["mixer_ms_per_token"] for r in rows], marker="s", ls="--", label=f"{name}: its mixers")
            b.plot(xs, [r["state_mb"] for r in rows], marker="s", ls="--", label=f"{name}: its state slot")
    for ax, label in ((a, "engine decode ms / token"), (b, "MB held (K/V blocks + state slot)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Engine decode cost vs context on CPU ({result['clock']} clock, 1 thread)")
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
    print(f"{'model':<20} {'params':>8} {'context':>8} {'ms/token':>9} {'mixer ms':>9} {'cache MB':>9} {'state MB':>9}")
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
                f"{name:<20} {r['params_m']:>7.2f}M {context:>8} {r['ms_per_token']:>9.2f} "
                f"{r['mixer_ms_per_token']:>9.2f} {r['cache_mb']:>9.2f} {r['state_mb']:>9.3f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_decode_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "hybrid_decode_cpu.png")


if __name__ == "__main__":
    main()
