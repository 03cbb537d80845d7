"""The training side's `baton` subcommands: train (a model, or Medusa heads) and export.

common/cli.py owns `main`, the shared flags and the error mapping; it finds these through
`register`. Handlers import their machinery lazily so `baton --help` stays instant.
"""

from __future__ import annotations

import argparse
import os

from baton.common.errors import UserError


def _train(args: argparse.Namespace) -> int:
    from baton.train.eagle import EagleTrainConfig, train_eagle
    from baton.train.medusa import MedusaTrainConfig, train_medusa
    from baton.train.recipe import load_recipe
    from baton.train.router import RouterTrainConfig, train_router
    from baton.train.trainer import train

    cfg = load_recipe(args.config, args.overrides)  # fails here, before any work, on a bad recipe
    if args.allow_resume_mismatch:
        if isinstance(cfg, (MedusaTrainConfig, RouterTrainConfig, EagleTrainConfig)):
            raise UserError(
                "--allow-resume-mismatch applies to model recipes; a Medusa, EAGLE or router recipe does not resume"
            )
        cfg.checkpoint.allow_resume_mismatch = True
    if isinstance(cfg, MedusaTrainConfig):
        print(f"Medusa heads written into {train_medusa(cfg)} (serve with: baton serve --speculative medusa)")
        return 0
    if isinstance(cfg, EagleTrainConfig):
        print(f"EAGLE head written into {train_eagle(cfg)} (serve with: baton serve --speculative eagle)")
        return 0
    if isinstance(cfg, RouterTrainConfig):
        rc = train_router(cfg).config
        print(
            f"Router ({rc.kind}, experts {', '.join(rc.experts)}) written into {cfg.out}: train accuracy "
            f"{rc.train_accuracy:.3f}, held-out {rc.val_accuracy:.3f} (serve with: baton serve --coe COE.yaml)"
        )
        return 0
    result = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under a launcher, one report
        print(f"Trained {result.steps} steps ({result.tokens_seen:,} tokens); handoff checkpoint: {result.handoff_dir}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from baton.train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out)
    print(f"Exported training checkpoint {args.checkpoint} -> handoff checkpoint {out}")
    return 0


def register(sub: argparse._SubParsersAction, command: str | None) -> None:
    """Add the training subcommands (`command`, the one being run, is not needed here)."""
    p = sub.add_parser(
        "train", help="train a model, Medusa heads for one, or a CoE router, from a YAML recipe (configs/*.yaml)"
    )
    p.add_argument("--config", required=True, help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe values, e.g. optim.lr=1e-3")
    p.add_argument(
        "--allow-resume-mismatch",
        action="store_true",
        help="resume even if the data, tokenizer, seq_len or seed differ from the checkpoint's (warns)",
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "export", help="consolidate a training checkpoint (any backend, ZeRO shards too) into a handoff checkpoint"
    )
    p.add_argument("checkpoint", help="a step checkpoint, or a run's out_dir (its latest checkpoint is used)")
    p.add_argument("out", help="where the handoff checkpoint goes")
    p.set_defaults(func=_export)
