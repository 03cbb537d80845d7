"""The CPU step's layers run without the modules (serve/runner/cpu_layers.py): bit for bit the modules'
forward, K/V pools included, through chunked prefill over cached prefixes, decode rows and the
last layer's sampled rows; and the modules again wherever the path does not apply."""

import dataclasses

import pytest
import torch
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.common.rope import rotary_cos_sin
from baton.kernels import linear_cpu
from baton.kernels.cpu_extension import cpu_kernels
from baton.serve.core.sequence import Sequence
from baton.serve.runner.cpu_layers import CpuHead, CpuLayers
from baton.serve.runner.model_runner import ModelRunner
from baton.serve.sampling_params import SamplingParams

from ..system import require

CFG = ModelConfig(  # head_dim 32: the C++ decode kernel's vector path
    vocab_size=128,
    hidden_size=128,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
VARIANTS = {
    "llama": {},
    "mistral-window": {"sliding_window": 6, "model_type": "mistral"},
    "qwen2-bias": {"qkv_bias": True, "model_type": "qwen2"},
    "llama-whole-panels": {"intermediate_size": 192},  # where Baton's GEMM is chosen: SwiGLU in its epilogue
}


def _runner(cfg: ModelConfig, dtype: torch.dtype, fast: bool) -> ModelRunner:
    runner = ModelRunner(build_model(cfg, seed=0, dtype=dtype), num_blocks=16, block_size=4)
    assert isinstance(runner.cpu_layers, CpuLayers) and len(runner.cpu_layers.bound) == cfg.num_hidden_layers
    assert isinstance(runner.cpu_head, CpuHead)
    if not fast:
        runner.cpu_layers = runner.cpu_head = None
    return runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_cpu_layers_equal_the_modules_bit_for_bit(variant, dtype):
    cfg = dataclasses.replace(CFG, **VARIANTS[variant])
    runners = {fast: _runner(cfg, dtype, fast) for fast in (True, False)}
    ran = []
    layers = runners[True].cpu_layers
    run = layers.run
    layers.run = lambda *a, **k: ran.append(1) or run(*a, **k)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (10, 13, 20)]
    seqs = {f: [Sequence(i, str(i), 0, list(t), SamplingParams()) for i, t in enumerate(prompts)] for f in runners}
    for group in seqs.values():
        for s, table in zip(group, ([0, 1, 2, 12, 14], [3, 4, 5, 6, 15], [7, 8, 9, 10, 11, 13])):
            s.block_table = table
    # a chunk and decode rows; a prompt, rows over a cached prefix and a prompt's last token (the
    # last layer answers the sampled rows only); then decode steps
    steps = [[(0, 9), (1, 7)], [(2, 20), (1, 6), (0, 1)]] + [[(0, 1), (1, 1), (2, 1)]] * 3
    dense = build_model(cfg, seed=0, dtype=dtype)
    for plan in steps:
        got = {}
        for fast, runner in runners.items():
            group = seqs[fast]
            got[fast] = runner.execute([(group[i], n) for i, n in plan])
            for i, n in plan:
                group[i].num_computed_tokens += n
        for (k0, v0), (k1, v1) in zip(runners[True].kv_caches, runners[False].kv_caches):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        assert torch.equal(got[True].logits, got[False].logits)
        if got[True].groups and dtype == torch.float32:  # and both equal a dense forward (an independent path)
            with torch.no_grad():
                want = [dense(torch.tensor([s.token_ids[: s.num_computed_tokens]]))[0, -1] for s, _ in got[True].groups]
            torch.testing.assert_close(got[True].logits, torch.stack(want), atol=1e-4, rtol=1e-4)
        for j, (s, _) in enumerate(got[False].groups):
            for group in seqs.values():
                group[s.seq_id].token_ids.append(int(got[False].logits[j].argmax()))
    assert len(ran) == len(steps)  # every step took the path under test


def test_a_hook_a_tree_or_a_quantized_cache_sends_the_step_through_the_modules():
    runner = _runner(CFG, torch.float32, True)
    layers, md = runner.layers, runner.plan([])[0].tensors(runner.device)[2]
    assert runner.cpu_layers.takes(layers, md)
    handle = layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    assert not runner.cpu_layers.takes(layers, md)  # a probe or tensor parallelism's all-reduce
    handle.remove()
    assert not runner.cpu_layers.takes(layers, dataclasses.replace(md, trees=[object()]))
    quantized = ModelRunner(build_model(CFG, seed=0), num_blocks=16, block_size=4, kv_cache_dtype="int8")
    assert quantized.cpu_layers is None


def test_batons_cpu_layers_switch_turns_the_path_off(monkeypatch):
    monkeypatch.setenv("BATON_CPU_LAYERS", "0")
    assert ModelRunner(build_model(CFG, seed=0), num_blocks=16, block_size=4).cpu_layers is None
    monkeypatch.setenv("BATON_CPU_LAYERS", "off")  # a typo is refused before any work, naming the variable
    with pytest.raises(ValueError, match="BATON_CPU_LAYERS='off'"):
        ModelRunner(build_model(CFG, seed=0), num_blocks=16, block_size=4)


@pytest.fixture
def linear_choice(monkeypatch):
    """Sets BATON_CPU_FP32_LINEAR / BATON_CPU_BF16_LINEAR for one test: the paths are chosen once
    per process."""
    caches = (linear_cpu._fp32_path, linear_cpu._gemm_chosen)

    def choose(var: str, path: str) -> None:
        monkeypatch.setenv(var, path)
        for c in caches:
            c.cache_clear()

    yield choose
    for c in caches:
        c.cache_clear()  # the next runner chooses again, from the restored variables


@pytest.mark.parametrize(
    "linears",
    ["plain", "mkl", "onednn", "baton", "baton+swiglu", "mkl-bf16", "onednn-bf16", "baton-bf16", "baton-bf16+swiglu"],
)
def test_every_kind_of_linear_takes_the_path_too(linears, monkeypatch, linear_choice):
    """Packing off (BATON_CPU_PACKED_LINEAR=0): nn.Linear, F.linear then; MKL's packed SGEMM (the
    path Intel CPUs take), oneDNN's packed weight and Baton's GEMM, each chosen here by
    BATON_CPU_FP32_LINEAR / BATON_CPU_BF16_LINEAR; bf16 widened into MKL's fp32 pack (the path of a
    CPU without oneDNN bf16, forced here). "+swiglu": an intermediate size of whole 64-column
    panels, where Baton's gate/up GEMM applies SwiGLU in its epilogue (gemm_swiglu)."""
    linears, fused = linears.removesuffix("+swiglu"), linears.endswith("+swiglu")
    cfg = dataclasses.replace(CFG, intermediate_size=192) if fused else CFG
    kind, _, bf16 = linears.partition("-")
    dtype = torch.bfloat16 if bf16 else torch.float32
    if linears == "plain":
        monkeypatch.setenv("BATON_CPU_PACKED_LINEAR", "0")
    elif linears == "mkl-bf16":
        if not linear_cpu.prepacked_available(torch.bfloat16) or linear_cpu._sgemm() is None:
            pytest.skip("this torch has no MKL packed SGEMM")
        linear_choice("BATON_CPU_BF16_LINEAR", "onednn")  # not Baton's GEMM, and oneDNN's bf16 missing:
        monkeypatch.setattr(linear_cpu, "_bf16_path", lambda: "mkl-fp32")
    elif kind == "baton":
        require("c++")
        if cpu_kernels() is None or not cpu_kernels().gemm_available(dtype):
            pytest.skip(f"no {dtype} GEMM in this build (AVX-512 / AVX-512 BF16)")
        linear_choice(f"BATON_CPU_{'BF16' if bf16 else 'FP32'}_LINEAR", "baton")
    elif bf16:
        linear_choice("BATON_CPU_BF16_LINEAR", kind)
        if linear_cpu._bf16_path() != kind:
            pytest.skip(f"this torch has no {kind} packed bf16 path")
    else:
        linear_choice("BATON_CPU_FP32_LINEAR", kind)
        if linear_cpu._fp32_path() != kind:
            pytest.skip(f"this torch has no {kind} packed fp32 path")
    runners = {fast: _runner(cfg, dtype, fast) for fast in (True, False)}
    layers = runners[True].cpu_layers
    first = layers.bound[id(runners[True].layers[0])].id
    assert layers.stack.linear(first, "qkv").kind == kind
    assert layers.stack.fuses_swiglu(first) == fused
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (11,), generator=g).tolist()
    seqs = {f: Sequence(0, "0", 0, list(prompt), SamplingParams()) for f in runners}
    for s in seqs.values():
        s.block_table = [0, 1, 2, 3]
    dense = build_model(cfg, seed=0, dtype=dtype).float()  # unpacked, fp32, outside any runner: the reference
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: its activations rounded at every op
    for n in (11, 1, 1):
        got = {fast: runner.execute([(seqs[fast], n)]).logits for fast, runner in runners.items()}
        assert torch.equal(got[True], got[False])
        with torch.no_grad():
            want = dense(torch.tensor([seqs[True].token_ids[: seqs[True].num_computed_tokens + n]]))[0, -1]
        torch.testing.assert_close(got[True][0].float(), want, atol=tol, rtol=tol)
        for s in seqs.values():
            s.num_computed_tokens += n
            s.token_ids.append(int(got[True][0].argmax()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_tables_equal_rotary_cos_sin_as_they_grow(dtype):
    """The step's cos/sin come from tables over every position up to the largest seen: the same
    values as rotary_cos_sin's per-step computation, before and after the tables grow."""
    layers = _runner(CFG, dtype, True).cpu_layers
    inv_freq = build_model(CFG, seed=0).model.inv_freq
    g = torch.Generator().manual_seed(2)
    for top in (40, 300, 5000, 100):  # the tables start at 256 positions and grow twice
        positions = torch.randint(0, top, (37,), generator=g)
        got = layers.cos_sin(inv_freq, positions, dtype)
        want = rotary_cos_sin(inv_freq, positions, dtype)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[0].dtype == dtype
    assert layers._tables[1].shape[0] > 2 * 256  # it grew
