"""What a run reports: JSONL + CSV logs, TensorBoard events, a loss plot, and MFU.

MFU is model FLOPs per second over the machine's measured matmul peak (not a datasheet number):
every rank times a float32 matmul at the same moment, so ranks that share cores measure the share
they actually get, and the peaks are summed.
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

log = logging.getLogger(__name__)

CSV_FIELDS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "skipped", "elapsed_s")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 x matmul parameters + 12 x layers x
    attention width x sequence length. The embedding lookup is not a matmul; the LM head is."""
    matmul_params = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params + attn


def measure_matmul_peak(device: torch.device | str = "cpu", n: int = 512, seconds: float = 0.5) -> float:
    """FLOP/s of this process on an n x n float32 matmul on `device` (the best of a few bursts)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
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
