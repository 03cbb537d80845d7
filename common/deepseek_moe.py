"""DeepSeekMoE (DeepSeek-V3's feed-forward block): shared experts plus fine-grained routed experts.

Routing, exactly as transformers' DeepseekV3TopkRouter (and vLLM's grouped_topk with noaux_tc):

    s = sigmoid(x @ W_gate^T)                       affinities, float32 (E routed experts)
    c = s + b                                       b = e_score_correction_bias: steers the CHOICE only
    groups: c viewed [n_group, E / n_group]; a group's score is the sum of its two best c; the
            token keeps its topk_group best groups (the others' experts are masked out)
    chosen = top-k of the kept c;  weight_k = s[chosen_k] (unbiased), / their sum if norm_topk_prob
            (+1e-20), times routed_scaling_factor
    out = sum_k weight_k * expert_k(x) + shared_experts(x)

The routed experts are Qwen3-MoE-style modules (`experts.<e>.gate_proj/up_proj/down_proj`), so the
base class's sorted dispatch, `pack` (grouped GEMM for inference), the training loop and expert
parallelism's `held_experts`/`combine` apply unchanged. Checkpoint names (HF's on-disk names, which
real DeepSeek-V3 checkpoints and transformers' save_pretrained both write; transformers stacks the
experts only in memory, `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]):

    mlp.gate.weight [E, H]    mlp.gate.e_score_correction_bias [E] (float32)
    mlp.experts.<e>.{gate,up,down}_proj.weight    mlp.shared_experts.{gate,up,down}_proj.weight

Dtypes: the correction bias stays float32 whatever the model's dtype (HF's
_keep_in_fp32_modules_strict, vLLM's float32 parameter): balancing moves it by ~1e-3 per step, below
bfloat16's resolution at any |b| >= 0.25, and a rounded bias can flip a near-tie choice. The gate
weight follows the model's dtype like every other linear (so FSDP2, ZeRO and the quantizers, which
skip MoE routers, see one dtype), and scores are computed in float32 from it: for any checkpoint
stored in bfloat16, as DeepSeek's are, that equals HF's float32 gate exactly.

Training (DeepSeek-V3 paper, sec. 2.1.2, "auxiliary-loss-free load balancing"): each forward with
gradients records the token-slots per expert (`expert_load`); `update_bias(rate)`, once per optimizer
step, applies b_i <- b_i + rate * sign(mean_j load_j - load_i) outside the gradient (overloaded
experts become less likely to be chosen; their weights, taken from s, are unaffected). The optional
sequence-wise balance loss (eq. 17-20) is `sequence_balance_loss`, added through the `seq_loss` hook.
The base class's `router_loss` hook (Switch's softmax load balancing and the z-loss, baton.train.moe)
is refused: a softmax over the logits describes neither the sigmoid affinities nor the biased choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton.common.config import ModelConfig
from baton.common.moe import MoE, Qwen3Expert
from torch import nn


class DeepSeekRouter(nn.Linear):
    """`gate`: the router's weight [E, H] and the score-correction bias [E] (a persistent buffer:
    in the checkpoint, outside the gradient). An nn.Linear so init_weights initialises it as HF does
    (normal weight, zero bias); its output is float32 logits."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def _apply(self, fn, recurse=True):
        """.to(dtype), .half(), .bfloat16(): the bias keeps float32 (and its values: it is moved, not
        rounded); moves between devices and to_empty apply to it as to any buffer."""
        bias = self._buffers["e_score_correction_bias"]

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if t is bias and out.dtype != torch.float32:
                out = (t if t.dtype == torch.float32 else out).to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep_fp32, recurse)


class DeepSeekMoE(MoE):
    """DeepSeek-V3's MoE block (HF DeepseekV3MoE); see the module docstring for routing and names."""

    # Set from outside (training) for DeepSeek-V3's sequence-wise balance loss: called with (module,
    # routed output, sequence_balance_loss of this forward: a float32 scalar with gradient to the
    # router) and returns the output, carrying alpha x loss's gradient (baton.train.moe's
    # AuxLossAutoScaler). Only computed while gradients are recorded.
    seq_loss = None

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.routed_scaling_factor = cfg.routed_scaling_factor
        h, inter = cfg.hidden_size, cfg.expert_intermediate_size
        self.gate = DeepSeekRouter(h, cfg.num_local_experts)
        self.experts = nn.ModuleList(Qwen3Expert(h, inter) for _ in range(cfg.num_local_experts))
        # HF builds a zero-width MLP when n_shared_experts is 0 (its output is zero): none here.
        self.shared_experts = Qwen3Expert(h, inter * cfg.n_shared_experts) if cfg.n_shared_experts else None
        # Token-slots per expert (int64 [E], this process's tokens) since the last update_bias; None
        # before the first forward with gradients. A plain attribute, not a buffer: DDP broadcasts
        # buffers from rank 0 at every forward, which would replace each rank's count with rank 0's.
        self.expert_load: torch.Tensor | None = None

    @property
    def router_loss(self):
        return None

    @router_loss.setter
    def router_loss(self, hook) -> None:
        if hook is not None:
            raise TypeError(
                "DeepSeekMoE does not take the Switch load-balancing / router z-loss hook (router_loss): those "
                "losses are a softmax over the router logits, and DeepSeek-V3 routes by sigmoid affinities "
                "and a bias-corrected choice. Balance it with update_bias (auxiliary-loss-free) and, "
                "optionally, the sequence-wise loss through the seq_loss hook"
            )

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, chosen experts [T, k]) from the float32 router logits [T, E]."""
        scores = logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        if self.topk_group < self.n_group:  # (all groups kept: HF's mask is all ones, a no-op)
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
        chosen = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (or [T, H]: one sequence) -> same shape."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router_logits(flat)
        weights, chosen = self.route(logits)
        out = self.combine(flat, weights, chosen)
        if torch.is_grad_enabled():  # training: balancing statistics (eval and serving: none)
            self.record_load(chosen)
            if self.seq_loss is not None:
                sequences = shape[0] if len(shape) == 3 else 1
                out = self.seq_loss(self, out, self.sequence_balance_loss(logits, chosen, sequences))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)

    # -------------------------------------------------------------------- balancing (training)
    @torch.no_grad()
    def record_load(self, chosen: torch.Tensor) -> None:
        """Add this forward's token-slots per expert to `expert_load` (on the device: no host sync).
        Under activation recomputation a layer may count its tokens twice; every expert's count
        doubles alike, and update_bias's sign(mean - load) does not change under a common factor."""
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        self.expert_load = counts if self.expert_load is None else self.expert_load + counts

    @torch.no_grad()
    def update_bias(self, rate: float, load: torch.Tensor | None = None) -> torch.Tensor | None:
        """DeepSeek-V3's auxiliary-loss-free balancing step: b_i += rate * sign(mean_j load_j - load_i)
        (the paper's bias update speed gamma = rate; an expert at the mean is left alone). `load`:
        the token-slots per expert to balance (pass the sum over data-parallel ranks, so every rank
        moves its copy of the bias alike); by default `expert_load`. Resets `expert_load`; returns the
        float32 load used, or None when there was none (no forward with gradients since the last call)."""
        if load is None:
            load = self.expert_load
        self.expert_load = None
        if load is None:
            return None
        bias = self.gate.e_score_correction_bias
        load = load.to(device=bias.device, dtype=torch.float32)
        bias.add_(torch.sign(load.mean() - load), alpha=rate)
        return load

    def sequence_balance_loss(self, logits: torch.Tensor, chosen: torch.Tensor, sequences: int) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20) without its alpha, the
        mean over `sequences` equal rows of T tokens each (logits [sequences * T, E], chosen [., k]):

            f_i = E / (k T) * #{t : i in chosen_t}       (no gradient)
            P_i = 1/T sum_t s'_i,t,   s'_i,t = s_i,t / sum_j s_j,t    (s: sigmoid affinities)
            L   = sum_i f_i P_i       (1 when every expert gets its share of every sequence)
        """
        e = logits.shape[-1]
        scores = logits.float().sigmoid()
        scores = (scores / scores.sum(dim=-1, keepdim=True)).view(sequences, -1, e)  # s'
        t = scores.shape[1]
        rows = torch.arange(sequences, device=chosen.device).repeat_interleave(t * self.top_k)
        counts = torch.zeros(sequences, e, device=chosen.device, dtype=torch.float32)
        counts.index_put_((rows, chosen.flatten()), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
        f = counts * (e / (self.top_k * t))
        return (f * scores.mean(dim=1)).sum(dim=-1).mean()
