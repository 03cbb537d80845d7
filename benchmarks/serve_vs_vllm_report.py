"""benchmarks/serve_vs_vllm.py's report: the markdown table and the PNG of a run's results."""

from __future__ import annotations

import os
from pathlib import Path


def table(results: dict) -> str:
    sides = results["sides"]
    head = "| model, dtype | " + " | ".join(f"{s} tok/s" for s in sides)
    head += " | Baton/vLLM | prefill prompt tok/s | batch-1 decode Baton/vLLM | batch-64 decode % of ceiling | start-up s | fp32 = vLLM | fp32 = HF |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, cell in results["cells"].items():
        s = cell["summary"]
        vs = [f"{s[x]['best_tok_per_s']:.0f}" for x in sides]
        ratio = b1 = "-"
        pre = " / ".join(f"{x} {s[x]['prefill_tok_per_s']:.0f}" for x in sides)
        if "vllm" in s:
            ratio = f"{s['baton']['best_tok_per_s'] / s['vllm']['best_tok_per_s']:.2f}x"
            by_round = [b / v for b, v in zip(s["baton"]["round_best_tok_per_s"], s["vllm"]["round_best_tok_per_s"])]
            if len(by_round) > 1:  # on a noisy machine the spread says as much as the best pair
                ratio += f" (rounds {min(by_round):.2f}-{max(by_round):.2f}x)"
            b1 = f"{s['baton']['decode_tok_per_s']['1'] / s['vllm']['decode_tok_per_s']['1']:.2f}x"
        ceil = " / ".join(f"{x} {100 * (s[x]['decode64_fraction_of_ceiling'] or 0):.0f}%" for x in sides)
        start = " / ".join(f"{s[x]['startup_s']:.1f}" for x in sides)
        eq = cell.get("fp32_equal_vllm", "-")
        hf = cell.get("fp32_equal_hf", "-")
        lines.append(f"| {key} | " + " | ".join(vs) + f" | {ratio} | {pre} | {b1} | {ceil} | {start} | {eq} | {hf} |")
    return "\n".join(lines)


def plot(results: dict, path: Path, vllm_version: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, sides = results["cells"], results["sides"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = list(cells)
    width = 0.8 / len(sides)
    for j, side in enumerate(sides):
        xs = [i + j * width for i in range(len(keys))]
        axes[0].bar(xs, [cells[k]["summary"][side]["best_tok_per_s"] for k in keys], width, label=side)
        axes[1].bar(xs, [cells[k]["summary"][side]["decode_tok_per_s"]["1"] for k in keys], width, label=side)
    for ax, title in zip(axes, ("workload throughput (output tok/s, best run)", "batch-1 decode tok/s")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], keys, rotation=15)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"Baton vs vLLM {vllm_version} CPU, {os.cpu_count()} cores ({results['note']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
