"""Activation memory and step time of recompute none / selective / full at several sequence lengths,
next to Megatron's per-layer formula s·b·h·(34 + 5·a·s/h) bytes (Korthikanti et al. 2022).

Activation bytes per layer are measured, not estimated: everything a forward pass leaves alive
for the backward pass (baton.train.recompute.activation_bytes), for a 4- and a 2-layer model, the
difference halved. Megatron's formula assumes fp16 activations, GPT (GELU MLP, LayerNorm) and
dropout masks; Baton here is fp32, Llama-style (SwiGLU, RMSNorm, RoPE) without dropout, so the
formula is the yardstick for shape (the 5as/h attention term that selective removes), not for
exact bytes. Both attention cores are measured: the unfused one Megatron assumes ("eager") and
torch's fused SDPA, which on CPU already keeps no s x s tensor.

    .venv/bin/python benchmarks/train_recompute.py [--seq 256 512 1024 2048]

Writes benchmarks/results/train_recompute.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.train.backends import lm_loss
from baton.train.config import RecomputeConfig
from baton.train.recompute import EagerAttention, SelectiveRecompute, activation_bytes, apply_recompute

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H, A, B = 256, 8, 1


def model_and_attn(layers: int, mode: str, eager: bool, seq: int):
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=H,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=A,
        max_position_embeddings=max(seq, 256),
    )
    model = build_model(cfg, seed=0)
    attn = apply_recompute(model, RecomputeConfig(mode))
    if eager:
        attn = SelectiveRecompute(EagerAttention()) if mode == "selective" else EagerAttention()
    return model, attn


def measure(seq: int, mode: str, eager: bool) -> dict:
    batch = torch.randint(0, 256, (B, seq + 1), generator=torch.Generator().manual_seed(0))
    per = {}
    for layers in (2, 4):
        model, attn = model_and_attn(layers, mode, eager, seq)
        per[layers] = activation_bytes(lambda: lm_loss(model(batch[:, :-1], attn=attn), batch))
    times = []
    for _ in range(5):  # the fastest of 5: other jobs on a shared machine only ever add time
        t0 = time.perf_counter()
        lm_loss(model(batch[:, :-1], attn=attn), batch).backward()
        times.append(time.perf_counter() - t0)
    return {"per_layer_bytes": (per[4] - per[2]) / 2, "step_s": min(times)}


def megatron(seq: int, mode: str) -> float:
    """Bytes per layer in Megatron's accounting (fp16, with dropout)."""
    sbh = seq * B * H
    return {"none": sbh * (34 + 5 * A * seq / H), "selective": sbh * 34, "full": sbh * 2}[mode]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq in args.seq:
        for core in ("eager", "sdpa"):
            for mode in ("none", "selective", "full"):
                m = measure(seq, mode, core == "eager")
                rows.append({"seq": seq, "attention": core, "mode": mode, **m, "megatron_bytes": megatron(seq, mode)})
                print(
                    f"seq {seq:5d} {core:5s} {mode:9s} {m['per_layer_bytes'] / 2**20:8.2f} MiB/layer "
                    f"(Megatron fp16 {megatron(seq, mode) / 2**20:7.2f})  {m['step_s'] * 1000:7.1f} ms",
                    flush=True,
                )
    (RESULTS / "train_recompute.json").write_text(
        json.dumps({"hidden": H, "heads": A, "batch": B, "rows": rows}, indent=2)
    )
    plot(rows, args.seq)
    print(f"\nh={H}, a={A}, b={B}, fp32; MiB of activations per layer, step = forward + backward of 4 layers\n")
    print("| seq | core | mode | measured MiB/layer | Megatron s·b·h·(34+5as/h) (fp16) | measured / sbh | step ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seq']} | {r['attention']} | {r['mode']} | {r['per_layer_bytes'] / 2**20:.2f} | "
            f"{r['megatron_bytes'] / 2**20:.2f} | {r['per_layer_bytes'] / (r['seq'] * B * H):.1f} | {r['step_s'] * 1000:.1f} |"
        )


def plot(rows: list[dict], seqs: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, mode in enumerate(("none", "selective", "full")):
        for core, ls in (("eager", "-"), ("sdpa", ":")):
            sel = [r for r in rows if r["mode"] == mode and r["attention"] == core]
            a.plot(
                [r["seq"] for r in sel],
                [r["per_layer_bytes"] / 2**20 for r in sel],
                ls,
                marker="o",
                color=f"C{i}",
                label=f"{mode} ({core})",
            )
            b.plot(
                [r["seq"] for r in sel],
                [r["step_s"] * 1000 for r in sel],
                ls,
                marker="o",
                color=f"C{i}",
                label=f"{mode} ({core})",
            )
        a.plot(
            seqs,
            [megatron(s, mode) / 2**20 for s in seqs],
            "--",
            color=f"C{i}",
            alpha=0.5,
            label=f"Megatron formula, {mode} (fp16)",
        )
    a.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB per layer", title="activation memory")
    b.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="ms", title="forward + backward (4 layers)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "train_recompute.png", dpi=120)


if __name__ == "__main__":
    main()
