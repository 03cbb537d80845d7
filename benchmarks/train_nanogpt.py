"""nanoGPT anchor: TinyShakespeare char-level with nanoGPT's CPU settings (configs/tinyshakespeare.yaml).

Trains with `baton train`'s loop for 2000 iterations and reports the validation loss (nanoGPT:
~1.88). Throughput is then compared with a bare PyTorch loop (same model, batches, optimizer,
threads; no evaluation, logging or checkpoints) in alternating short rounds, so that both see the
same load on a shared machine; the median round of each is reported.

    .venv/bin/python benchmarks/train_nanogpt.py [--steps 2000] [--rounds 5] [--speed-steps 150]

Writes benchmarks/results/train_nanogpt.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from baton.common.model import build_model
from baton.common.tokenizer import Tokenizer
from baton.train.backends import lm_loss, param_groups
from baton.train.recipe import load_config
from baton.common.data import build_datasets
from baton.train.batches import GlobalBatches
from baton.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NANOGPT_VAL_LOSS = 1.88


def plain_loop_tokens_per_s(cfg, tok: Tokenizer, steps: int) -> float:
    """The same model, batches and optimizer in the shortest correct PyTorch training loop."""
    train_ds, _ = build_datasets(cfg.data, tok)
    batches = GlobalBatches(train_ds, cfg.micro_batch_size, cfg.seed)
    model = build_model(cfg.model_config(tok.vocab_size, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    groups, _ = param_groups(model, cfg.optim.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2))
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = batches.next()  # fetched inside the loop, as nanoGPT's get_batch is
        loss = lm_loss(model(batch[:, :-1]), batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * cfg.micro_batch_size * cfg.data.seq_len / (time.perf_counter() - t0)


def throughput(cfg_for, tok: Tokenizer, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """Short Baton runs and plain-loop runs, alternating, so both see the same machine load."""
    baton, plain = [], []
    for _ in range(rounds):
        cfg = cfg_for(
            [
                f"max_steps={steps}",
                "eval_interval=0",
                "export=false",
                "logging.progress=false",
                "logging.plot=false",
                "logging.tensorboard=false",
                "logging.mfu=false",
            ],
            "bench_nanogpt_speed",
        )
        baton.append(train(cfg).tokens_per_second)  # training steps only: not evaluation or the checkpoint
        plain.append(plain_loop_tokens_per_s(cfg, tok, steps))
    return baton, plain


def plot(records: list[dict], out: Path, baton_tps: float, plain_tps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    a.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    a.plot(*zip(*val), "o-", label="validation")
    a.axhline(NANOGPT_VAL_LOSS, color="gray", ls="--", label=f"nanoGPT val {NANOGPT_VAL_LOSS}")
    a.set(xlabel="iteration", ylabel="loss", title="TinyShakespeare char, nanoGPT CPU config", ylim=(1.0, 4.5))
    a.legend()
    b.bar(["baton train", "plain loop"], [baton_tps, plain_tps], color=["C0", "C7"])
    b.set(ylabel="training tokens/s (median of rounds)", title=f"{torch.get_num_threads()} threads")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5, help="alternating throughput rounds")
    p.add_argument("--speed-steps", type=int, default=150, help="steps per throughput round")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    RESULTS.mkdir(parents=True, exist_ok=True)

    def cfg_for(overrides: list[str], name: str):
        return load_config(
            ROOT / "configs" / "tinyshakespeare.yaml",
            [
                f"out_dir={ROOT / 'runs' / name}",
                "checkpoint.resume=never",
                f"data.path={ROOT.parent / 'shared' / 'data' / 'tinyshakespeare.txt'}",
                *overrides,
            ],
        )

    t0 = time.perf_counter()
    result = train(cfg_for([f"max_steps={args.steps}"], "bench_nanogpt"))  # the anchor run
    wall = time.perf_counter() - t0
    records = [
        json.loads(line) for line in (ROOT / "runs" / "bench_nanogpt" / "metrics.jsonl").read_text().splitlines()
    ]
    tok = Tokenizer.from_dir(result.checkpoint_dir / "tokenizer")
    baton, plain = throughput(cfg_for, tok, args.rounds, args.speed_steps)
    summary = {
        "iterations": result.steps,
        "final_val_loss": result.final_val_loss,
        "final_train_loss": result.final_train_loss,
        "nanogpt_val_loss": NANOGPT_VAL_LOSS,
        "anchor_run_tokens_per_s": result.tokens_per_second,
        "anchor_run_mfu": records[-1].get("mfu"),
        "wall_s": wall,
        "threads": torch.get_num_threads(),
        "baton_tokens_per_s_rounds": baton,
        "plain_loop_tokens_per_s_rounds": plain,
        "baton_tokens_per_s": statistics.median(baton),
        "plain_loop_tokens_per_s": statistics.median(plain),
    }
    (RESULTS / "train_nanogpt.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, RESULTS / "train_nanogpt.png", summary["baton_tokens_per_s"], summary["plain_loop_tokens_per_s"])
    print(
        f"\n| metric | Baton | reference |\n|---|---|---|\n"
        f"| val loss after {result.steps} it | {result.final_val_loss:.4f} | nanoGPT {NANOGPT_VAL_LOSS} |\n"
        f"| training tokens/s (median of {args.rounds} alternating rounds) | {summary['baton_tokens_per_s']:,.0f} | "
        f"plain loop {summary['plain_loop_tokens_per_s']:,.0f} |\n"
        f"| tokens/s and MFU over the whole anchor run | {result.tokens_per_second:,.0f}, {summary['anchor_run_mfu']:.1%} | |\n"
        f"| anchor run wall time | {wall:.0f} s | |"
    )


if __name__ == "__main__":
    main()
