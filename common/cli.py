"""The `baton` command line: one entry point, one subcommand per job.

This module owns `main`, the global flags, logging and the error mapping, plus the subcommands
that need only common/ (convert, info, bench). The training and serving sides register their own
subcommands (train/cli.py, serve/cli.py): the CLI finds them by module name in COMMAND_MODULES, so
common/ never imports either side, and an install without one of them still has the other's
commands. Subcommands import their machinery lazily so `baton --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import traceback
from pathlib import Path

from baton.common import errors

COMMAND_MODULES = ("baton.train.cli", "baton.serve.cli")  # each has register(subparsers, command)


CONVERT_OPTIONS = {  # direction -> the options it takes
    "from_hf": {"dtype"},
    "to_hf": set(),
    "from_megatron": {"dtype", "config"},
    "to_megatron": {"tp", "vocab_multiple"},
}
CONVERT_FLAGS = {
    "dtype": "--dtype",
    "config": "--config",
    "tp": "--tp",
    "vocab_multiple": "--make-vocab-size-divisible-by",
}


def _convert(args: argparse.Namespace) -> int:
    direction = next(d for d in CONVERT_OPTIONS if getattr(args, d))
    for option, flag in CONVERT_FLAGS.items():
        if getattr(args, option) is not None and option not in CONVERT_OPTIONS[direction]:
            raise ValueError(f"{flag} does not apply to --{direction.replace('_', '-')}")
    if args.from_hf:
        from baton.common.hf import import_hf

        out = import_hf(args.src, args.out, dtype=args.dtype)
        print(f"Imported HF checkpoint {args.src} -> Baton checkpoint {out}")
    elif args.to_hf:
        from baton.common.hf import export_hf

        out = export_hf(args.src, args.out)
        print(f"Exported Baton checkpoint {args.src} -> HF directory {out}")
    elif args.from_megatron:
        from baton.common.megatron_checkpoint import import_megatron

        out = import_megatron(args.src, args.out, config=args.config, dtype=args.dtype)
        print(f"Imported Megatron dist checkpoint {args.src} -> Baton checkpoint {out}")
    else:
        from baton.common.megatron_checkpoint import export_megatron

        out = export_megatron(
            args.src, args.out, tp_size=args.tp or 1, make_vocab_size_divisible_by=args.vocab_multiple or 128
        )
        print(f"Exported Baton checkpoint {args.src} -> Megatron dist checkpoint {out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from baton.common.checkpoint import read_config, read_metadata, verify_hashes

    cfg = read_config(args.checkpoint)
    if args.verify:
        verify_hashes(args.checkpoint)
    meta = read_metadata(args.checkpoint)
    print(
        json.dumps(
            {
                "config": cfg.to_dict(),
                "parameters": cfg.num_parameters(),
                "metadata": {k: v for k, v in meta.items() if k != "sha256"},
            },
            indent=2,
        )
    )
    return 0


def corpus_args(
    p: argparse.ArgumentParser,
    seq_len_help: str = "block length (as in the training recipe)",
    val_fraction: float = 0.02,
) -> None:
    """--data/--seq-len/--val-fraction: a corpus cut as the training recipe cuts it (common.data)."""
    p.add_argument("--data", default=None, help="text/JSONL file or directory (default: the embedded corpus)")
    p.add_argument("--seq-len", type=int, default=128, help=seq_len_help)
    p.add_argument(
        "--val-fraction", type=float, default=val_fraction, help="held-out fraction (as in the training recipe)"
    )


def corpus_config(args: argparse.Namespace):
    """The DataConfig that corpus_args' flags describe (validated as it is built)."""
    from baton.common.data import DataConfig

    return DataConfig(path=args.data, seq_len=args.seq_len, val_fraction=args.val_fraction)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(args: argparse.Namespace) -> int:
    """Run benchmarks/NAME.py from the source checkout with the arguments that follow (they write
    their table, JSON and plot under benchmarks/results/); without NAME, list them."""
    import ast
    import subprocess

    scripts = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))} if BENCHMARKS.is_dir() else {}
    if not scripts:
        raise ValueError(
            f"no benchmarks next to this install ({BENCHMARKS}): `baton bench` runs from a source "
            "checkout installed with `pip install -e .`"
        )
    if args.name is None:
        for name, path in scripts.items():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            print(f"{name:20} {doc.splitlines()[0] if doc else ''}")
        return 0
    if args.name not in scripts:
        raise ValueError(f"unknown benchmark {args.name!r}; one of: {', '.join(scripts)}")
    return subprocess.call([sys.executable, str(scripts[args.name]), *args.args])


def _command(argv: list[str]) -> str | None:
    """The subcommand argv runs (the first word that is not a flag), so only it builds its heavier flags."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Train transformer LMs and serve them.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="print the traceback of user errors too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # that side is not installed: its commands are absent
            if e.name is None or not name.startswith(e.name):
                raise
            continue
        module.register(sub, command)

    p = sub.add_parser(
        "convert", help="convert HF directories and Megatron dist checkpoints to and from Baton checkpoints"
    )
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", action="store_true", help="SRC is an HF directory (save_pretrained layout)")
    direction.add_argument("--to-hf", action="store_true", help="SRC is a Baton checkpoint")
    direction.add_argument(
        "--from-megatron",
        action="store_true",
        help="SRC is a megatron-core dist checkpoint (or a Megatron-LM save dir)",
    )
    direction.add_argument(
        "--to-megatron", action="store_true", help="SRC is a Baton checkpoint; OUT a dist checkpoint"
    )
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast while importing")
    p.add_argument("--config", help="--from-megatron: the model's config.json or a checkpoint dir holding one")
    p.add_argument("--tp", type=int, help="--to-megatron: pad the vocab for a Megatron run at this TP (default 1)")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        dest="vocab_multiple",
        type=int,
        help="--to-megatron: Megatron's flag of that name (default 128)",
    )
    p.set_defaults(func=_convert)

    p = sub.add_parser("info", help="print a checkpoint's config and provenance")
    p.add_argument("checkpoint")
    p.add_argument("--verify", action="store_true", help="also check the recorded sha256 of every file")
    p.set_defaults(func=_info)

    p = sub.add_parser("bench", help="run one of the repository's benchmarks (benchmarks/NAME.py); no NAME lists them")
    p.add_argument("name", nargs="?", help="e.g. serve_engine, paged_decode_cpu, speculative")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark, e.g. --quick")
    p.set_defaults(func=_bench)

    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user error - a bad recipe, flag, checkpoint, launch - is one line on
    stderr (`baton CMD: error: ...`) and exit code 2; anything else keeps its traceback (exit 1), since
    one line would hide where a bug or an environment failure came from.

    What is a user error (baton.common.errors): a UserError (ConfigError is one) always; a plain
    ValueError or FileNotFoundError only while the command is still checking what it was asked. A
    command marks the end of its checks with begin_work() - `baton train` does, once the recipe,
    the launch, the resume and the data are checked - and from then on those propagate with their
    traceback. Commands that never call it (generate, serve, convert, ...) keep every ValueError a
    one-line error. `baton --debug CMD` prints the traceback of user errors too.
    """
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    errors.reset()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        if not errors.is_user_error(e):
            raise  # a failure during the work: the traceback says where
        if args.debug:
            traceback.print_exc()
        print(f"baton {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
