"""Run by torchrun (2 gloo ranks): Parallel3D at the layouts that never moved their model to the GPU
before (pipeline only, TP without SP, DDP mode) and FSDP2 / CP, with spies on what a CUDA run
depends on: the model is moved to the engine's device explicitly (CausalLM.to), every tensor handed
to a torch.distributed collective is on the parameters' device, and nothing in the step makes a
host copy (Tensor.cpu) for a reduction. Writes OUT/<layout>.rank<r>.json."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent / "parallel"))
from harness import MICRO_BATCHES, MODEL, OPTIM, SEQ, batch

from baton.common.model import CausalLM, build_model
from baton.train.distributed import rank_device
from baton.train.parallel.layout import ParallelConfig, check_layout
from baton.train.parallel.mesh import build_mesh
from baton.train.parallel.parallelize import Parallel3D

LAYOUTS = {
    "pp2": {"pp": 2},
    "tp2_nosp": {"tp": 2, "sequence_parallel": False},
    "dp2_ddp": {"dp": 2, "dp_mode": "ddp"},
    "dp2_fsdp": {"dp": 2},
    "cp2": {"cp": 2},
}
# isend/irecv are seen through P2POp (which checks that its op is the real dist.isend / dist.irecv)
COLLECTIVES = ("all_reduce", "broadcast", "send", "recv", "all_gather_into_tensor", "reduce_scatter_tensor")


class Spy:
    def __init__(self) -> None:
        self.collective_devices: set[str] = set()
        self.moved_to: list[str] = []
        self.cpu_calls = 0
        self.counting_cpu = False

    def install(self) -> None:
        for name in COLLECTIVES:
            setattr(dist, name, self._collective(getattr(dist, name)))
        dist.P2POp.__init__ = self._p2p(dist.P2POp.__init__)
        to, cpu, spy = CausalLM.to, torch.Tensor.cpu, self

        def model_to(module, *args, **kwargs):
            spy.moved_to.append(str(torch._C._nn._parse_to(*args, **kwargs)[0]))
            return to(module, *args, **kwargs)

        def tensor_cpu(t, *args, **kwargs):
            spy.cpu_calls += spy.counting_cpu
            return cpu(t, *args, **kwargs)

        CausalLM.to, torch.Tensor.cpu = model_to, tensor_cpu

    def _collective(self, fn):
        @functools.wraps(fn)
        def wrapped(tensor, *args, **kwargs):
            self.collective_devices.add(str(tensor.device))
            return fn(tensor, *args, **kwargs)

        return wrapped

    def _p2p(self, init):
        def wrapped(op_self, op, tensor, *args, **kwargs):
            self.collective_devices.add(str(tensor.device))
            return init(op_self, op, tensor, *args, **kwargs)

        return wrapped


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    spy = Spy()
    spy.install()
    for name, par in LAYOUTS.items():
        spy.collective_devices, spy.moved_to, spy.cpu_calls = set(), [], 0
        layout = check_layout(ParallelConfig(**par), MODEL, dist.get_world_size(), MICRO_BATCHES, SEQ)
        model, mesh = build_model(MODEL, seed=0), build_mesh(layout)
        spy.moved_to = []  # only what Parallel3D does
        engine = Parallel3D(model, mesh, MICRO_BATCHES, OPTIM)
        per = batch(0).shape[0] // layout.dp
        rows = batch(0)[engine.mesh.rank("dp") * per : (engine.mesh.rank("dp") + 1) * per]
        engine.forward_backward(list(rows.chunk(MICRO_BATCHES)))
        spy.counting_cpu = True
        engine.clip_and_step(OPTIM.lr, 1.0, True)
        spy.counting_cpu = False
        params = {str((p.to_local() if hasattr(p, "to_local") else p).device) for _, p in engine.named_parameters()}
        rec = {
            "rank_device": str(rank_device(int(os.environ["LOCAL_RANK"]))),
            "engine_device": str(engine.device),
            "moved_to": spy.moved_to,
            "param_devices": sorted(params),
            "rope_devices": sorted({str(c.inv_freq.device) for c in engine.chunks}),
            "collective_devices": sorted(spy.collective_devices),
            "cpu_calls_in_step": spy.cpu_calls,
        }
        (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
