"""Device placement, checked where a CPU can check it. The rank's device is cuda:LOCAL_RANK with NCCL
whenever CUDA is there (CUDA mocked here), made current even when the caller built the group; every
Parallel3D layout moves its model to that device itself and hands collectives only tensors on it,
with no host copy in the gradient-norm reduction (spied on 2 gloo ranks). MFU's peak: the datasheet
table by device name and dtype, else a matmul measured in the training dtype; MoE counts active
parameters (checked against a real model's tensors). What only a GPU proves - NCCL accepting every
collective, the kernels running - is benchmarks/train_gpu.py's job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.train import distributed, metrics
from baton.train.distributed import Dist, init_distributed, process_group_backend, rank_device
from baton.train.metrics import active_parameters, flops_per_token, peak_flops, table_peak

from .parallel.conftest import torchrun


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch believes in CUDA; set_device calls are recorded instead of made."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_a_cuda_rank_computes_on_its_local_gpu_with_nccl(fake_cuda):
    assert rank_device(3) == torch.device("cuda", 3) and Dist(1, 4, 1).device == torch.device("cuda", 1)
    assert process_group_backend(rank_device(0)) == "nccl" and process_group_backend(torch.device("cpu")) == "gloo"


def test_a_group_the_caller_made_still_gets_the_local_gpu_made_current(fake_cuda, monkeypatch):
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    d = init_distributed()
    assert fake_cuda == [torch.device("cuda", 1)] and d.device == torch.device("cuda", 1)


def test_without_cuda_the_rank_is_the_cpu_with_gloo():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert Dist().device == torch.device("cpu") and process_group_backend(Dist().device) == "gloo"
    assert distributed.rank_device(5) == torch.device("cpu")


@pytest.mark.slow
def test_every_layout_places_its_model_and_collectives_on_the_rank_device(tmp_path):
    torchrun(2, [str(Path(__file__).with_name("devices_run.py")), str(tmp_path)], tmp_path / "log.txt")
    for layout in ("pp2", "tp2_nosp", "dp2_ddp", "dp2_fsdp", "cp2"):
        for rank in (0, 1):
            rec = json.loads((tmp_path / f"{layout}.rank{rank}.json").read_text())
            device = rec["rank_device"]
            assert rec["engine_device"] == device, layout
            assert rec["moved_to"] == [device], layout  # moved explicitly, not left to a TP/FSDP wrapper
            assert rec["param_devices"] == rec["rope_devices"] == [device], layout
            assert set(rec["collective_devices"]) <= {device}, layout
            assert rec["cpu_calls_in_step"] == 0, layout  # the norm is reduced where the gradients are
    # the layouts with collectives outside DDP's reducer did hand tensors to torch.distributed
    assert json.loads((tmp_path / "pp2.rank0.json").read_text())["collective_devices"] == ["cpu"]


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5),  # SXM
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H200", torch.bfloat16, 989.5),
        ("NVIDIA H200", torch.float32, 67.0),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312.0),
        ("NVIDIA L40S", torch.bfloat16, 362.05),
        ("NVIDIA L40", torch.bfloat16, 181.05),
        ("NVIDIA L4", torch.bfloat16, 121.0),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 tensor cores: measured instead
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_table_by_device_name_and_dtype(name, dtype, tflops):
    assert table_peak(name, dtype) == (None if tflops is None else tflops * 1e12)


def test_peak_is_the_table_on_a_known_gpu_else_a_large_matmul_in_the_training_dtype(monkeypatch):
    measured = []
    monkeypatch.setattr(
        metrics, "measure_matmul_peak", lambda device, dtype, n=1024: measured.append((dtype, n)) or 1.0
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == (989.5e12, "table: NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == (1.0, "measured: Some Future GPU")
    assert peak_flops(torch.device("cpu"), torch.bfloat16) == (1.0, "measured")
    assert measured == [(torch.bfloat16, 8192), (torch.bfloat16, 1024)]


def test_cpu_peak_is_measured_in_the_training_dtype():
    assert metrics.measure_matmul_peak("cpu", torch.bfloat16, n=128, seconds=0.05) > 0


def test_moe_mfu_counts_the_parameters_a_token_runs_through():
    cfg = ModelConfig(
        model_type="mixtral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    model = build_model(cfg, seed=0)
    named = dict(model.named_parameters())
    one_expert = sum(p.numel() for n, p in named.items() if ".experts.0." in n) // cfg.num_hidden_layers
    shared = sum(p.numel() for n, p in named.items() if ".experts." not in n)
    assert active_parameters(cfg) == shared + cfg.num_hidden_layers * cfg.num_experts_per_tok * one_expert
    # Against the same model with one dense MLP per layer: a token adds the router and top_k - 1 more expert MLPs.
    dense = ModelConfig(**{**cfg.to_dict(), "model_type": "llama", "num_local_experts": 0})
    extra = cfg.hidden_size * cfg.num_local_experts + (cfg.num_experts_per_tok - 1) * one_expert
    assert flops_per_token(cfg, 32) == flops_per_token(dense, 32) + 6 * cfg.num_hidden_layers * extra
