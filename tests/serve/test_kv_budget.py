"""KV pool budgets: explicit sizes win; CPU takes a fraction of available RAM shared by the host's
ranks; CUDA follows vLLM's gpu_memory_utilization rule (no GPU here: the device's memory numbers
are stubbed, the arithmetic is what is checked; benchmarks/engine_gpu.py runs it for real)."""

from __future__ import annotations

import psutil
import torch
from baton.common.config import ModelConfig
from baton.serve.runner import kv_budget
from baton.serve.runner.kv_budget import activation_reserve, kv_budget_bytes

CFG = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SIZES = dict(kv_cache_fraction=0.5, gpu_memory_utilization=0.9, max_num_batched_tokens=256, max_num_seqs=8, elem=4)


def test_explicit_bytes_win_and_cpu_shares_the_hosts_ram():
    cpu = torch.device("cpu")
    assert kv_budget_bytes(cpu, CFG, kv_cache_bytes=12345, **SIZES) == 12345
    one = kv_budget_bytes(cpu, CFG, kv_cache_bytes=None, **SIZES)
    two = kv_budget_bytes(cpu, CFG, kv_cache_bytes=None, ranks_on_host=2, **SIZES)
    avail = psutil.virtual_memory().available
    assert 0.4 * avail < one <= 0.5 * avail and abs(two - one / 2) < 0.05 * one


def test_cuda_rule_leaves_weights_activations_and_other_processes_their_share(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 * gib, 80 * gib))  # 10 GiB used elsewhere
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 8 * gib)  # our weights
    reserve = activation_reserve(CFG, 256, 8, 4)
    got = kv_budget_bytes(torch.device("cuda", 0), CFG, kv_cache_bytes=None, **SIZES)
    assert got == int(80 * gib * 0.9) - 8 * gib - reserve
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * gib, 80 * gib))  # others took most of it
    assert kv_budget_bytes(torch.device("cuda", 0), CFG, kv_cache_bytes=None, **SIZES) == 5 * gib - reserve
    assert kv_budget.activation_reserve(CFG, 256, 8, 4, tp=2) < reserve
