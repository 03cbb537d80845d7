"""megatron-core 0.16.1 on a machine without CUDA: the few places it assumes a GPU, made CPU-safe.

Used by the megatron training backend and by `baton convert`'s Megatron checkpoints alike.
megatron-core is written for GPUs: it asks torch.cuda for the current device, synchronizes
streams, keeps CUDA RNG states, allocates scratch tensors with device="cuda" and checks
Tensor.type() strings such as "torch.cuda.FloatTensor". None of that is needed for the
computation itself, so on a CPU-only machine (tests, CI) `activate()` patches exactly those
places and nothing else. With CUDA available it patches nothing. The patches are pinned to the
version they were written against: any other version is refused rather than half-patched.

Each patch names the upstream function it is for and why; the mechanism for the `torch.cuda` /
device="cuda" calls is one: those megatron modules see a `torch` whose `cuda` namespace and
tensor factories answer with the CPU (`_CpuTorch`), while the rest of the process keeps torch.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import Any

import torch

PINNED = "0.16.1"

# Modules whose functions call torch.cuda.* or allocate device="cuda" tensors on the training path.
_CUDA_MODULES = {
    # p2p_communication._communicate(_shapes): torch.cuda.current_device() for shape/recv buffers,
    # torch.cuda.synchronize() after batched isend/irecv.
    "megatron.core.pipeline_parallel.p2p_communication": "pipeline send/recv buffers",
    # schedules.forward_backward_*: total_num_tokens = torch.zeros(..., device="cuda").
    "megatron.core.pipeline_parallel.schedules": "token counters",
    # clip_grads.get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32: device="cuda" scratch.
    "megatron.core.optimizer.clip_grads": "grad-norm scratch tensors",
    # optimizer.MixedPrecisionOptimizer.__init__ (found_inf, _scale_one) and FP32Optimizer (_scale).
    "megatron.core.optimizer.optimizer": "loss-scale and overflow tensors",
    # distrib_optimizer.DistributedOptimizer: state gather/scatter buffers on torch.cuda.current_device().
    "megatron.core.optimizer.distrib_optimizer": "state gather buffers",
    # param_and_grad_buffer._ParamAndGradBuffer.__init__: grad/param buffers on torch.cuda.current_device().
    "megatron.core.distributed.param_and_grad_buffer": "the grad and param buffers",
    # distributed_data_parallel.DistributedDataParallel: torch.cuda.synchronize()/Stream when overlapping.
    "megatron.core.distributed.distributed_data_parallel": "stream handling",
    # finalize_model_grads: allreduce of the embedding/layernorm grads and the token count on cuda.
    "megatron.core.distributed.finalize_model_grads": "token-count all-reduce",
    # rotary_pos_embedding.RotaryEmbedding.__init__/get_emb: inv_freq moved to torch.cuda.current_device().
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE inv_freq",
    # tensor_parallel.layers: the weight-init helpers and linear_with_grad_accumulation use current_device().
    "megatron.core.tensor_parallel.layers": "layer parameter allocation",
    # tensor_parallel.mappings._gather/_reduce_scatter_along_first_dim: output buffers on current_device().
    "megatron.core.tensor_parallel.mappings": "sequence-parallel buffers",
    # tensor_parallel.random: CheckpointFunction saves/restores CUDA RNG states (full recompute).
    "megatron.core.tensor_parallel.random": "recompute RNG states",
    # utils.get_attr_wrapped_model / make_viewless_tensor / GlobalMemoryBuffer: current_device().
    "megatron.core.utils": "global memory buffer",
    # parallel_state: torch.cuda.device_count() checks and the global memory buffer.
    "megatron.core.parallel_state": "device counts",
    # transformer.module: Float16Module and fp32 conversions call .cuda().
    "megatron.core.transformer.module": "module placement",
    # gpt_model.GPTModel: torch.cuda.current_device() for the rotary embeddings' cache.
    "megatron.core.models.gpt.gpt_model": "rotary cache device",
    # transformer_layer.TransformerLayer: torch.cuda.nvtx ranges and current_device().
    "megatron.core.transformer.transformer_layer": "nvtx ranges",
    # attention.Attention: torch.cuda.current_device() for the inference/rotary buffers.
    "megatron.core.transformer.attention": "attention buffers",
    # dot_product_attention.DotProductAttention: the causal mask on current_device().
    "megatron.core.transformer.dot_product_attention": "causal mask",
    # transformer.utils.get_default_causal_mask: the causal mask of the local attention, device="cuda".
    "megatron.core.transformer.utils": "causal mask",
    # dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors: synchronize.
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "checkpoint writer sync",
    # dist_checkpointing.strategies.state_dict_saver.save_state_dict_async_finalize: result flags on cuda.
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "save verification flags",
    # dist_checkpointing.strategies.async_utils.AsyncCallsQueue: liveness flags on current_device().
    "megatron.core.dist_checkpointing.strategies.async_utils": "async save flags",
    # dist_checkpointing.exchange_utils.exchange_by_distribution: load buffers on "cuda".
    "megatron.core.dist_checkpointing.exchange_utils": "load exchange buffers",
    # rerun_state_machine: torch.cuda.* in its RNG state capture on every forward_step.
    "megatron.core.rerun_state_machine": "rerun RNG capture",
}


def _on_cpu(device: Any) -> Any:
    """device="cuda"/"cuda:N"/an int (torch.cuda.current_device()) -> the CPU; others unchanged."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.SimpleNamespace):
    """torch.cuda as megatron uses it, answered for the CPU: the current device is the CPU,
    synchronization and NVTX are no-ops, RNG state calls use the CPU generator."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: torch.device("cpu"))
    synchronize = staticmethod(lambda *a, **k: None)
    empty_cache = staticmethod(lambda: None)
    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 0)
    get_rng_state = staticmethod(lambda *a, **k: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *a, **k: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: None)  # the CPU generator is seeded by the caller
    nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)
    memory_allocated = staticmethod(lambda *a, **k: 0)
    max_memory_allocated = staticmethod(lambda *a, **k: 0)


class _CpuTorch(types.ModuleType):
    """`torch` for megatron's modules: everything is torch's, except `cuda` (above) and the tensor
    factories, which put device="cuda" allocations on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "empty_like", "randn"):
            setattr(self, name, self._factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _factory(fn):
        def make(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _on_cpu(kwargs["device"])
            return fn(*args, **kwargs)

        return make


_ACTIVE = False


def activate() -> bool:
    """Patch megatron-core for CPU operation when CUDA is absent; True if it patched. Idempotent."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    import megatron.core

    if megatron.core.__version__ != PINNED:
        raise RuntimeError(
            f"baton's CPU compatibility patches are written for megatron-core {PINNED}, found "
            f"{megatron.core.__version__}: install megatron-core=={PINNED} (pip install -e '.[megatron]')"
        )
    if _ACTIVE:
        return True
    shim = _CpuTorch()
    for name in _CUDA_MODULES:
        importlib.import_module(name).torch = shim
    _patch_rng_tracker()
    _patch_torch_norm()
    _patch_dp_zero_gather()
    _ACTIVE = True
    return True


def _patch_rng_tracker() -> None:
    """tensor_parallel.random.initialize_rng_tracker: the CUDA RNG tracker forks CUDA generators
    around attention dropout and weight init (CudaRNGStatesTracker.add/fork); the inference
    tracker's fork is a null context. Baton's models have no dropout, so nothing draws from it."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    original = random.initialize_rng_tracker

    def initialize(use_te_rng_tracker=False, inference_rng_tracker=False, *args, force_reset=False, **kwargs):
        return original(use_te_rng_tracker, True, *args, force_reset=force_reset, **kwargs)

    random.initialize_rng_tracker = initialize
    # random._get_cuda_rng_state/_set_cuda_rng_state: CheckpointFunction (full and selective
    # recompute) saves and restores the CUDA generator around the recomputed forward; on the CPU
    # the caller (_get_all_rng_states/_set_all_rng_states) already does so for the CPU generator.
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_torch_norm() -> None:
    """torch_norm.WrappedTorchNorm.__new__ asserts `not config.sequence_parallel` (the local
    spec's norm, used when TransformerEngine and Apex are absent). With sequence parallelism a
    norm's weight sees only this rank's tokens, so its gradient must be summed over the TP
    group: marking the weight `sequence_parallel` makes finalize_model_grads do exactly that,
    as it does for TE's norms."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_dp_zero_gather() -> None:
    """distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero: the fully_reshardable
    save gathers the optimizer shards with use_gloo_comm=False, which moves them with .cuda();
    the gloo path (the data-parallel gloo group, CPU tensors) is the same gather without CUDA."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.get_parameter_state_dp_zero

    def gather(self, use_gloo_comm=True, *args, **kwargs):
        return original(self, True, *args, **kwargs)

    DistributedOptimizer.get_parameter_state_dp_zero = gather


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """optimizer.Float16OptimizerWithFloat16Params.__init__ and DistributedOptimizer.
    _build_model_and_main_param_groups accept only parameters whose Tensor.type() is a
    "torch.cuda.*Tensor" string: while they run (and only then), CPU tensors report the CUDA names."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original
