"""3D-parallel training on this machine: tokens/s and memory per rank for each layout at world
size 1, 2 and 4, and activation memory per layer with tensor/sequence parallelism and selective
recomputation next to Megatron's formulas (Korthikanti et al. 2022, bytes per layer, fp16):

    no parallelism:        s·b·h·(34 + 5·a·s/h)
    tensor parallel (t):   s·b·h·(10 + 24/t + 5·a·s/(h·t))
    TP + SP + selective:   34·s·b·h/t

On CPU with gloo every collective is a loopback copy through the kernel and all ranks share the
same cores, so communication and oversubscription dominate: more ranks make a step slower, not
faster. The throughput table measures that overhead per layout; it says nothing about GPUs.

Activations are measured, not estimated (baton.train.recompute.activation_bytes: what a forward
leaves alive for the backward, on each rank), for 4- and 2-layer models, the difference halved.
The attention core is the unfused one Megatron's formula assumes. Baton is fp32, SwiGLU/RMSNorm,
no dropout, so bytes differ from the fp16/GELU/dropout formula; the ratios across layouts are the
comparison (TP divides everything but the 10·sbh of replicated norm/residual/dropout activations;
SP divides those too; selective removes the 5as/h attention term).

    .venv/bin/python benchmarks/train_parallel.py [--steps 4] [--worlds 1 2 4]

Writes benchmarks/results/train_parallel.{json,png} and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.train.config import OptimConfig
from baton.train.distributed import free_port
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D
from baton.train.recompute import EagerAttention, SelectiveRecompute

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_MODEL = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
)
SEQ, GLOBAL_BATCH, MICRO_BATCHES = 128, 16, 4
LAYOUTS = {
    1: {"single": {}},
    2: {
        "dp2 fsdp": dict(dp=2),
        "dp2 ddp": dict(dp=2, dp_mode="ddp"),
        "tp2": dict(tp=2, sequence_parallel=False),
        "tp2 sp": dict(tp=2),
        "pp2 1f1b": dict(pp=2),
        "pp2 gpipe": dict(pp=2, pp_schedule="gpipe"),
        "pp2 interleaved": dict(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
        "cp2": dict(cp=2),
    },
    4: {
        "dp4 fsdp": dict(dp=4),
        "tp4 sp": dict(tp=4),
        "pp4 1f1b": dict(pp=4),
        "tp2 dp2": dict(tp=2, dp=2),
        "tp2 pp2": dict(tp=2, pp=2),
        "pp2 dp2": dict(pp=2, dp=2),
        "cp2 tp2": dict(cp=2, tp=2),
        "cp2 dp2": dict(cp=2, dp=2),
    },
}
# Activation study: s, b, h, a as in the formulas; t = 2.
ACT_S, ACT_B, ACT_H, ACT_A = 256, 1, 64, 4
ACT_MODES = {
    1: {"none": (dict(), False)},
    2: {
        "tp": (dict(tp=2, sequence_parallel=False), False),
        "tp+sp": (dict(tp=2), False),
        "tp+sp+selective": (dict(tp=2), True),
    },
}


def engine_for(model_cfg: ModelConfig, par: dict, micro: int, attn=None) -> Parallel3D:
    layout = check_layout(ParallelConfig(**par), model_cfg, dist.get_world_size(), micro, SEQ)
    return Parallel3D(build_model(model_cfg, seed=0), build_mesh(layout), micro, OptimConfig(lr=1e-3), attn=attn)


def throughput(par: dict, steps: int) -> dict:
    cfg = ModelConfig(**THROUGHPUT_MODEL)
    engine = engine_for(cfg, par, MICRO_BATCHES)
    dp, dp_rank = engine.layout.dp, engine.mesh.rank("dp")
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(2 + steps):  # two warm-up steps (pipeline shape inference, allocator)
        tokens = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        rows = tokens.chunk(dp)[dp_rank]
        dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(list(rows.chunk(MICRO_BATCHES)))
        engine.clip_and_step(1e-3, 1.0, True)
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    state = engine.memory()["accelerator"]
    return {
        "layout": engine.layout.describe(),
        "tokens_per_s": GLOBAL_BATCH * SEQ / statistics.median(times),
        "step_s": statistics.median(times),
        "model_state_bytes": sum(state.values()),
        "rss_bytes": psutil.Process().memory_info().rss,
    }


def _plain_tensors(t):
    """The real tensors inside a tensor subclass (DTensor's local shard, a collective's result)."""
    if hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _plain_tensors(getattr(t, name))
    elif isinstance(t, torch.Tensor):
        yield t


class LiveLocalStorages(TorchDispatchMode):
    """baton.train.recompute.activation_bytes for tensor-parallel code: a DTensor result is
    counted by its local shard (the wrapper has no storage of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (p for leaf in torch.utils._pytree.tree_leaves(out) for p in _plain_tensors(leaf)):
            if t.device.type != "meta":
                s = t.untyped_storage()
                old = self.created.get(s.data_ptr())
                if old is None or old[0].expired():
                    self.created[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out


def activation_bytes(forward) -> int:
    with LiveLocalStorages() as mode:
        loss = forward()
    live = sum(n for ref, n in mode.created.values() if not ref.expired())
    del loss
    return live


def activations(par: dict, selective: bool) -> float:
    """Bytes per layer that one rank's forward keeps for the backward (eager attention core)."""
    per = {}
    for layers in (2, 4):
        cfg = ModelConfig(
            vocab_size=128,
            hidden_size=ACT_H,
            intermediate_size=4 * ACT_H,
            num_hidden_layers=layers,
            num_attention_heads=ACT_A,
            max_position_embeddings=ACT_S,
        )
        attn = SelectiveRecompute(EagerAttention()) if selective else EagerAttention()
        engine = engine_for(cfg, par, 1, attn)
        tokens = torch.randint(0, 128, (ACT_B, ACT_S + 1), generator=torch.Generator().manual_seed(0))
        ids, labels = engine._inputs(tokens)

        def forward() -> torch.Tensor:
            with engine._loss_context():
                return engine._loss(engine.runners[0](ids), labels)

        per[layers] = activation_bytes(forward)
    return (per[4] - per[2]) / 2


def worker(out: Path, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    result: dict = {"throughput": {}, "activations": {}}
    try:
        for name, par in LAYOUTS[world].items():
            result["throughput"][name] = throughput(par, steps)
        for name, (par, selective) in ACT_MODES.get(world, {}).items():
            result["activations"][name] = activations(par, selective)
    finally:
        dist.destroy_process_group()
    (out / f"world{world}_rank{rank}.json").write_text(json.dumps(result))


def formulas(t: int) -> dict[str, float]:
    """Megatron's bytes per layer (fp16 activations, 1-byte dropout masks, GELU MLP of 4h)."""
    s, b, h, a = ACT_S, ACT_B, ACT_H, ACT_A
    return {
        "none": s * b * h * (34 + 5 * a * s / h),
        "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h * (34 + 5 * a * s / h) / t,
        "tp+sp+selective": 34 * s * b * h / t,
    }


def baton_formulas(t: int) -> dict[str, float]:
    """The same accounting for Baton's layer: fp32 (4 bytes), no dropout, RMSNorm (keeps its input
    and normalised value), SwiGLU of 4h (keeps gate, up, silu(gate) and their product: 16 sbh).
    Per layer: norms 6 sbh, q/k/v 3, o_proj input 1, MLP 16, softmax output a s^2 b. Under
    DTensor sequence parallelism the all-gathered input of the column-parallel projections is
    kept whole (2 sbh per layer) where Megatron-LM keeps the shard and gathers again in backward."""
    s, b, h, a = ACT_S, ACT_B, ACT_H, ACT_A
    sbh, s2 = s * b * h, a * s * s * b
    return {
        "none": 4 * (26 * sbh + s2),
        "tp": 4 * ((6 + 20 / t) * sbh + s2 / t),
        "tp+sp": 4 * ((2 + 24 / t) * sbh + s2 / t),
        "tp+sp+selective": 4 * (2 + 24 / t) * sbh,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout (after 2 warm-up steps)")
    p.add_argument("--worlds", type=int, nargs="+", default=sorted(LAYOUTS), choices=sorted(LAYOUTS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.steps)
    out = Path(tempfile.mkdtemp(prefix="baton-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in args.worlds:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world}",
            f"--master_port={free_port()}",
            __file__,
            "--worker",
            str(out),
            "--steps",
            str(args.steps),
        ]
        subprocess.run(cmd, env=env, check=True)
    ranks = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("world*_rank*.json"))}
    table, acts = [], {}
    for world in args.worlds:
        layouts = LAYOUTS[world]
        per_rank = [ranks[f"world{world}_rank{r}"] for r in range(world)]
        for name in layouts:
            rows = [r["throughput"][name] for r in per_rank]
            table.append(
                {
                    "world": world,
                    "name": name,
                    "layout": rows[0]["layout"],
                    "tokens_per_s": rows[0]["tokens_per_s"],
                    "step_s": rows[0]["step_s"],
                    "model_state_mb": [x["model_state_bytes"] / 2**20 for x in rows],
                    "rss_mb": [x["rss_bytes"] / 2**20 for x in rows],
                }
            )
        for name in ACT_MODES.get(world, {}):
            acts[name] = {"measured_per_rank": [r["activations"][name] for r in per_rank], "t": world}
    for name, a in acts.items():
        a["megatron_formula"], a["baton_formula"] = formulas(a["t"])[name], baton_formulas(a["t"])[name]
    result = {
        "machine": f"{os.cpu_count()} CPU cores, gloo on loopback, 1 thread per rank",
        "model": THROUGHPUT_MODEL,
        "seq": SEQ,
        "global_batch": GLOBAL_BATCH,
        "micro_batches": MICRO_BATCHES,
        "throughput": table,
        "activation_study": {"s": ACT_S, "b": ACT_B, "h": ACT_H, "a": ACT_A, "modes": acts},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_parallel.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "train_parallel.png")
    print(
        "| world | layout | tokens/s | step s | model state MB per rank | RSS MB per rank |\n|---|---|---|---|---|---|"
    )
    for r in table:
        print(
            f"| {r['world']} | {r['layout']} | {r['tokens_per_s']:.0f} | {r['step_s']:.3f} | "
            f"{', '.join(f'{x:.2f}' for x in r['model_state_mb'])} | {', '.join(f'{x:.0f}' for x in r['rss_mb'])} |"
        )
    print(
        "\n| mode | measured bytes/layer (rank 0) | Megatron formula (fp16) | Baton formula (fp32) | measured / Baton |"
        "\n|---|---|---|---|---|"
    )
    for name, a in acts.items():
        m = a["measured_per_rank"][0]
        print(
            f"| {name} (t={a['t']}) | {m:,.0f} | {a['megatron_formula']:,.0f} | {a['baton_formula']:,.0f} | "
            f"{m / a['baton_formula']:.2f} |"
        )


def plot(result: dict, path: Path) -> None:
    """Tokens/s and model state per rank for each layout (left), activation bytes per layer (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"][::-1]
    names = [f"{r['world']}: {r['layout']}" for r in rows]
    fig, (a, m, b) = plt.subplots(1, 3, figsize=(16, 0.3 * len(rows) + 2), gridspec_kw={"width_ratios": [2, 1, 2]})
    colours = [f"C{r['world']}" for r in rows]
    a.barh(names, [r["tokens_per_s"] for r in rows], color=colours)
    a.set_xlabel("tokens/s (2 CPU cores, gloo)")
    a.tick_params(axis="y", labelsize=7)
    m.barh(names, [max(r["model_state_mb"]) for r in rows], color=colours)
    m.set_yticks([])
    m.set_xlabel("model state MB, largest rank")
    modes = result["activation_study"]["modes"]
    x = range(len(modes))
    b.bar([i - 0.3 for i in x], [v["measured_per_rank"][0] / 2**20 for v in modes.values()], 0.3, label="measured")
    b.bar(x, [v["baton_formula"] / 2**20 for v in modes.values()], 0.3, label="Baton formula (fp32)")
    b.bar(
        [i + 0.3 for i in x],
        [v["megatron_formula"] / 2**20 for v in modes.values()],
        0.3,
        label="Megatron formula (fp16)",
    )
    b.set_xticks(list(x), [f"{k} (t={v['t']})" for k, v in modes.items()], fontsize=8)
    b.set_ylabel("activation MiB per layer, rank 0")
    b.legend(fontsize=8)
    fig.suptitle("3D-parallel training layouts on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
