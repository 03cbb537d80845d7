"""The serving side's `baton` subcommands: demo, generate, serve, query, distill, quantize, prune, eval.

common/cli.py owns `main`, the shared flags and the error mapping; it finds these through
`register`. Handlers import their machinery lazily so `baton --help` stays instant. The engine's
flags (`baton serve`, `baton generate`) are derived from EngineConfig, SchedulerConfig and
SpeculativeConfig (baton.common.flags), so every engine option is reachable from the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from baton.common.cli import corpus_args, corpus_config

ENGINE_COMMANDS = ("serve", "generate")
SPECULATIVE_ALIASES = {
    "num_speculative_tokens": "num_speculative_tokens",
    "draft_model": "draft_model",
    "exit_layer": "exit_layer",
}


def _token(path: str | None) -> str | None:
    """A bearer token from a file or $BATON_AUTH_TOKEN (never from the command line: ps shows it)."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return os.environ.get("BATON_AUTH_TOKEN") or None


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
        kv_cache_bytes=_kv_cache_bytes(args),
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


def _kv_cache_bytes(args: argparse.Namespace) -> int | None:
    if args.kv_cache_mb is not None:
        return args.kv_cache_mb * 2**20
    on_cuda = str(getattr(args, "device", "cpu")).startswith("cuda")
    return None if on_cuda else 256 * 2**20


def _engine_flags(p: argparse.ArgumentParser, full: bool) -> None:
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


def _generate(args: argparse.Namespace) -> int:
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    llm = LLM(args.model, engine_config(args))
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    for out in llm.generate(args.prompt, params):
        for c in out.outputs:
            print(f"--- [{out.request_id} #{c.index}, {c.finish_reason}, {len(c.token_ids)} tokens]")
            print((out.prompt or "") + c.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Serve (rank 0, or a plain process) or, on the other ranks of a torchrun/srun job, run a worker."""
    from baton.serve.parallel import check_layout, launched_rank, rendezvous
    from baton.serve.runtime import Limits
    from baton.serve.server import ServerConfig, run

    engine = engine_config(args)
    if args.coe is not None and (launched_rank() is not None or engine.parallel.world_size > 1):
        raise ValueError("--coe serves each expert on one device: tensor/pipeline parallel experts are not supported")
    launch = launched_rank()
    if launch is not None or engine.parallel.world_size > 1:  # every rank refuses a bad layout alike, at once
        check_layout(args.model, engine.parallel, args.device, launch)
    if launch is not None and launch.rank > 0:
        from baton.serve.parallel.worker import worker_main

        local = (launch.local_rank, launch.local_world_size)
        worker_main(
            launch.rank, launch.world_size, rendezvous(launch), engine.parallel, args.device.split(":")[0], local
        )
        return 0
    limits = Limits(
        max_concurrent=args.max_concurrent,
        max_queued=args.max_queued,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_message_bytes=int(args.max_message_mb * 2**20),
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_chars,
        max_stop_token_ids=args.max_stop_token_ids,
    )
    config = ServerConfig(
        model=args.model or args.coe,
        model_name=args.model_name,
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        http_port=args.http_port,
        metrics_host=args.metrics_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=_token(args.auth_token_file),
        drain_timeout_s=args.drain_timeout,
        device=args.device,
        dtype=args.dtype,
        limits=limits,
        engine=engine,
    )
    if args.coe is not None:
        from baton.serve.coe.server import CoEServer, coe_server_config

        config, coe = coe_server_config(args.coe, config)  # a bad CoE file fails here, before a port binds
        return run(config, lambda c: CoEServer(c, coe))
    return run(config)


def _query(args: argparse.Namespace) -> int:
    import grpc
    from baton.serve.client import BatonClient
    from google.protobuf.json_format import MessageToDict

    with BatonClient(args.target, token=_token(args.auth_token_file), ca_file=args.ca, timeout=args.timeout) as c:
        try:
            if args.info:
                print(
                    json.dumps(
                        {
                            "model": MessageToDict(c.model_info()),
                            "server": MessageToDict(c.server_info()),
                            "health": c.health(),
                        },
                        indent=2,
                    )
                )
                return 0
            if args.prompt is None:
                raise SystemExit("baton query: give a PROMPT (or --info)")
            sampling = dict(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                stop=args.stop or [],
            )
            if args.seed is not None:
                sampling["seed"] = args.seed
            finish = ""
            for msg in c.generate(args.prompt, **sampling):
                for comp in msg.completions:
                    print(comp.text, end="", flush=True)
                    finish = comp.finish_reason or finish
                if msg.finished:
                    u = msg.usage
                    print(
                        f"\n--- [{msg.request_id}: {finish}, {u.prompt_tokens} prompt + "
                        f"{u.completion_tokens} generated tokens]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"baton query: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from baton.serve.demo import run_demo

    run_demo(out_dir=Path(args.out), steps=args.steps, corpus=args.data)
    return 0


def _distill(args: argparse.Namespace) -> int:
    from baton.serve.distill import DistillConfig, write_distillation_corpus

    cfg = DistillConfig(corpus_config(args), samples=args.samples, temperature=args.temperature, seed=args.seed)
    out = write_distillation_corpus(args.model, args.out, cfg)
    print(
        f"Wrote {args.samples} continuations by {args.model} to {out} "
        f"(train a draft or Medusa heads on it: data.path={out})"
    )
    return 0


def _calibration(args: argparse.Namespace):
    from baton.serve.quantization.calibration import CalibrationConfig

    return CalibrationConfig(corpus_config(args), num_samples=args.calib_samples, sample_seed=args.seed)


def _quantize(args: argparse.Namespace) -> int:
    from baton.serve.quantization.config import QuantConfig
    from baton.serve.quantization.quantize import quantize_checkpoint

    bits = args.bits or (4 if args.method in ("gptq", "awq") else 8)
    qcfg = QuantConfig(
        method=args.method,
        bits=bits,
        group_size=args.group_size,
        act_order=args.act_order,
        alpha=None if args.alpha == "auto" else args.alpha,
    )
    out = quantize_checkpoint(args.src, args.out, qcfg, _calibration(args))
    print(f"Quantized {args.src} ({qcfg.method}, {qcfg.format}) -> {out}")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from baton.serve.quantization.prune import PruneConfig, prune_checkpoint

    out = prune_checkpoint(
        args.src, args.out, PruneConfig(heads=args.heads, channels=args.channels), _calibration(args)
    )
    print(f"Pruned {args.src} -> {out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from baton.serve.eval import EvalConfig, evaluate_checkpoint

    cfg = EvalConfig(corpus_config(args), window=args.window, stride=args.stride, max_tokens=args.max_tokens)
    result = evaluate_checkpoint(args.model, cfg, args.reference)
    text = json.dumps(result.to_dict(), indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def _alpha(v: str) -> float | str:
    return v if v == "auto" else float(v)


def register(sub: argparse._SubParsersAction, command: str | None) -> None:
    """Add the serving subcommands; `command` is the one being run (its derived flags are built)."""
    p = sub.add_parser("demo", help="the main job on the embedded default: train a small model, hand it off, serve it")
    p.add_argument("--out", default="runs/demo", help="where the run and its handoff checkpoint go")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--data", default=None, help="a text/JSONL file or directory (default: the embedded corpus)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("distill", help="a model's own continuations (JSONL) to train a draft or Medusa heads on")
    p.add_argument("--model", required=True, help="the target checkpoint directory")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    corpus_args(p, seq_len_help="a line's tokens: seq_len + 1 (prompt + continuation)", val_fraction=0.05)
    p.add_argument("--samples", type=int, default=2048, help="continuations to write")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = the model's greedy continuations")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_distill)

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
    _engine_flags(p, full=command == "generate")
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over gRPC (Baton API, KServe v2/Triton, health, metrics) and, with "
        "--http-port, OpenAI's HTTP API",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="checkpoint directory")
    what.add_argument(
        "--coe",
        metavar="COE.yaml",
        default=None,
        help="serve a Composition of Experts: several checkpoints and a router (configs/coe.yaml)",
    )
    p.add_argument(
        "--served-model-name",
        "--model-name",
        dest="model_name",
        default=None,
        help="name clients use (vLLM's flag; --model-name is the older alias; default: the directory's name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8001, help="gRPC port (0: any free port, logged)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) here (0: any; "
        "default off)",
    )
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (-1: off, 0: any)")
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address /metrics binds (default loopback: it has no auth, unlike the gRPC port)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate (chain) to serve TLS; needs --tls-key")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="require 'authorization: Bearer <token>' (token read from this file, else $BATON_AUTH_TOKEN)",
    )
    p.add_argument("--max-concurrent", type=int, default=64, help="generation requests in the engine at once")
    p.add_argument(
        "--max-queued", type=int, default=256, help="requests waiting for a slot; beyond them: RESOURCE_EXHAUSTED"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default: the context)")
    p.add_argument("--max-output-tokens", type=int, default=1024, help="largest max_tokens accepted")
    p.add_argument("--max-message-mb", type=float, default=4.0, help="largest gRPC message either way")
    p.add_argument("--max-n", type=int, default=16, help="largest sampling n (parallel samples) accepted")
    p.add_argument("--max-stop-strings", type=int, default=16, help="most stop strings per request")
    p.add_argument("--max-stop-chars", type=int, default=256, help="longest stop string accepted, in characters")
    p.add_argument("--max-stop-token-ids", type=int, default=64, help="most stop_token_ids per request")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None, help="cast weights on load")
    p.add_argument("--device", default="cpu")
    _engine_flags(p, full=command == "serve")
    p.set_defaults(func=_serve)

    p = sub.add_parser("query", help="stream a generation from a running `baton serve`")
    p.add_argument("prompt", nargs="?", default=None)
    p.add_argument("--target", default="127.0.0.1:8001", help="host:port of the server")
    p.add_argument("--info", action="store_true", help="print model and server info instead")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ca", default=None, help="CA certificate (PEM) to trust: connects with TLS")
    p.add_argument("--auth-token-file", default=None, help="bearer token file (else $BATON_AUTH_TOKEN)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.set_defaults(func=_query)

    p = sub.add_parser("quantize", help="quantize a float checkpoint (RTN, GPTQ, AWQ, SmoothQuant W8A8, FP8)")
    p.add_argument("src", help="float handoff checkpoint")
    p.add_argument("out", help="where the quantized checkpoint goes")
    p.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "smoothquant", "fp8"])
    p.add_argument("--bits", type=int, default=None, help="weight bits: 8 or 4 (default: 4 for gptq/awq, else 8)")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size: 32, 64 or 128")
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns in decreasing Hessian-diagonal order")
    p.add_argument(
        "--alpha", default=0.5, type=_alpha, help="SmoothQuant migration strength in [0, 1], or 'auto' to search"
    )
    p.add_argument("--calib-samples", type=int, default=128, help="calibration blocks from the training split")
    p.add_argument("--seed", type=int, default=0, help="which calibration blocks are drawn")
    corpus_args(p)
    p.set_defaults(func=_quantize)

    p = sub.add_parser("prune", help="remove attention head groups / MLP channels: a smaller dense checkpoint")
    p.add_argument("src", help="float handoff checkpoint")
    p.add_argument("out", help="where the pruned checkpoint goes")
    p.add_argument("--heads", type=float, default=0.0, help="fraction of KV head groups to remove per layer")
    p.add_argument("--channels", type=float, default=0.0, help="fraction of MLP channels to remove per layer")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration blocks for the importance scores")
    p.add_argument("--seed", type=int, default=0, help="which calibration blocks are drawn")
    corpus_args(p)
    p.set_defaults(func=_prune)

    p = sub.add_parser("eval", help="perplexity on held-out text, and agreement with a reference model")
    p.add_argument("model", help="checkpoint directory (float or quantized)")
    p.add_argument("--reference", default=None, help="e.g. the unquantized checkpoint: adds ppl delta and agreement")
    p.add_argument("--window", type=int, default=128, help="tokens per forward")
    p.add_argument("--stride", type=int, default=64, help="new tokens scored per window")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on held-out tokens")
    p.add_argument("--json", default=None, help="also write the result here")
    corpus_args(p)
    p.set_defaults(func=_eval)
