"""megatron-core as a training backend: Baton's architecture as megatron's GPTModel, trained with
megatron's own tensor/pipeline/data parallelism, schedules, DDP and (distributed) optimizer.

The layout comes from the recipe's `parallel` section, as for torch3d: tp x pp x dp, virtual
pipeline stages (pp_stages_per_rank, with pp_schedule interleaved_1f1b), sequence parallelism;
the `megatron` section holds megatron's own options, recomputation and the distributed optimizer
(baton.train.config.MegatronConfig). `MegatronLayout` is the two resolved.
The model starts from the trainer's Baton model: its weights are laid out into each rank's
GPTModel chunks by baton.common.megatron_layout, and the handoff is made from the same layout's
inverse, so the server loads a Megatron run like any other. Checkpoints are megatron's own
dist_checkpointing (fully reshardable: resumed at any tp/pp/dp) - baton.train.backends.megatron_ckpt.

Without CUDA (tests, CI) megatron_compat makes megatron-core 0.16.1 run on the CPU over gloo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from baton.common.config import ConfigError, ModelConfig
from baton.common.megatron_layout import baton_to_megatron
from baton.common.model import AttentionBackend, CausalLM
from baton.train.backends.base import Layout, StepResult
from baton.train.config import RECOMPUTE_MODES, RecomputeConfig, TrainConfig
from baton.train.distributed import Dist, init_distributed, read_launch
from baton.train.parallel.layout import check_stages_per_rank

MAKE_VOCAB_DIVISIBLE_BY = 1  # no padding beyond Baton's own vocabulary (it would change the softmax)
SCHEDULES = ("1f1b", "interleaved_1f1b")  # megatron's pipeline schedules (gpipe is torch3d's only)


@dataclass(frozen=True)
class MegatronLayout:
    """What the backend runs with: the parallel section's layout (vp: its pp_stages_per_rank;
    sequence parallelism only where tp > 1, as torch3d) and the megatron section's options."""

    tp: int = 1
    pp: int = 1
    vp: int = 1  # virtual pipeline stages per pipeline rank (> 1: the interleaved 1F1B schedule)
    sequence_parallel: bool = False
    recompute: str = "none"
    distributed_optimizer: bool = False

    @classmethod
    def of(cls, cfg: TrainConfig) -> MegatronLayout:
        p, m = cfg.parallel, cfg.megatron
        sp = p.sequence_parallel and p.tp > 1
        return cls(p.tp, p.pp, p.pp_stages_per_rank, sp, m.recompute, m.distributed_optimizer)


def spec_kind() -> str:
    """ "te" (TransformerEngine layers) where TransformerEngine is installed, else "local"."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "local"
    return "te"


def transformer_config(mc: ModelConfig, m: MegatronLayout, precision: str):
    """megatron's TransformerConfig for Baton's architecture: RMSNorm, SwiGLU as a gated linear
    unit, GQA through query groups, q/k/v biases only where the model has them, Qwen3's per-head
    q/k RMSNorms as qk_layernorm, no dropout."""
    from megatron.core.transformer import TransformerConfig

    recompute: dict[str, Any] = {}
    if m.recompute == "selective":
        recompute = {"recompute_granularity": "selective"}  # the attention core (megatron's default module)
    elif m.recompute == "full":
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return TransformerConfig(
        num_layers=mc.num_hidden_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.intermediate_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=mc.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=mc.qkv_bias,
        qk_layernorm=mc.qk_norm == "head",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=mc.initializer_range,
        tensor_model_parallel_size=m.tp,
        pipeline_model_parallel_size=m.pp,
        virtual_pipeline_model_parallel_size=m.vp if m.vp > 1 else None,
        sequence_parallel=m.sequence_parallel,
        # Interleaved stages with batched p2p swap the peers' tensors on gloo and CPU: wrong
        # gradients, no error (tests/train/test_megatron.py keeps this honest).
        batch_p2p_comm=m.vp == 1,
        bf16=precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        **recompute,
    )


def build_chunks(mc: ModelConfig, tcfg, m: MegatronLayout) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage), on this rank's device."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    qk = mc.qk_norm == "head"
    if spec_kind() == "te":
        layer = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
    else:
        layer = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)
    chunks = []
    for v in range(m.vp):
        chunk = GPTModel(
            tcfg,
            layer,
            vocab_size=mc.vocab_size,
            max_sequence_length=mc.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            share_embeddings_and_output_weights=mc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=mc.rope_theta,
            vp_stage=v,
        )
        chunks.append(chunk.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu"))
    return chunks


def load_baton_weights(chunks: list, state_dict: dict[str, torch.Tensor], mc: ModelConfig, m: MegatronLayout) -> None:
    """Fill this rank's chunks from whole Baton weights (megatron_layout); only the modules'
    `_extra_state` entries may be left out."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    for v, chunk in enumerate(chunks):
        shard = baton_to_megatron(
            state_dict, mc, m.tp, tp_rank, m.pp, pp_rank, m.vp, MAKE_VOCAB_DIVISIBLE_BY, v, spec_kind()
        )
        missing, unexpected = chunk.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"megatron chunk {v}: missing {missing}, unexpected {unexpected}")


def check_model(mc: ModelConfig, m: MegatronLayout) -> None:
    """What GPTModel cannot train as Baton's architecture, refused before any work (the recipe
    checks run this with the recipe's vocabulary; the backend again with the tokenizer's)."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"invalid megatron setup: {msg}")

    from baton.common.megatron_layout import check_family, check_layout

    check_family(mc, need)  # the 2025-26 families' features GPTModel lacks, naming the family
    need(mc.num_local_experts == 0, "MoE models are not supported by backend megatron (use torch3d)")
    need(mc.sliding_window is None, "sliding-window attention is not supported by backend megatron")
    need(mc.rope_scaling is None, "rope_scaling is not supported by backend megatron")
    need(
        not mc.attention_bias,
        "attention_bias (an o_proj bias) has no megatron-core equivalent (add_bias_linear would bias the MLP too)",
    )
    need(
        mc.vocab_size % m.tp == 0,
        f"vocab_size {mc.vocab_size} is not divisible by parallel.tp={m.tp}: pad the vocabulary in the "
        f"recipe (model.vocab_size: a multiple of {m.tp}); megatron's own zero-row padding would change the loss",
    )
    check_layout(mc, m.tp, m.pp, m.vp)


def check_recipe(need, cfg: TrainConfig) -> None:
    """The recipe's checks for backend megatron (baton.train.validate runs them before any work):
    megatron-core present at the pinned version, the parallel section's layout against the
    launcher's world size and the model (what megatron cannot lay out is refused, naming the key),
    options megatron would reject or silently ignore."""
    p, m = cfg.parallel, cfg.megatron
    for name in ("tp", "pp", "pp_stages_per_rank"):
        v = getattr(p, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"parallel.{name} must be >= 1, got {v!r}")
    need(
        isinstance(p.dp, int) and not isinstance(p.dp, bool) and (p.dp >= 1 or p.dp == -1),
        f"parallel.dp must be a positive integer or -1, got {p.dp!r}",
    )
    need(
        p.cp == 1,
        f"parallel.cp {p.cp}: backend megatron runs no context parallelism (the ring attention is torch3d's); "
        "use backend torch3d, or parallel.cp 1",
    )
    need(p.ep == 1, f"parallel.ep {p.ep}: backend megatron trains no MoE models (expert parallelism is torch3d's)")
    need(
        p.pp_schedule in SCHEDULES,
        f"parallel.pp_schedule must be one of {SCHEDULES} with backend megatron (gpipe is torch3d's), "
        f"got {p.pp_schedule!r}",
    )
    check_stages_per_rank(need, p)
    need(
        p.loss_parallel or p.tp == 1,
        "parallel.loss_parallel false with tp > 1: megatron's GPTModel always computes the loss on vocabulary "
        "shards; leave it true (or use backend torch3d)",
    )
    need(m.recompute in RECOMPUTE_MODES, f"megatron.recompute must be one of {RECOMPUTE_MODES}, got {m.recompute!r}")
    need(
        cfg.recompute == RecomputeConfig(),
        "backend megatron recomputes with megatron's own granularities: set megatron.recompute, not recompute.mode",
    )
    need(not cfg.compile, "compile: true is not supported by backend megatron")
    need(cfg.attention == "sdpa", "backend megatron uses megatron's attention core: leave attention at sdpa")
    need(cfg.precision in ("fp32", "bf16"), f"backend megatron runs fp32 or bf16, got precision {cfg.precision!r}")
    lay = MegatronLayout.of(cfg)
    need(
        not lay.sequence_parallel or cfg.data.seq_len % lay.tp == 0,
        f"parallel.sequence_parallel needs data.seq_len {cfg.data.seq_len} divisible by tp={lay.tp} "
        "(or set parallel.sequence_parallel: false)",
    )
    need(
        lay.vp == 1 or lay.pp > 1,
        f"parallel.pp_stages_per_rank {lay.vp} (megatron's interleaved pipeline) needs parallel.pp > 1",
    )
    try:
        import megatron.core
    except ImportError:
        need(False, "backend megatron needs megatron-core: pip install -e '.[megatron]'")
    from baton.common.megatron_compat import PINNED

    need(
        torch.cuda.is_available() or megatron.core.__version__ == PINNED,
        f"backend megatron on a machine without CUDA needs megatron-core=={PINNED} (its CPU patches are "
        f"pinned), found {megatron.core.__version__}",
    )
    world = read_launch().world_size
    need(
        world % (lay.tp * lay.pp) == 0,
        f"world size {world} is not divisible by parallel.tp x parallel.pp = {lay.tp} x {lay.pp}",
    )
    dp = world // (lay.tp * lay.pp)
    need(
        p.dp in (-1, dp),
        f"parallel.dp x tp x pp = {p.dp} x {lay.tp} x {lay.pp} = {p.dp * lay.tp * lay.pp} != world size {world}",
    )
    accum = cfg.accum_steps(max(1, dp))
    need(
        lay.pp == 1 or accum >= lay.pp,
        f"megatron's pipeline schedules need at least pp={lay.pp} micro-batches per step, got {accum} "
        "(raise global_batch_size or grad_accum_steps)",
    )
    need(
        lay.vp == 1 or accum % lay.pp == 0,
        f"megatron's interleaved schedule needs the micro-batches per step ({accum}) to be a multiple of pp={lay.pp}",
    )
    check_model(cfg.model_config(vocab_size=cfg.model.get("vocab_size", 1024)), lay)


class MegatronBackend:
    def __init__(self, cfg: TrainConfig, model: CausalLM, attn: AttentionBackend, dist: Dist):
        from baton.common import megatron_compat

        megatron_compat.activate()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        m, mc = MegatronLayout.of(cfg), model.config
        check_model(mc, m)
        if not torch.distributed.is_initialized():  # megatron keeps its groups in torch.distributed
            init_distributed(need_group=True)
        self.cfg, self.m, self.mc, self.dist = cfg, m, mc, dist
        self.spec = spec_kind()  # the layer spec the chunks are built with (megatron_ckpt names by it)
        self.layout = Layout("megatron", dist.world_size, precision=cfg.precision)
        self.dp = dist.world_size // (m.tp * m.pp)
        self.grad_clip, self.weight_decay = cfg.optim.grad_clip, cfg.optim.weight_decay
        if ps.model_parallel_is_initialized():  # another run in this process: megatron keeps globals
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(m.tp, m.pp, virtual_pipeline_model_parallel_size=m.vp if m.vp > 1 else None)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        self.tcfg = transformer_config(mc, m, cfg.precision)
        chunks = build_chunks(mc, self.tcfg, m)
        load_baton_weights(chunks, model.state_dict(), mc, m)
        if self.tcfg.bf16:  # megatron's bf16: the whole chunk (norms too) in bf16, fp32 loss outputs
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(self.tcfg, c) for c in chunks]
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=m.distributed_optimizer
        )
        self.chunks = [
            DistributedDataParallel(self.tcfg, ddp_cfg, c, disable_bucketing=v > 0) for v, c in enumerate(chunks)
        ]
        o = cfg.optim
        self.opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.grad_clip,
            bf16=cfg.precision == "bf16",
            params_dtype=self.tcfg.params_dtype,
            use_distributed_optimizer=m.distributed_optimizer,
        )
        with megatron_compat.cuda_type_names():
            self.optimizer = get_megatron_optimizer(self.opt_cfg, self.chunks)
        self.tcfg.no_sync_func = [c.no_sync for c in self.chunks]
        if m.vp == 1:
            self.tcfg.no_sync_func = self.tcfg.no_sync_func[0]
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.forward_backward = get_forward_backward_func()
        model.to("meta")  # the weights live in the chunks now; the bare model keeps only its structure
        self.module = model
        self.device = torch.device(torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # ------------------------------------------------------------------------------- steps
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator).to(self.device)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(tokens.shape[1], device=self.device).expand_as(tokens)
        out = model(tokens, positions, None, labels=labels)  # per-token losses on the last stage
        return out, _mean_loss

    def _run(self, micro_batches: list[torch.Tensor], forward_only: bool) -> float:
        """One pass of the pipeline schedule; the summed micro-batch losses, on every rank."""
        from megatron.core import parallel_state as ps

        losses = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=[iter(micro_batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0].shape[1] - 1,
            micro_batch_size=micro_batches[0].shape[0],
            forward_only=forward_only,
        )
        mine = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if mine:
            total += sum(float(d["loss"]) for d in losses)
        return self.dist.all_reduce_sum(total).item()

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        from baton.common import megatron_compat
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._run(micro_batches, forward_only=False) / (len(micro_batches) * self.dp)
        opt = self.optimizer
        opt.prepare_grads()  # the reduced gradients into the optimizer's (main) gradients
        norm = float(opt.get_grad_norm())
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            for group in opt.param_groups:  # (megatron's own scheduler would set these: it is not used)
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)  # 0 on norms, biases
            if self.grad_clip > 0:
                for o in getattr(opt, "chained_optimizers", [opt]):
                    if o.get_parameters():
                        with megatron_compat.cuda_type_names():
                            clip_grad_by_total_norm_fp32(o.get_parameters(), self.grad_clip, norm)
            opt.step_with_ready_grads()
        return StepResult(loss, norm, applied)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        for c in self.chunks:
            c.eval()
        try:
            # The pipeline schedules want equal micro-batches, the interleaved one a multiple of pp
            # of them: pp parts, or every row pp times (which leaves the mean loss as it is).
            pp, rows = self.m.pp, batch.shape[0]
            parts = list(batch.chunk(pp)) if rows % pp == 0 else list(batch.split(1)) * pp
            return self._run(parts, forward_only=True) / (len(parts) * self.dp)
        finally:
            for c in self.chunks:
                c.train()

    # ------------------------------------------------------------------------- checkpoints
    def save(self, directory) -> None:
        # (not `from baton.train.backends import ...`: that names the package, whose factory imports us)
        import baton.train.backends.megatron_ckpt as megatron_ckpt

        megatron_ckpt.save(self, directory)

    def load(self, directory, saved: Layout) -> None:
        import baton.train.backends.megatron_ckpt as megatron_ckpt

        megatron_ckpt.load(self, directory, saved)

    def memory(self) -> dict[str, Any]:
        """Bytes of model state on this rank: parameters, gradient buffers, optimizer state."""
        params = sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
        grads = sum(
            b.grad_data.numel() * b.grad_data.element_size()
            for c in self.chunks
            for b in c.buffers
            if b.grad_data is not None
        )
        inner = [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        optim = sum(
            t.numel() * t.element_size()
            for opt in inner
            for st in opt.state.values()
            for t in st.values()
            if torch.is_tensor(t)
        )
        return {
            "accelerator": {"params": params, "grads": grads, "optimizer": optim},
            "host": {},
            "nvme": {},
            "parameters": params // self.tcfg.params_dtype.itemsize,
        }


def _mean_loss(per_token: torch.Tensor):
    """megatron's loss function: the micro-batch's mean token loss (the schedule divides it by the
    number of micro-batches, DDP the gradients by the data-parallel size)."""
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach().clone()}  # (the schedule divides `loss` in place)
