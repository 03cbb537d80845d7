"""Mixture-of-experts feed-forward blocks: routing and the experts' grouped compute.

The decoder layer (common/model.py) builds one of these (`build_moe`) where cfg.is_moe_layer(i), under
the family's checkpoint name (cfg.moe_attribute). Four families, HF's routing and names each:

- Mixtral (`block_sparse_moe`): softmax over all router logits, top-k, renormalised; experts
  `experts.<e>.w1/w3/w2` (gate/up/down).
- Qwen3-MoE (`mlp`): the same routing, renormalised only with norm_topk_prob and the weights rounded
  to the logits' dtype; experts `experts.<e>.gate_proj/up_proj/down_proj`, moe_intermediate_size wide.
- gpt-oss (`mlp`, GptOssMoE): `router` with a bias, top-k of the logits, then softmax over those k;
  the experts are stacked tensors (`experts.gate_up_proj` [E, H, 2I] with gate/up interleaved in the
  columns, biases, `experts.down_proj` [E, I, H]) and a clamped SwiGLU.
- DeepSeek-V3 (`mlp`): common/deepseek_moe.py's DeepSeekMoE, a subclass (sigmoid, group-limited routing
  with a correction bias, shared experts), which the decoder layer builds itself.
- Qwen3-Next and Qwen3.5-MoE (`mlp`, SharedExpertMoE): Qwen3-MoE's routing and experts plus one
  `shared_expert` on every token, its output times sigmoid(`shared_expert_gate`(x)).

The experts run over token-slots sorted by expert, either one matmul chain per expert (`loop`: the
reference, and what expert parallelism's per-expert FSDP units and quantized experts need) or as a
grouped GEMM (torch's F.grouped_mm, which has a CPU kernel too) over stacked weights. gpt-oss's weights
are stacked already, so it runs grouped, with gradients too. Mixtral's and Qwen3-MoE's experts are
separate modules (so expert parallelism, tensor-parallel cuts and recomputation see one module per
expert): `pack_experts(model)`, called once after loading (serving), moves each layer's expert
weights into two stacked tensors that the experts' weights are views of, and from then on inference
(no gradients) runs grouped without copying a weight. Training keeps the loop for them: stacking on
every step would keep a second copy of every expert weight alive until the backward. On CPU, where
torch's grouped kernel is a loop over all groups itself, the grouped path runs only where there are
at least as many token-slots as experts (prefill); decode keeps the loop (cpu_min_slots_per_expert).

Expert parallelism (serve/parallel, train/parallel) narrows `held_experts` and overrides `combine`
from outside; `router_loss` and `always_run_experts` are set from outside too.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.kernels import swiglu
from torch import nn


class Expert(nn.Module):
    """One Mixtral expert; w1/w3/w2 are gate/up/down (the names Mixtral checkpoints use)."""

    names = ("w1", "w3", "w2")  # gate, up, down

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


QWEN_MOE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")  # Qwen3Expert's names, rounded weights


class Qwen3Expert(nn.Module):
    """One Qwen3-MoE expert (HF's per-expert checkpoint names)."""

    names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


# ---------------------------------------------------------------------------- grouped GEMM
def group_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """F.grouped_mm's `offs`: the end row of each group, int32."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


def _aligned(t: torch.Tensor) -> bool:
    """The grouped kernel's layout rule: 16-byte aligned data and strides (but the unit one)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], offs: torch.Tensor | None = None):
    """Rows of `x` [S, K], counts[g] of them for group g in order, times w[g] [K, N]: [S, N].

    One F.grouped_mm call where its layout rules hold, else one matmul per group (same result)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else w.dtype
    x, w = x.to(dtype), w.to(dtype)
    # torch's CUDA kernel takes bf16 only (sm80+); its CPU one fp32, bf16 and fp16.
    kernel = (x.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)) or (
        x.device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )
    if x.shape[0] and kernel and _aligned(x) and _aligned(w):
        if offs is None:
            offs = group_offsets(counts, x.device)
        return F.grouped_mm(x, w, offs=offs)
    # unbind, not w[g]: each w[g]'s backward would fill a whole [G, K, N] gradient (quadratic in G).
    parts = [part @ wg for wg, part in zip(w.unbind(0), x.split(list(counts)))]
    return torch.cat(parts) if parts else x.new_empty((0, w.shape[-1]))


# ---------------------------------------------------------------------------- Mixtral, Qwen3-MoE
class _Packed:
    """MoE.pack's stacked weights, and what must not have changed since for the experts' weights
    to still be views of them: checked on every forward (a few hundred identity and pointer
    compares, tens of microseconds at 128 experts, where walking the modules took a millisecond)."""

    def __init__(self, moe: "MoE", experts: range, gate_up: torch.Tensor, down: torch.Tensor):
        self.experts, self.gate_up, self.down = experts, gate_up, down
        self.modules = list(moe.experts._modules.values())[experts.start : experts.stop]
        self.types = [type(m) for m in self.modules]
        self.linears = [lin for m in self.modules for lin in m._modules.values()]
        self.params = [lin._parameters["weight"] for lin in self.linears]
        self.ptrs = [p.data_ptr() for p in self.params]

    def holds(self, moe: "MoE") -> bool:
        mods = list(moe.experts._modules.values())[self.experts.start : self.experts.stop]
        return (
            all(map(operator.is_, mods, self.modules))
            and all(map(operator.is_, (lin for m in mods for lin in m._modules.values()), self.linears))
            and all(map(operator.is_, (lin._parameters["weight"] for lin in self.linears), self.params))
            and [p.data_ptr() for p in self.params] == self.ptrs
            and all(map(operator.is_, map(type, mods), self.types))  # (no forward swapped in)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in itertools.chain(mods, self.linears))
        )


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral, Qwen3-MoE): softmax over all router logits, top-k,
    renormalised (Qwen3-MoE: if norm_topk_prob).

    Token-slots are sorted by expert (one argsort, one host sync for the group sizes); `run_experts`
    is the grouped compute that the serving side (ExpertParallelMoE) and training's expert
    parallelism (all-to-all dispatch, baton.train.parallel.expert_parallel) share; they override
    `held_experts` / `combine`.

    While gradients are recorded every held expert runs, even on zero token-slots: the empty
    matmuls give its weights zero gradients, so every parameter has a gradient on every rank and
    DDP's reducer and FSDP2's reduce-scatters see the same parameters everywhere (skipping it
    crashed both as soon as a rank routed no token to some expert). Without gradients (serving,
    eval) empty experts are skipped: they would only cost kernel launches; after `pack` the
    experts run as two grouped GEMMs instead.
    """

    # Set from outside (baton.train.moe) to add auxiliary router losses: called with (module,
    # output, router logits, chosen experts), returns the output (which may carry their gradients).
    router_loss = None
    # True where the experts are sharded units that every rank must run (FSDP2-wrapped experts).
    always_run_experts = False
    # False: always the per-expert loop (the reference; benchmarks/moe_grouped.py compares them).
    grouped = True
    # On CPU the grouped GEMM runs only where there are at least this many token-slots per held
    # expert: torch's CPU kernel visits every group, empty ones too, and at decode (8 of 128 experts
    # hit) costs more than the loop over the experts that got tokens (docs/benchmarks.md). CUDA's
    # kernel is one launch for all groups: always grouped there.
    cpu_min_slots_per_expert = 1.0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        qwen = cfg.model_type in QWEN_MOE_FAMILIES
        self.round_weights = qwen  # HF's Qwen MoEs round them to the logits' dtype
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        expert = Qwen3Expert if qwen else Expert
        self.experts = nn.ModuleList(
            expert(cfg.hidden_size, cfg.expert_intermediate_size) for _ in range(cfg.num_local_experts)
        )

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def held_experts(self) -> range:
        """The experts this module runs: all of them (expert parallelism, applied from outside,
        narrows it to a rank's share and sums the shares)."""
        return range(len(self.experts))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], chosen experts [T, k]) from the router logits [T, E]."""
        probs = F.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(logits.dtype)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router_logits(x)
        weights, chosen = self.route(logits)
        out = self.combine(x, weights, chosen)
        if self.router_loss is not None:
            out = self.router_loss(self, out, logits, chosen)
        return out.reshape(shape)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """sum_k weight_k * expert_k(x) per token, over the held experts' token-slots."""
        out = torch.zeros_like(x)
        # Token-slots grouped by expert (stable: in token order within one, as torch.where gave them),
        # and one host sync for the group sizes instead of one per expert.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        held = self.held_experts()
        first, last = sum(counts[: held.start]), sum(counts[: held.stop])  # held experts' slots
        slots = order[first:last]
        token_idx = slots // self.top_k
        y = self.run_experts(x[token_idx], counts[held.start : held.stop], held)
        # One index_add in expert order: per token the same additions, in the same order, as
        # adding expert by expert (HF's loop), so logits stay bit-identical on CPU.
        out.index_add_(0, token_idx, (y * weights.flatten()[slots, None]).to(x.dtype))
        return out

    def run_experts(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        """Grouped expert compute: `xs` holds counts[i] rows for experts[i], one after another;
        returns each row through its expert, in the same order."""
        if self.grouped and not self.always_run_experts and not torch.is_grad_enabled() and self.fills(xs, counts):
            packed = self.packed_weights(experts)
            if packed is not None:
                return self.run_grouped(xs, counts, *packed)
        return self.run_loop(xs, counts, experts)

    def fills(self, xs: torch.Tensor, counts: list[int]) -> bool:
        """Enough token-slots for the grouped GEMM to pay (see cpu_min_slots_per_expert)."""
        return xs.device.type != "cpu" or xs.shape[0] >= self.cpu_min_slots_per_expert * len(counts)

    def run_loop(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        """The reference: one matmul chain per expert."""
        run_empty = self.always_run_experts or torch.is_grad_enabled()
        ys = [
            self.experts[e](part) if part.shape[0] or run_empty else part for e, part in zip(experts, xs.split(counts))
        ]
        return torch.cat(ys) if ys else xs

    def run_grouped(self, xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor):
        """Two grouped GEMMs: gate_up [n, 2I, H] (gate rows, then up rows), down [n, H, I]."""
        offs = group_offsets(counts, xs.device)
        h = grouped_mm(xs, gate_up.transpose(1, 2), counts, offs)
        inter = gate_up.shape[1] // 2
        return grouped_mm(swiglu(h[:, :inter], h[:, inter:]), down.transpose(1, 2), counts, offs)

    # -------------------------------------------------------------------- packed expert weights
    def _projections(self, experts: range) -> list[tuple[nn.Module, ...]] | None:
        """Each expert's (gate, up, down) linears, or None where one is not a plain nn.Linear
        without hooks (a placeholder, a quantized linear, a hooked one)."""
        out = []
        for e in experts:
            expert = self.experts[e]
            names = getattr(expert, "names", None)
            if names is None:
                return None
            mods = tuple(getattr(expert, n) for n in names)
            if any(type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks for m in mods):
                return None
            out.append(mods)
        return out

    def packed_weights(self, experts: range) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up, down) for `experts` when `pack` made the experts' weights views of them and
        they still are (a load with assign=True, sharding or quantizing leaves them apart, or hooks
        a linear: then the loop runs)."""
        packed: _Packed | None = self.__dict__.get("_packed")
        if packed is None or packed.experts != experts or torch.compiler.is_compiling():
            return None
        return (packed.gate_up, packed.down) if packed.holds(self) else None

    @torch.no_grad()
    def pack(self) -> bool:
        """Move the held experts' weights into two stacked tensors and make each expert's weights
        views of them (names, parameters and state dict unchanged; the old storage is freed), so
        inference runs grouped without a copy. False where they cannot be (quantized, placeholders,
        meta, sharded, mixed shapes). Not for training: FSDP2 and ZeRO-3 own their parameters'
        storage, and training keeps the loop anyway."""
        experts = self.held_experts()
        mods = self._projections(experts)
        if not mods:
            return False
        weights = [m.weight for trio in mods for m in trio]
        first = weights[0]
        if first.is_meta or any(
            type(w.data) is not torch.Tensor or w.dtype != first.dtype or w.device != first.device for w in weights
        ):
            return False
        (inter, hidden), shape_down = mods[0][0].weight.shape, mods[0][2].weight.shape
        if any(tuple(m.weight.shape for m in t) != ((inter, hidden),) * 2 + (shape_down,) for t in mods):
            return False
        gate_up = first.new_empty((len(mods), 2 * inter, hidden))
        down = first.new_empty((len(mods), *shape_down))
        for j, (g, u, d) in enumerate(mods):
            gate_up[j, :inter], gate_up[j, inter:], down[j] = g.weight, u.weight, d.weight
            g.weight.data, u.weight.data, d.weight.data = gate_up[j, :inter], gate_up[j, inter:], down[j]
        self.__dict__["_packed"] = _Packed(self, experts, gate_up, down)
        return True

    def _apply(self, fn, recurse=True):
        """.to(), .cuda(), .half(): a packed block is packed again where the conversion gave its
        weights new storage (the old packed storage is not kept)."""
        packed = self.__dict__.pop("_packed", None)
        out = super()._apply(fn, recurse)
        if packed is not None:
            self.__dict__["_packed"], experts = packed, packed.experts
            del packed  # (the old storage goes with the entry, before packing again)
            if self.packed_weights(experts) is None:
                del self.__dict__["_packed"]
                self.pack()
        return out


# ---------------------------------------------------------------------------- gpt-oss
class GptOssExperts(nn.Module):
    """gpt-oss's experts as stacked tensors (its checkpoint's names and layouts): gate_up_proj
    [E, H, 2I] (x @ W: gate in the even columns, up in the odd), down_proj [E, I, H], a bias each."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.reset_parameters(cfg.initializer_range)

    @torch.no_grad()
    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) weights, zero biases (init_weights' rule for linears)."""
        if self.gate_up_proj.is_meta:
            return
        for w in (self.gate_up_proj, self.down_proj):
            w.copy_(torch.empty(w.shape).normal_(0.0, std, generator=generator))
        self.gate_up_proj_bias.zero_()
        self.down_proj_bias.zero_()

    def __len__(self) -> int:
        return self.gate_up_proj.shape[0]

    def __setitem__(self, e, value) -> None:
        raise TypeError("gpt-oss's experts are stacked tensors, not modules: they cannot be dealt out one by one")

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU: (up + 1) * g * sigmoid(alpha * g), g <= limit, |up| <= limit (HF's order)."""
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x: the reference (HF's per-expert loop body)."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        return self.activation(gate_up) @ self.down_proj[e] + self.down_proj_bias[e]

    def grouped(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        """Experts `experts` on their counts[i] rows each, as two grouped GEMMs."""
        part = slice(experts.start, experts.stop)
        offs = group_offsets(counts, xs.device)
        ids = torch.repeat_interleave(torch.tensor(counts, device=xs.device))  # each row's expert (held index)
        gate_up = grouped_mm(xs, self.gate_up_proj[part], counts, offs) + self.gate_up_proj_bias[part][ids]
        return grouped_mm(self.activation(gate_up), self.down_proj[part], counts, offs) + self.down_proj_bias[part][ids]


class GptOssMoE(MoE):
    """gpt-oss's block: `router` (with a bias), top-k of its logits, softmax over those k (in the
    logits' dtype, as HF does); GptOssExperts, grouped with gradients too (its weights are stacked
    already: nothing is copied)."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), chosen

    def run_experts(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        if self.grouped and (torch.is_grad_enabled() or self.fills(xs, counts)):
            return self.experts.grouped(xs, counts, experts)
        return self.run_loop(xs, counts, experts)

    def run_loop(self, xs: torch.Tensor, counts: list[int], experts: range) -> torch.Tensor:
        # Empty experts are skipped with gradients too: indexing the stacked weights gives every
        # expert a (zero) gradient anyway. The reference only: with gradients every expert's slice
        # backward fills a whole stacked gradient (50x the grouped path's time at 128 experts).
        ys = [self.experts.expert(e, part) if part.shape[0] else part for e, part in zip(experts, xs.split(counts))]
        return torch.cat(ys) if ys else xs

    def pack(self) -> bool:
        return True  # stacked already


# ---------------------------------------------------------------------------- Qwen3-Next, Qwen3.5-MoE
class SharedExpertMoE(MoE):
    """The routed experts (Qwen3-MoE's routing, always renormalised in Qwen3.5-MoE) plus a shared
    expert every token goes through, scaled per token by sigmoid(shared_expert_gate(x)) (HF's
    Qwen3NextSparseMoeBlock). Expert parallelism and packing see the routed part only (`combine`,
    `run_experts`); the shared expert is a dense MLP beside them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.shared_expert = Qwen3Expert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def build_moe(cfg: ModelConfig) -> nn.Module:
    """The routed-experts block of cfg's family (forward: [..., H] -> [..., H])."""
    if cfg.model_type == "deepseek_v3":  # (it subclasses MoE: importing it here would close a circle)
        raise ValueError("DeepSeek-V3's block is baton.common.deepseek_moe.DeepSeekMoE(cfg); build_moe has none")
    if cfg.shared_expert_intermediate_size:
        return SharedExpertMoE(cfg)
    return GptOssMoE(cfg) if cfg.model_type == "gpt_oss" else MoE(cfg)


def pack_experts(model: nn.Module) -> int:
    """MoE.pack on every MoE layer of `model` (serving: after loading, sharding and quantizing);
    returns how many layers run grouped now."""
    return sum(m.pack() for m in model.modules() if isinstance(m, MoE))
