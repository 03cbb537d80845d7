"""The device mesh: one named dimension per parallelism, pp outermost and tp innermost.

tp is innermost so that tensor-parallel ranks (which talk every layer) are neighbours, i.e. on one
node; pp is outermost (it only sends activations between stages), as Megatron and torchtitan do.
With expert parallelism dp is also viewed as edp x ep (ep innermost, so an ep group is dp-adjacent
ranks): the experts' all-to-all runs over ep, their FSDP2 shards over edp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from baton.train.parallel.layout import Layout3D
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class Mesh3D:
    layout: Layout3D
    mesh: DeviceMesh  # dims DIMS
    data: DeviceMesh  # dp x cp flattened: where gradients are averaged (see build_mesh)
    ep: DeviceMesh | None = None  # ep > 1: the ranks one MoE layer's experts are dealt out over
    edp: DeviceMesh | None = None  # ep > 1: the ranks holding the same experts (their FSDP2 mesh)

    def __getitem__(self, name: str) -> DeviceMesh:
        return self.mesh[name]

    def rank(self, name: str) -> int:
        return self.mesh.get_local_rank(name)

    def group(self, name: str) -> dist.ProcessGroup:
        return self.mesh.get_group(name)

    @property
    def is_last_stage_rank(self) -> bool:
        return self.rank("pp") == self.layout.pp - 1


def build_mesh(layout: Layout3D) -> Mesh3D:
    """Collective over the default process group (which must exist and match the layout)."""
    world = dist.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(f"layout {layout.describe()} needs {layout.world_size} processes, the group has {world}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (layout.pp, layout.dp, layout.cp, layout.tp), mesh_dim_names=DIMS)
    # Context-parallel ranks hold different tokens of the same samples, so their gradients are
    # averaged together with the data-parallel ones: FSDP/DDP run over dp x cp as one dimension.
    out = Mesh3D(layout, mesh, mesh["dp", "cp"]._flatten("dp_cp"))
    if layout.ep > 1:  # the same ranks, dp split row-major: dp rank d is (edp d // ep, ep d % ep)
        experts = init_device_mesh(
            device,
            (layout.pp, layout.dp // layout.ep, layout.ep, layout.cp, layout.tp),
            mesh_dim_names=("pp", "edp", "ep", "cp", "tp"),
        )
        out.ep, out.edp = experts["ep"], experts["edp"]
    return out
