"""Poison the loss with NaN in steps 3 and 4 of DeepSpeed runs (ZeRO 0, 2, 3; one rank) and record,
for every step, whether DeepSpeed applied it and whether the fp32 weights stayed the same.

Usage: nan_run.py RECIPE ROOT OUT.json (run as a subprocess: it sets up its own process group)."""

import json
import math
import sys

import torch
from deepspeed.utils import safe_get_full_fp32_param

from baton.train.backends import deepspeed as ds_backend
from baton.train.distributed import init_distributed
from baton.train.recipe import load_config
from baton.train.trainer import train

BAD_STEPS = {3, 4}


def weights(backend) -> list[torch.Tensor]:
    params = backend.engine.module.parameters()
    return [(p if backend.stage == 0 else safe_get_full_fp32_param(p)).detach().clone() for p in params]


def main(recipe: str, root: str, out: str) -> None:
    init_distributed(need_group=True)
    real_loss, real_step = ds_backend.lm_loss, ds_backend.DeepSpeedBackend.train_step
    report = {}
    for stage in (0, 2, 3):
        calls, seen = {"n": 0}, []

        def lm_loss(logits, batch):
            calls["n"] += 1
            loss = real_loss(logits, batch)
            return loss * math.nan if (calls["n"] - 1) // 2 + 1 in BAD_STEPS else loss  # 2 micro-batches a step

        def train_step(self, micro_batches, lr):
            before = weights(self)
            result = real_step(self, micro_batches, lr)
            seen.append([result.applied, all(torch.equal(a, b) for a, b in zip(before, weights(self)))])
            return result

        ds_backend.lm_loss, ds_backend.DeepSpeedBackend.train_step = lm_loss, train_step
        cfg = load_config(
            recipe,
            [
                f"out_dir={root}/z{stage}",
                "backend=deepspeed",
                f"deepspeed.stage={stage}",
                "max_steps=8",
                "export=false",
            ],
        )
        result = train(cfg)
        report[stage] = {"seen": seen, "skipped": result.skipped_steps, "final_loss": result.final_train_loss}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
