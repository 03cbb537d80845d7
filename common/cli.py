"""The `baton` command line: one entry point, one subcommand per job.

Subcommands import their machinery lazily so `baton --help` is instant and a broken optional
component cannot take the whole CLI down.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _convert(args: argparse.Namespace) -> int:
    from baton.common.hf import export_hf, import_hf

    if args.from_hf:
        out = import_hf(args.src, args.out, dtype=args.dtype)
        print(f"Imported HF checkpoint {args.src} -> Baton checkpoint {out}")
    else:
        if args.dtype:
            raise SystemExit("baton convert: --dtype applies to --from-hf only")
        out = export_hf(args.src, args.out)
        print(f"Exported Baton checkpoint {args.src} -> HF directory {out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from baton.common.checkpoint import read_config, read_metadata, verify_hashes

    cfg = read_config(args.checkpoint)
    if args.verify:
        verify_hashes(args.checkpoint)
    meta = read_metadata(args.checkpoint)
    print(json.dumps({"config": cfg.to_dict(), "parameters": cfg.num_parameters(),
                      "metadata": {k: v for k, v in meta.items() if k != "sha256"}}, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from baton.serve.engine import EngineConfig
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    llm = LLM(args.model, EngineConfig(kv_cache_bytes=args.kv_cache_mb * 2**20))
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    for out in llm.generate(args.prompt, params):
        for c in out.outputs:
            print(f"--- [{out.request_id} #{c.index}, {c.finish_reason}, {len(c.token_ids)} tokens]")
            print((out.prompt or "") + c.text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from baton.train.demo import run_demo

    run_demo(out_dir=Path(args.out), steps=args.steps, corpus=args.data)
    return 0


def _train(args: argparse.Namespace) -> int:
    from baton.train.config import load_config
    from baton.train.trainer import train

    cfg = load_config(args.config, args.overrides)  # fails here, before any work, on a bad recipe
    result = train(cfg)
    print(f"Trained {result.steps} steps ({result.tokens_seen:,} tokens); handoff checkpoint: {result.handoff_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Train transformer LMs and serve them.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="the main job on the embedded default: train a small model, hand it off, generate")
    p.add_argument("--out", default="runs/demo", help="where the run and its handoff checkpoint go")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--data", default=None, help="a text/JSONL file or directory (default: the embedded corpus)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("train", help="train a model from a YAML recipe (configs/*.yaml)")
    p.add_argument("--config", required=True, help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe values, e.g. optim.lr=1e-3")
    p.set_defaults(func=_train)

    p = sub.add_parser("convert", help="convert between HF checkpoint directories and Baton checkpoints")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", action="store_true", help="SRC is an HF directory (save_pretrained layout)")
    direction.add_argument("--to-hf", action="store_true", help="SRC is a Baton checkpoint")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast while importing")
    p.set_defaults(func=_convert)

    p = sub.add_parser("info", help="print a checkpoint's config and provenance")
    p.add_argument("checkpoint")
    p.add_argument("--verify", action="store_true", help="also check the recorded sha256 of every file")
    p.set_defaults(func=_info)

    p = sub.add_parser("generate", help="generate from prompts with the serving engine (offline, no server)")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", required=True, action="append", help="repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("-n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache budget")
    p.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # config/checkpoint errors: say what, not a traceback
        print(f"baton {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
