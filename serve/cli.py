"""The serving side's `baton` subcommands: demo, generate, serve, query, distill, quantize, prune, eval.

common/cli.py owns `main`, the shared flags and the error mapping; it finds these through
`register`. Handlers import their machinery lazily so `baton --help` stays instant. The engine's
flags (`baton serve`, `baton generate`) are derived from EngineConfig, SchedulerConfig and
SpeculativeConfig (baton.common.flags), so every engine option is reachable from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from baton.common.cli import corpus_args, corpus_config
from baton.serve import engine_flags
from baton.serve.openai.reasoning import REASONING_PARSERS
from baton.serve.openai.tool_parsers import TOOL_PARSERS

ENGINE_COMMANDS = ("serve", "generate")


def _token(path: str | None) -> str | None:
    """A bearer token from a file or $BATON_AUTH_TOKEN (never from the command line: ps shows it)."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    return os.environ.get("BATON_AUTH_TOKEN") or None


def _generate(args: argparse.Namespace) -> int:
    from baton.serve.llm import LLM
    from baton.serve.sampling_params import SamplingParams

    llm = LLM(args.model, engine_flags.engine_config(args))
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
    from baton.serve.openai.tool_calling import AgentConfig
    from baton.serve.parallel import check_layout, launched_rank, rendezvous
    from baton.serve.runtime import Limits
    from baton.serve.server import ServerConfig, run

    engine = engine_flags.engine_config(args)
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
        agents=AgentConfig(
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            chat_template=args.chat_template,
        ),
    )
    config.agents.validate()  # unknown parser names are refused before anything binds or loads
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
    engine_flags.engine_flags(p, full=command == "generate")
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
    agents = p.add_argument_group("tool calling and reasoning (the HTTP API; vLLM's flags, docs/agents.md)")
    agents.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse the calls a model chooses to make (tool_choice "auto", the default with tools)',
    )
    agents.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        default=None,
        help=f"the tool-call format: {', '.join(TOOL_PARSERS)} (default: the checkpoint family's)",
    )
    agents.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        default=None,
        help=f"return a thinking model's reasoning as reasoning_content: {', '.join(REASONING_PARSERS)} (default: off)",
    )
    agents.add_argument(
        "--chat-template", metavar="FILE", default=None, help="a jinja chat template replacing the checkpoint's"
    )
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None, help="cast weights on load")
    p.add_argument("--device", default="cpu")
    engine_flags.engine_flags(p, full=command == "serve")
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
