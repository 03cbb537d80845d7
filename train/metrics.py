"""What a run reports: JSONL + CSV logs, TensorBoard events, a loss plot, and MFU.

MFU is model FLOPs per second (PaLM's count; active parameters only for MoE) over the peak of the
devices in the training dtype, summed over the ranks. On a GPU the peak is the datasheet's dense
(no 2:4 sparsity) tensor-core rate for that dtype, looked up by device name (PEAKS); fp32 training
uses the fp32 rate, as torch's default keeps fp32 matmuls off TF32. A GPU missing from the table,
and every CPU, gets a measured peak instead: a large matmul in the training dtype, timed by every
rank at the same moment, so ranks that share cores measure the share they actually get.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from baton.common.config import ModelConfig
from baton.common.model import CausalLM

log = logging.getLogger(__name__)

CSV_FIELDS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "skipped", "elapsed_s")


# Dense tensor-core TFLOP/s by (device-name substring, dtype), the datasheets' numbers without 2:4
# sparsity; the first matching row wins, so more specific names come first.
PEAKS: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    ("H200", {torch.bfloat16: 989.5, torch.float16: 989.5, torch.float32: 67.0}),
    ("H100 PCIe", {torch.bfloat16: 756.0, torch.float16: 756.0, torch.float32: 51.0}),
    ("H100 NVL", {torch.bfloat16: 835.0, torch.float16: 835.0, torch.float32: 60.0}),
    ("H100", {torch.bfloat16: 989.5, torch.float16: 989.5, torch.float32: 67.0}),  # SXM
    ("H800", {torch.bfloat16: 989.5, torch.float16: 989.5, torch.float32: 67.0}),
    ("GH200", {torch.bfloat16: 989.5, torch.float16: 989.5, torch.float32: 67.0}),
    ("B200", {torch.bfloat16: 2250.0, torch.float16: 2250.0, torch.float32: 80.0}),
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5}),
    ("A800", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5}),
    ("L40S", {torch.bfloat16: 362.05, torch.float16: 362.05, torch.float32: 91.6}),
    ("L40", {torch.bfloat16: 181.05, torch.float16: 181.05, torch.float32: 90.5}),
    ("L4", {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3}),
    ("RTX 4090", {torch.bfloat16: 165.2, torch.float16: 165.2, torch.float32: 82.6}),
    ("V100", {torch.float16: 125.0, torch.float32: 15.7}),
)


def table_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """FLOP/s of a device by name from PEAKS, or None where the table has no row (or no such dtype)."""
    for key, rates in PEAKS:
        if key.lower() in device_name.lower():
            tflops = rates.get(dtype)
            return None if tflops is None else tflops * 1e12
    return None


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token runs through: a MoE layer's top-k experts, not all of them. Counted on
    the model itself, built on the meta device (no memory), so every family's shapes are exact:
    Qwen3-MoE's expert width and dense layers, gpt-oss's stacked experts, q/k norms, sinks."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    shared = experts = 0
    for name, p in model.named_parameters():  # (a tied head counted once)
        if ".experts." in name:
            experts += p.numel()
        else:
            shared += p.numel()
    return shared + (experts * cfg.num_experts_per_tok // cfg.num_local_experts if experts else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 x matmul parameters + 12 x layers x
    attention width x sequence length. The embedding lookup is not a matmul; the LM head is; a
    MoE layer counts its router and top-k experts (what a token runs through); a hybrid's attention
    term counts its attention layers only (a mixer's scan is not counted: a lower bound)."""
    matmul_params = active_parameters(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    n_attn = sum(cfg.is_attention_layer(i) for i in range(cfg.num_hidden_layers))
    attn = 12 * n_attn * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params + attn


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """This device's peak FLOP/s in `dtype` and where it came from ("table: <name>" or "measured")."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, dtype)
        if peak is not None:
            return peak, f"table: {name}"
        return measure_matmul_peak(device, dtype, n=8192), f"measured: {name}"
    return measure_matmul_peak(device, dtype), "measured"


def measure_matmul_peak(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.5
) -> float:
    """FLOP/s of this process on an n x n matmul in `dtype` on `device` (the best of a few bursts)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sync()
        t0 = time.perf_counter()
        for _ in range(8):
            a @ b
        sync()
        best = max(best, 8 * 2 * n**3 / (time.perf_counter() - t0))
    return best


class MetricsLogger:
    """Appends one record per logged step to metrics.jsonl / metrics.csv (and TensorBoard).

    On resume, records after the resumed step are dropped, so the logs read as one run."""

    def __init__(self, out_dir: Path, enabled: bool, start_step: int = 0, tensorboard: bool = True):
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self.jsonl, self.csv = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
        self.tb = None
        if not enabled:
            return
        if start_step and self.jsonl.is_file():
            lines = self.jsonl.read_text().splitlines()
            self.records = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= start_step]
        self.jsonl.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        with open(self.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.records)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("tensorboard is not installed: no event files (pip install tensorboard)")
            else:
                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore").writerow(record)
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_losses(records: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Train loss (every logged step) and validation loss (where measured) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
