"""Each rank holds ~1/T of the sharded tensors plus the replicated ones, and nothing else.

The expectation is computed here from the checkpoint's own tensor list (names, shapes, dtypes in the
safetensors headers) and the layout's rules, tensor by tensor, and compared with what load_shard
actually holds: so no rank read a whole tensor it only needs a slice of, or a layer it does not run.
The real multi-process runs (test_parallel_quant.py) compare DistributedRunner's per-rank
weight_bytes with the same numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from baton.common.checkpoint import read_config, weight_files
from baton.common.config import ModelConfig
from baton.common.model import build_model
from baton.kernels import linear_cpu
from baton.serve.parallel.loader import load_shard, weight_bytes
from baton.serve.parallel.shard import Shard

from .test_shard_loading import COLUMN, ROW, checkpoint

ELEMENT = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1}


def checkpoint_tensors(d: Path) -> dict[str, tuple[list[int], int]]:
    """{name: (shape, bytes per element)} from the safetensors headers (no tensor is read)."""
    out = {}
    for f in weight_files(d):
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                part = h.get_slice(name)
                out[name] = (part.get_shape(), ELEMENT[part.get_dtype()])
    return out


def expected_rank_bytes(d: Path, shard: Shard) -> dict[str, int]:
    """{tensor name: bytes} rank `shard` should hold. Sharded: q/gate/up (and experts' w1/w3) by
    output rows, o/down/w2 by input columns (1/T each); k/v by KV head (replicated when there are
    fewer KV heads than ranks); the vocabulary in ceil(V/T) rows. Whole on every rank: norms, the
    MoE router, a row-parallel layer's per-output-channel scales. A row-parallel bias: rank 0 only.
    Pipeline: a rank's own layers, the embedding on the first stage, norm and LM head on the last."""
    cfg = read_config(d)
    tp, r = shard.tp_size, shard.tp_rank
    layers = cfg.num_hidden_layers
    mine = range(shard.pp_rank * layers // shard.pp_size, (shard.pp_rank + 1) * layers // shard.pp_size)
    first, last = shard.pp_rank == 0, shard.pp_rank == shard.pp_size - 1
    kv, experts = cfg.num_key_value_heads, cfg.num_local_experts
    tensors = checkpoint_tensors(d)
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    out: dict[str, int] = {}
    for name, (shape, elem) in tensors.items():
        size = math.prod(shape) * elem
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            held = first if name.startswith("model.") else last and not (cfg.tie_word_embeddings and first)
            if held:  # a tied head on the embedding's rank is the same tensor: counted once
                out[name] = -(-cfg.vocab_size // tp) * shape[1] * elem
            continue
        if name == "model.norm.weight":
            if last:
                out[name] = size
            continue
        layer = int(name.split(".")[2])
        if layer not in mine:
            continue
        module, tensor = name.rsplit(".", 1)
        kind = module.rsplit(".", 1)[-1]
        if ".experts." in name and shard.moe_parallel == "expert":
            e = int(name.split(".experts.")[1].split(".")[0])
            if e * tp // experts == r:  # rank r holds experts [r E/T, (r+1) E/T) whole
                out[name] = size
        elif kind in ("k_proj", "v_proj"):
            out[name] = size // min(tp, kv)
        elif kind in COLUMN:
            out[name] = size // tp
        elif kind in ROW and tensor == "bias":
            if r == 0:
                out[name] = size
        elif kind in ROW and len(shape) == 2:
            out[name] = size // tp
        else:  # norms, the router, per-output-channel scales of a row-parallel layer
            out[name] = size
    return out


LAYOUTS = [
    ("float", 2, 1, "tensor"),
    ("float", 4, 1, "tensor"),  # 2 KV heads on 4 ranks: each KV head replicated twice
    ("float", 2, 2, "tensor"),
    ("float-tied", 2, 1, "tensor"),
    ("float-tied", 1, 2, "tensor"),  # the last stage reads the embedding as its LM head
    ("gptq-int4", 2, 1, "tensor"),
    ("gptq-int4", 2, 2, "tensor"),
    ("awq-int4", 2, 1, "tensor"),
    ("rtn-int8", 4, 1, "tensor"),
    ("fp8", 2, 1, "tensor"),
    ("w8a8", 2, 1, "tensor"),
    ("moe-int4", 2, 1, "tensor"),
    ("moe-int4", 2, 1, "expert"),
]


@pytest.mark.parametrize("name,tp,pp,moe", LAYOUTS, ids=[f"{n}-T{t}xP{p}-{m}" for n, t, p, m in LAYOUTS])
def test_each_rank_holds_its_share(tmp_path_factory, name, tp, pp, moe):
    d = checkpoint(tmp_path_factory, name)
    whole = sum(math.prod(s) * e for s, e in checkpoint_tensors(d).values())
    totals = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = Shard(tp_rank, tp, pp_rank, pp, moe)
            model = load_shard(d, shard)
            held = {
                n: t.numel() * t.element_size()
                for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t is not None
            }
            want = expected_rank_bytes(d, shard)
            assert held == want, {
                n: (held.get(n), want.get(n)) for n in held.keys() | want.keys() if held.get(n) != want.get(n)
            }
            assert weight_bytes(model) == sum(want.values())
            totals.append(weight_bytes(model))
    # Replicated tensors are a few percent of this model; every rank holds well under its 1/(T P) + 25%.
    assert max(totals) < whole / (tp * pp) * 1.25, (totals, whole)


@pytest.mark.parametrize(
    "dtype,path,width",
    [(torch.float32, None, 4), (torch.bfloat16, "onednn", 2), (torch.bfloat16, "mkl-fp32", 4)],
    ids=["fp32", "bf16", "bf16-widened"],
)
def test_packed_linears_count_at_the_width_they_are_packed_in(monkeypatch, dtype, path, width):
    """A bf16 weight widened to fp32 for MKL (a CPU without oneDNN bf16) holds 4 bytes a weight."""
    if path is not None:  # that path, not Baton's GEMM (which packs bf16 at 2 bytes too)
        monkeypatch.setattr(linear_cpu, "_bf16_path", lambda: path)
        monkeypatch.setattr(linear_cpu, "_gemm", lambda dtype: None)
    needs = {None: linear_cpu.prepacked_available(dtype), "onednn": linear_cpu._mkldnn_bf16()}
    if not needs.get(path, linear_cpu._sgemm() is not None):
        pytest.skip("this torch cannot pack that path here")
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    model = build_model(cfg, seed=0).to(dtype)
    linears = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    before = weight_bytes(model)
    assert linear_cpu.pack_linears(model) == 8  # q, k, v, o, gate, up, down and the LM head
    assert weight_bytes(model) == before + linears * (width - dtype.itemsize)
