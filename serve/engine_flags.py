"""The engine's command-line flags (`baton serve`, `baton generate`): a few written by hand for
the reader, one derived from every other field of EngineConfig, SchedulerConfig, SpeculativeConfig
and ParallelConfig (baton.common.flags), and engine_config() that turns them back into a checked
EngineConfig before a server binds its port. Imports of the engine stay inside the functions, so
`baton --help` does not load torch.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

SPECULATIVE_ALIASES = {
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_model": "draft_model",
    "exit_layer": "exit_layer",
}


def engine_config(args: argparse.Namespace):
    """EngineConfig from the hand-written and the derived flags; a bad setting fails here, before a
    server binds its port."""
    from baton.common.flags import dataclass_from_flags
    from baton.serve import openmp

    logging.getLogger(__name__).info(openmp.configure(getattr(args, "omp_wait_policy", None)))
    from baton.serve.engine import EngineConfig
    from baton.serve.scheduling.scheduler import SchedulerConfig
    from baton.serve.speculative import SpeculativeConfig

    spec = None
    if getattr(args, "speculative", None) is not None:
        spec = dataclass_from_flags(
            SpeculativeConfig, args, "speculative_", SPECULATIVE_ALIASES, method=args.speculative
        )
    from baton.serve.parallel.config import ParallelConfig

    scheduler = dataclass_from_flags(SchedulerConfig, args)
    parallel = dataclass_from_flags(ParallelConfig, args)
    config = dataclass_from_flags(
        EngineConfig,
        args,
        kv_cache_bytes=kv_cache_bytes(args),
        scheduler=scheduler,
        speculative=spec,
        parallel=parallel,
    )
    config.validate()  # the scheduler's and speculative settings too
    if spec is not None and getattr(args, "model", None):
        from baton.serve.speculative.registry import check_checkpoint

        check_checkpoint(spec, args.model)  # heads, a draft, a depth to draft from: refused now, not after binding
    if getattr(args, "model", None):  # what combines with what, model included: before any port binds
        from baton.common.checkpoint import read_config
        from baton.serve.engine.rules import check as check_rules

        has_config = (Path(args.model) / "config.json").is_file()
        check_rules(config, read_config(args.model) if has_config else None)
    return config


def kv_cache_bytes(args: argparse.Namespace) -> int | None:
    if args.kv_cache_mb is not None:
        return args.kv_cache_mb * 2**20
    on_cuda = str(getattr(args, "device", "cpu")).startswith("cuda")
    return None if on_cuda else 256 * 2**20


def engine_flags(p: argparse.ArgumentParser, full: bool) -> None:
    """The engine flags a reader needs most, by hand; with `full`, one derived flag per other field."""
    from baton.serve.speculative import METHOD_HELP, METHODS  # (no torch: `baton --help` stays instant)

    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="KV cache budget per rank (default: 256 on CPU; on CUDA what --gpu-memory-utilization leaves)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="store K/V as int8 or fp8 codes with a scale per token and head (~3.6x the tokens per MB of fp32)",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=["auto", "spin", "passive"],
        default=None,
        help="CPU: OpenMP threads spin or sleep between parallel regions (default auto: sleep when the machine "
        "is already busy; serve/openmp.py)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size (overrides --kv-cache-mb)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    # vLLM's names for the scheduler and KV-cache switches users bring with them (None: the config's default)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per engine step (prefill chunks + decodes)"
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV blocks of common prompt prefixes between requests (default: on)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts over steps so decodes never stall (default: on)",
    )
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=None, help="ranks that split every layer (vLLM's name)"
    )
    p.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=None, help="ranks that each hold a slice of the layers"
    )
    modes = "; ".join(f"{m}: {words}" for m, words in METHOD_HELP.items())
    p.add_argument("--speculative", choices=METHODS, default=None, help=f"speculative decoding - {modes}")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step")
    p.add_argument("--draft-model", default=None, help="draft checkpoint for --speculative draft")
    p.add_argument(
        "--exit-layer",
        type=int,
        default=None,
        metavar="E",
        help="--speculative layerskip: draft with the model's first E layers (default: its first recorded exit)",
    )
    p.add_argument(
        "--speculative-disable-above-batch",
        type=int,
        default=None,
        metavar="N",
        help="no speculation while more than N sequences decode (it stops paying; see docs/benchmarks.md)",
    )
    if full:  # only when this command runs: deriving them imports the engine (torch)
        from baton.common.flags import add_dataclass_flags
        from baton.serve.engine import EngineConfig
        from baton.serve.scheduling.scheduler import SchedulerConfig
        from baton.serve.speculative import SpeculativeConfig

        add_dataclass_flags(p, EngineConfig, skip=("kv_cache_bytes",), group="engine (EngineConfig)")
        add_dataclass_flags(p, SchedulerConfig, group="scheduler (SchedulerConfig)")
        from baton.serve.parallel.config import ParallelConfig

        add_dataclass_flags(p, ParallelConfig, group="tensor/pipeline parallel serving (ParallelConfig)")
        add_dataclass_flags(
            p,
            SpeculativeConfig,
            "speculative_",
            skip=("method", *SPECULATIVE_ALIASES),
            group="speculative decoding (SpeculativeConfig)",
        )
