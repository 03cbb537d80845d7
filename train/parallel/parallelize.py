"""parallelize(): one CausalLM laid out over a dp x pp x cp x tp mesh, and its training step.

The order is Megatron's and torchtitan's: cut into pipeline stages, tensor + sequence parallelism
inside each stage, expert parallelism (MoE experts dealt out over ep of the dp ranks), context
parallelism as the attention core, activation recomputation, then data parallelism (FSDP2 or DDP)
over dp x cp (the held experts first, over their expert-data-parallel group). The model definition
is never touched: parallelism is module plans, an attention backend and wrappers applied from outside.

The step runs a data-parallel rank's micro-batches: through the pipeline schedule when pp > 1
(the micro-batches are the pipeline's), else one after another with gradient sync on the last.
Every rank of a model replica returns the same loss: the mean over its micro-batches and tokens.

Mixed precision (bf16) is torchtitan's: under FSDP2 its MixedPrecisionPolicy (layers gathered and
run in bf16, gradients reduce-scattered in float32); without FSDP (one replica, DDP, or TP/PP alone)
torch.autocast around every forward. Either way the parameters the optimizer steps - DTensor shards
or whole tensors - and its state are float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from baton.common.model import AttentionBackend, CausalLM, DenseCausalAttention
from baton.train.backends.base import COMPUTE_DTYPES, autocast, param_groups
from baton.train.compile import compile_layers
from baton.train.config import OptimConfig, RecomputeConfig
from baton.train.distributed import rank_device
from baton.train.moe import set_loss_divisor
from baton.train.parallel.context_parallel import RingAttention, zigzag_indices, zigzag_shard
from baton.train.parallel.data_parallel import apply_ddp, apply_fsdp
from baton.train.parallel.expert_parallel import apply_ep, is_expert_parameter, shard_experts
from baton.train.parallel.mesh import Mesh3D
from baton.train.parallel.pipeline import build_chunks, build_schedule
from baton.train.parallel.tensor_parallel import apply_tp
from baton.train.recompute import SelectiveRecompute, apply_recompute
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def _with_core(attn: AttentionBackend, core: AttentionBackend | None) -> AttentionBackend:
    """`attn` with its attention core replaced by `core` (keeping selective recomputation)."""
    if core is None:
        return attn
    return SelectiveRecompute(core) if isinstance(attn, SelectiveRecompute) else core


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


class Parallel3D:
    """A model replica's local part (this rank's stages and shards), its optimizer, and the step."""

    def __init__(
        self,
        model: CausalLM,
        mesh: Mesh3D,
        microbatches: int,
        optim: OptimConfig,
        attn: AttentionBackend | None = None,
        recompute: RecomputeConfig | None = None,
        precision: str = "fp32",
        compile: str | None = None,
        materialize: Callable[[list[torch.nn.Module], torch.device], None] | None = None,
    ):
        """`attn`: the attention backend the caller set up (e.g. by apply_recompute); or pass
        `recompute` to have it applied here, after tensor parallelism. `precision`: fp32 or bf16
        (fp16 would need a loss scaler over DTensor shards: refused by the recipe check). `compile`: a
        torch.compile backend ("inductor") to compile every decoder layer's forward with, after
        recomputation and before FSDP2/DDP (torchtitan's order); None: eager.
        `materialize(chunks, device)`: for a meta-built model (init_from), allocates and fills this
        rank's shards once tensor parallelism and FSDP2 have laid them out (before DDP and the optimizer)."""
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"Parallel3D runs fp32 or bf16, not {precision!r}")
        lay = self.layout = mesh.layout
        self.mesh, self.microbatches, self.config = mesh, microbatches, model.config
        self.device = rank_device(torch.cuda.current_device() if torch.cuda.is_available() else 0)
        if not any(p.is_meta for p in model.parameters()):  # (a meta-device model is materialised on it later)
            model.to(self.device)  # every layout, not only those whose TP/FSDP wrappers move it
        self.stage_ids, self.chunks = build_chunks(model, mesh.rank("pp"), lay.pp, lay.stages_per_rank, self.device)
        if lay.tp > 1:
            for chunk in self.chunks:
                apply_tp(chunk, mesh["tp"], lay.sequence_parallel, lay.loss_parallel)
        if lay.ep > 1:
            for chunk in self.chunks:
                apply_ep(chunk, mesh.ep)
        if recompute is not None:
            attn = apply_recompute(model, recompute)
        attn = _with_core(attn or DenseCausalAttention(), RingAttention(mesh.group("cp")) if lay.cp > 1 else None)
        for chunk in self.chunks:
            chunk.attn = attn
            if compile is not None:
                compile_layers(chunk, compile)
        self.data_parallel = lay.dp * lay.cp > 1
        fsdp = self.data_parallel and lay.dp_mode == "fsdp"
        compute = COMPUTE_DTYPES[precision]
        # FSDP2 casts the parameters itself; everything else runs under autocast.
        self.autocast_precision = "fp32" if fsdp else precision
        # What flows between pipeline stages: the compute dtype under FSDP2; under autocast the
        # residual stream stays float32 (embedding and norms are float32, matmul outputs are added to it).
        self.activation_dtype = compute if fsdp else torch.float32
        self.runners: list[torch.nn.Module] = list(self.chunks)  # what runs forward (the DDP wrappers)
        if lay.ep > 1:  # ep > 1 implies FSDP2 over dp >= ep (check_layout)
            for chunk in self.chunks:
                shard_experts(chunk, mesh.edp, lay.dp, compute if compute != torch.float32 else None, lay.pp == 1)
        if fsdp:
            self.runners = apply_fsdp(self.chunks, mesh.data, lay.pp > 1, compute if compute != torch.float32 else None)
        if materialize is not None:
            materialize(list(self.chunks), self.device)
        if self.data_parallel and not fsdp:
            self.runners = apply_ddp(self.chunks, mesh.data)
        self.optimizers = []
        for chunk in self.chunks:  # one per chunk, as torchtitan: state dicts map parameters by chunk
            groups, _ = param_groups(chunk, optim.weight_decay)
            self.optimizers.append(
                torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
            )
        self.schedule = None
        if lay.pp > 1:
            self.schedule = build_schedule(
                lay.pp_schedule,
                self.runners,
                self.stage_ids,
                lay.num_stages,
                microbatches,
                self._loss,
                mesh.group("pp"),
                self.device,
            )
            for chunk in self.chunks:  # the schedule scales gradients, not losses, by 1/micro-batches
                set_loss_divisor(chunk, 1)

    # ------------------------------------------------------------------------------ helpers
    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.layout.loss_parallel else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.autocast_precision)

    @staticmethod
    def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in float32 (vocab-parallel under loss_parallel)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    def _inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S+1] token blocks -> this rank's (ids, labels), zigzag-sharded under cp; sets the
        RoPE positions of those tokens on every chunk."""
        ids, labels = batch[:, :-1].to(self.device), batch[:, 1:].to(self.device)
        cp, seq = self.layout.cp, ids.shape[1]
        positions = zigzag_indices(seq, cp, self.mesh.rank("cp")) if cp > 1 else torch.arange(seq)
        for chunk in self.chunks:
            chunk.positions = positions.to(self.device)
        if cp > 1:
            ids, labels = zigzag_shard(ids, cp, self.mesh.rank("cp")), zigzag_shard(labels, cp, self.mesh.rank("cp"))
        return ids, labels

    def _replica_mean(self, loss: torch.Tensor, loss_on_this_rank: bool) -> torch.Tensor:
        """The loss from the last pipeline stage, averaged over the cp ranks' tokens."""
        if self.layout.pp > 1:
            if not loss_on_this_rank:
                loss = torch.zeros((), device=self.device)
            dist.broadcast(loss, group=self.mesh.group("pp"), group_src=self.layout.pp - 1)
        if self.layout.cp > 1:
            dist.all_reduce(loss, group=self.mesh.group("cp"))
            loss = loss / self.layout.cp
        return loss

    # --------------------------------------------------------------------------------- step
    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward + backward of this rank's micro-batches ([B, S+1] each); gradients are those
        of the mean loss over all of them (and over dp x cp once synchronised)."""
        if len(micro_batches) != self.microbatches:
            raise ValueError(f"built for {self.microbatches} micro-batches per step, got {len(micro_batches)}")
        ids, labels = zip(*map(self._inputs, micro_batches))
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (torch.cat(ids),) if 0 in self.stage_ids else ()
            with self._loss_context(), self._autocast():
                self.schedule.step(*args, target=torch.cat(labels), losses=losses)
            mine = bool(losses)
            loss = torch.stack([_value(x) for x in losses]).mean() if mine else None
            return self._replica_mean(loss, mine)
        total = torch.zeros((), device=self.device)
        runner = self.runners[0]
        for i, (x, y) in enumerate(zip(ids, labels)):
            last = i == len(ids) - 1
            if self.data_parallel and self.layout.dp_mode == "fsdp":
                runner.set_requires_gradient_sync(last)
            sync = (
                contextlib.nullcontext()
                if last or not self.data_parallel or self.layout.dp_mode == "fsdp"
                else runner.no_sync()
            )
            with sync, self._loss_context():
                with self._autocast():
                    loss = self._loss(runner(x), y)
                (loss / len(ids)).backward()
            total += _value(loss)
        return self._replica_mean(total / len(ids), True)

    def _settle_grads(self) -> None:
        """Give every DTensor gradient its parameter's placements. Sequence-parallel norm weights
        get Partial(sum) gradients (reduced lazily) and the vocab-parallel embedding a replicated
        one; reducing/slicing them here makes the norm and the optimizer see the real gradient."""
        for _, p in self.named_parameters():
            g = p.grad
            if isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients: each shard counted once, summed over the mesh
        dimensions it is sharded on and over the pipeline stages."""
        self._settle_grads()
        partial: dict[Any, torch.Tensor] = {}
        for name, p in self.named_parameters():
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                assert not any(pl.is_partial() for pl in g.placements), f"unreduced gradient {g.placements}"
                key = (g.device_mesh, tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate()))
                local = g.to_local()
            else:
                key, local = None, g
            # Expert parallelism: each ep rank holds other experts, so theirs add up over ep too.
            key = (key, self.layout.ep > 1 and is_expert_parameter(name))
            # Summed on the rank's device: NCCL reduces only CUDA tensors.
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            partial[key] = partial.get(key, zero) + local.double().pow(2).sum()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for (key, over_ep), sq in partial.items():
            if key is not None:
                mesh, dims = key
                for d in dims:
                    dist.all_reduce(sq, group=mesh.get_group(d))
            if over_ep:
                dist.all_reduce(sq, group=self.mesh.ep.get_group())
            total += sq
        if self.layout.pp > 1:
            dist.all_reduce(total, group=self.mesh.group("pp"))
        return math.sqrt(total.item())

    def clip_and_step(self, lr: float, max_norm: float, loss_finite: bool) -> tuple[bool, float]:
        """Clip (as torch.nn.utils.clip_grad_norm_), step unless anything is non-finite, zero
        the gradients. Returns (applied, norm before clipping)."""
        norm = self.grad_norm()
        applied = loss_finite and math.isfinite(norm)
        if applied:
            coef = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
            with torch.no_grad():
                for _, p in self.named_parameters():
                    if p.grad is not None and coef < 1.0:
                        p.grad.mul_(coef)
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return applied, norm

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss of one batch, forward only (the pipeline is walked stage by stage)."""
        for r in self.runners:
            r.eval()
        try:
            ids, labels = self._inputs(batch)
            with self._loss_context(), self._autocast():
                if self.schedule is None:
                    return self._replica_mean(_value(self._loss(self.runners[0](ids), labels)), True).item()
                logits = self._pipeline_forward(ids)
                loss = _value(self._loss(logits, labels)) if logits is not None else None
                return self._replica_mean(loss, logits is not None).item()
        finally:
            for r in self.runners:
                r.train()

    def _pipeline_forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Forward through every stage with plain p2p; the logits on the last stage's rank."""
        lay, pp_rank, group = self.layout, self.mesh.rank("pp"), self.mesh.group("pp")
        seq = ids.shape[1] // (lay.tp if lay.sequence_parallel else 1)
        x = None
        for s in range(lay.num_stages):
            if s % lay.pp != pp_rank:
                continue
            if s > 0:
                x = torch.empty(
                    ids.shape[0],
                    seq,
                    self.config.hidden_size,
                    device=self.device,
                    dtype=self.activation_dtype,
                )
                dist.recv(x, group=group, group_src=(s - 1) % lay.pp)
            x = self.runners[self.stage_ids.index(s)](ids if s == 0 else x)
            if s < lay.num_stages - 1:
                dist.send(x.contiguous(), group=group, group_dst=(s + 1) % lay.pp)
        return x if lay.num_stages - 1 in self.stage_ids else None

    # ------------------------------------------------------------------------------ reports
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: whole copies of this rank's parameters (tests and debugging)."""
        return {n: _value(p).clone() for n, p in self.named_parameters()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Collective: whole copies of this rank's gradients (before clipping, if called before
        clip_and_step)."""
        return {n: _value(p.grad).clone() for n, p in self.named_parameters() if p.grad is not None}

    def memory(self) -> dict[str, Any]:
        """Bytes of model state held by this rank (its stages, its shards)."""

        def local(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = sum(local(p) for _, p in self.named_parameters())
        optim = sum(
            local(t) for opt in self.optimizers for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
        )
        return {"accelerator": {"params": params, "grads": params, "optimizer": optim}, "host": {}, "nvme": {}}
