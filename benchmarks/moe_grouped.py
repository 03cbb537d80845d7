"""One MoE layer's experts as a grouped GEMM against the per-expert loop, on CPU: Qwen3-30B-A3B's
128 experts and top-8 at half its hidden size and expert width (1024, 384: a quarter of its expert
weights, so that both sides run in about a minute on 2 cores), or its whole shape with --full
(hidden 2048, width 768).

Both sides sort the token-slots by expert and share the routing and the weighted sum
(baton.common.moe.MoE.combine); they differ in the experts' compute:
  loop     one gate, up and down matmul per expert that got tokens (MoE.run_loop, the reference)
  grouped  two F.grouped_mm calls over all of them (gate+up, then down) on the packed weights
           (pack_experts: the experts' weights become views of two stacked tensors, no copy)
for 1 token (decode), 16 and 256 (prefill), in fp32 and bf16, without gradients. Then training's
forward + backward at 256 tokens: the loop against grouped over weights stacked each step (what a
grouped training path for per-expert modules would cost: the stack is a copy of every expert's
weights, kept for the backward; Baton trains these families with the loop, and gpt-oss, whose
weights are stacked already, grouped; --gpt-oss times that block's training loop against it).

Sides alternate within each round and each keeps its best, so both see the same load. The default
clock (`--clock thread`) is one torch thread's own CPU time: on a machine shared with other work
that is what stays steady (with 2 OpenMP threads on 2 busy cores, wall times of small matmuls
swing 10-100x from one minute to the next); `--clock wall` times wall-clock with all threads.

Usage: python benchmarks/moe_grouped.py [--clock thread|wall] [--full] [--tokens 1 16 256] [--rounds 2]
                                        [--gpt-oss] [--smoke] [--out DIR]
(writes DIR/moe_grouped.{json,png}, with --full moe_grouped_full.{json,png}; default benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from baton.common.config import ModelConfig
from baton.common.moe import MoE, build_moe, pack_experts

RESULTS = Path(__file__).resolve().parent / "results"
QWEN3_30B_A3B = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_local_experts": 128, "num_experts_per_tok": 8}
HALF = {"hidden_size": 1024, "moe_intermediate_size": 384, "num_local_experts": 128, "num_experts_per_tok": 8}
TINY = {"hidden_size": 64, "moe_intermediate_size": 32, "num_local_experts": 16, "num_experts_per_tok": 4}


def layer(shape: dict, dtype: torch.dtype) -> MoE:
    cfg = ModelConfig(
        model_type="qwen3_moe", vocab_size=64, num_hidden_layers=1, num_attention_heads=16, norm_topk_prob=True,
        intermediate_size=4 * shape["moe_intermediate_size"], **shape,
    )  # fmt: skip
    block = build_moe(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block.to(dtype)


CLOCK = time.thread_time


def best_of(fns: dict, rounds: int) -> dict[str, float]:
    for f in fns.values():
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, f in fns.items():
            t = CLOCK()
            f()
            best[k] = min(best[k], CLOCK() - t)
    return best


def side(block: MoE, x: torch.Tensor, grouped: bool):
    def run():
        block.grouped = grouped
        return block(x)

    return run


def inference(shape: dict, tokens: list[int], rounds: int) -> list[dict]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        block = layer(shape, dtype)
        assert pack_experts(block) == 1
        block.cpu_min_slots_per_expert = 0.0  # the grouped side is grouped at every T (by default: T >= 16 here)
        for t in tokens:
            x = torch.randn(1, t, shape["hidden_size"], generator=torch.Generator().manual_seed(t)).to(dtype)
            with torch.inference_mode():
                hit = int(block.route(block.router_logits(x[0]))[1].unique().numel())
                ref, got = side(block, x, False)(), side(block, x, True)()
                err = (ref.float() - got.float()).abs().max().item()
                sides = {"loop": side(block, x, False), "grouped": side(block, x, True)}
                ms = {k: v * 1e3 for k, v in best_of(sides, rounds).items()}
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": t, "experts_hit": hit, "ms": ms}
            row |= {"speedup": ms["loop"] / ms["grouped"], "max_abs_diff": err}
            out.append(row)
            print(
                f"{row['dtype']:8s} T={t:4d} ({hit:3d} experts)  loop {ms['loop']:8.2f} ms  "
                f"grouped {ms['grouped']:8.2f} ms  x{row['speedup']:.2f}  |diff| {err:.1e}",
                flush=True,
            )
    return out


def stacked_grouped(block: MoE):
    """run_experts as grouped GEMMs over weights stacked on every call (differentiable)."""

    def run(xs, counts, experts):
        mods = [block.experts[e] for e in experts]
        gate_up = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in mods])
        down = torch.stack([m.down_proj.weight for m in mods])
        return block.run_grouped(xs, counts, gate_up, down)

    return run


def training(shape: dict, tokens: int, rounds: int) -> list[dict]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        block = layer(shape, dtype)
        x = torch.randn(1, tokens, shape["hidden_size"], generator=torch.Generator().manual_seed(1)).to(dtype)

        def step(grouped: bool):
            def run():
                block.zero_grad(set_to_none=True)
                if grouped:
                    block.run_experts = stacked_grouped(block)
                else:
                    block.__dict__.pop("run_experts", None)
                block(x).float().square().mean().backward()

            return run

        sides = {"loop": step(False), "grouped (stacked per step)": step(True)}
        ms = {k: v * 1e3 for k, v in best_of(sides, rounds).items()}
        block.__dict__.pop("run_experts", None)
        stack_mb = (
            sum(p.numel() * p.element_size() for n, p in block.named_parameters() if n.startswith("experts.")) / 2**20
        )
        row = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "ms": ms, "stacked_copy_mb": stack_mb}
        out.append(row)
        times = "  ".join(f"{k} {v:8.1f} ms" for k, v in ms.items())
        print(f"train {row['dtype']:8s} T={tokens}  {times}  (+{stack_mb:.0f} MiB kept for the backward)", flush=True)
    return out


def gpt_oss_training(shape: dict, tokens: int) -> list[dict]:
    """gpt-oss's block (stacked experts) at the same shape: forward + backward, its reference loop
    (each expert a slice of the stacked weights) against its grouped path, one timed run each after
    a warm-up (the loop takes tens of seconds)."""
    cfg = ModelConfig(
        model_type="gpt_oss", vocab_size=64, num_hidden_layers=1, num_attention_heads=16,
        hidden_size=shape["hidden_size"], intermediate_size=shape["moe_intermediate_size"],
        num_local_experts=shape["num_local_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
    )  # fmt: skip
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        block = build_moe(cfg).to(dtype)
        x = torch.randn(1, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)

        def step(grouped: bool):
            def run():
                block.zero_grad(set_to_none=True)
                block.grouped = grouped
                block(x).float().square().mean().backward()

            return run

        ms = {k: v * 1e3 for k, v in best_of({"loop": step(False), "grouped": step(True)}, 1).items()}
        out.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "ms": ms})
        name = out[-1]["dtype"]
        print(f"gpt-oss train {name:8s} T={tokens}  loop {ms['loop']:8.0f} ms  grouped {ms['grouped']:8.0f} ms")
    return out


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        rows = [row for row in r["inference"] if row["dtype"] == dtype]
        t = [row["tokens"] for row in rows]
        for k in ("loop", "grouped"):
            ax.plot(t, [row["ms"][k] for row in rows], marker="o", label=k)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per MoE layer, no grad", title=dtype)
        ax.legend()
    s = r["shape"]
    fig.suptitle(
        f"{s['num_local_experts']} experts top-{s['num_experts_per_tok']}, hidden {s['hidden_size']}, "
        f"expert width {s['moe_intermediate_size']}; CPU, {r['clock']} clock, {r['threads']} thread(s)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256])
    ap.add_argument("--train-tokens", type=int, default=256)
    ap.add_argument("--clock", choices=["thread", "wall"], default="thread")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="Qwen3-30B-A3B's whole layer (hidden 2048, width 768)")
    ap.add_argument("--gpt-oss", action="store_true", help="also gpt-oss's block in training (about 2 minutes more)")
    ap.add_argument("--smoke", action="store_true", help="a 16-expert toy layer, 1 round")
    ap.add_argument("--note", default="shared 2-core machine")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    global CLOCK
    if args.clock == "thread":
        torch.set_num_threads(1)  # the clock sees only this thread
    else:
        CLOCK = time.perf_counter
    shape, rounds = (TINY, 1) if args.smoke else (QWEN3_30B_A3B if args.full else HALF, args.rounds)
    r = {
        "shape": shape,
        "clock": args.clock,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "note": args.note,
    }
    r["load_average_before"] = os.getloadavg()[0]
    r["inference"] = inference(shape, args.tokens, rounds)
    r["training"] = training(shape, args.train_tokens, rounds)
    if args.gpt_oss:
        r["gpt_oss_training"] = gpt_oss_training(shape, args.train_tokens)
    r["load_average_after"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "moe_grouped_full" if args.full else "moe_grouped"
    (args.out / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    plot(r, args.out / f"{name}.png")


if __name__ == "__main__":
    main()
