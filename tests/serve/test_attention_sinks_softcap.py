"""The serving attention backend honours a layer's attention sinks and logit soft-cap on every path:
one packed step (the C++ one-call path on CPU, the dispatchers with a sliding window), the
quantized KV cache, the rows answered alone (query_rows) and speculative token trees (the C++ tail
mask and the torch tree path), each against the kernels' references."""

import pytest
import torch
from baton.kernels import reference as ref
from baton.serve.quantization.kv_cache import quantize_kv, write_and_read
from baton.serve.runner.attention import AttentionMetadata, PagedAttention, TreeGroup, tree_attention

from .test_attention import DIM, HEADS, KV_HEADS, _step

EXTRAS = {"sinks": (True, None), "softcap": (False, 1.5), "both": (True, 1.5)}
SINKS = torch.tensor([0.5, -30.0, 4.0, -1.0, 2.0, 0.0, 8.0, -3.0])


class _Layer:  # the attributes PagedAttention reads from an Attention module, sinks and soft-cap included
    layer_idx, scaling = 0, DIM**-0.5

    def __init__(self, window, extras, dtype=torch.float32):
        with_sinks, softcap = EXTRAS[extras]
        self.sliding_window = window
        self.sinks = torch.nn.Parameter(SINKS.to(dtype)) if with_sinks else None
        self.logit_softcap = softcap

    @property
    def kw(self) -> dict:
        return dict(sinks=self.sinks, softcap=self.logit_softcap or 0.0)


def _want(q, k, v, kc, vc, md, layer):
    nd, window = md.num_decodes, layer.sliding_window
    common = dict(softmax_scale=layer.scaling, sliding_window=window, **layer.kw)
    want = torch.empty_like(q)
    want[:nd] = ref.paged_attention_decode_ref(q[:nd], kc, vc, md.decode_block_tables, md.decode_context_lens, **common)
    if md.num_prefills:
        want[nd:] = ref.flash_attn_with_paged_prefix_ref(
            q[nd:], k[nd:], v[nd:], md.prefill_cu_seqlens, kc, vc, md.prefill_block_tables,
            md.prefill_prefix_lens, md.max_prefill_len, causal=True, **common,
        )  # fmt: skip
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("extras", list(EXTRAS))
def test_step_with_sinks_and_softcap(extras, window, dtype):
    (q, k, v), (k_cache, v_cache), md = _step(dtype, [9, 1, 17], [(0, 6), (5, 11), (12, 3)])
    layer = _Layer(window, extras, dtype)
    backend = PagedAttention([(k_cache.clone(), v_cache.clone())])
    backend.metadata = md
    with torch.no_grad():
        out = backend(q[None], k[None], v[None], layer)[0]
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM).clone(), v_cache.view(-1, KV_HEADS, DIM).clone()
    flat_k[md.slot_mapping], flat_v[md.slot_mapping] = k, v
    want = _want(q, k, v, flat_k.view_as(k_cache), flat_v.view_as(v_cache), md, layer)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)

    backend.query_rows, backend.query_rows_layer = torch.tensor([0, 4, 20]), 0  # the rows answered alone
    backend.kv_caches = [(k_cache.clone(), v_cache.clone())]
    with torch.no_grad():
        rows = backend(q[None], k[None], v[None], layer)[0]
    torch.testing.assert_close(rows.float(), want[[0, 4, 20]].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_quantized_kv_cache_with_sinks_and_softcap(extras):
    (q, k, v), (k_cache, v_cache), md = _step(torch.float32, [9, 1], [(5, 11)])
    pools = (quantize_kv(k_cache, "int8"), quantize_kv(v_cache, "int8"))
    layer = _Layer(None, extras)
    backend = PagedAttention([tuple(p.clone() for p in pools)], kv_cache_dtype="int8")
    backend.metadata = md
    with torch.no_grad():
        out = backend(q[None], k[None], v[None], layer)[0]
    kc, vc, md2 = write_and_read(k, v, *(p.clone() for p in pools), md, "int8", torch.float32)
    torch.testing.assert_close(out, _want(q, k, v, kc, vc, md2, layer), atol=1e-5, rtol=1e-5)


def _tree_step(prefix=10, block=4):
    """A root (the last real token) and 3 proposals: two children of the root, one grandchild."""
    g = torch.Generator().manual_seed(3)
    size, blocks = 4, [2, 5, 7, 1]
    k_cache, v_cache = (torch.randn(8, block, KV_HEADS, DIM, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = TreeGroup(row=0, size=size, block_table=blocks, prefix_len=prefix, depth=[0, 1, 1, 2], mask=mask)
    slots = torch.tensor([blocks[p // block] * block + p % block for p in range(prefix, prefix + size)])
    empty = torch.zeros(0, 1, dtype=torch.int32)
    md = AttentionMetadata(
        slot_mapping=slots,
        num_decodes=0,
        decode_block_tables=empty,
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32),
        prefill_block_tables=empty,
        prefill_prefix_lens=torch.zeros(0, dtype=torch.int32),
        max_prefill_len=0,
        trees=[tree],
    )
    q, k, v = torch.randn(size, HEADS, DIM, generator=g), *(torch.randn(size, KV_HEADS, DIM, generator=g) for _ in "kv")
    return (q, k, v), (k_cache, v_cache), md


@pytest.mark.parametrize("window", [None, 100])  # a window: the torch tree path (it binds nothing here)
@pytest.mark.parametrize("extras", list(EXTRAS))
def test_tree_with_sinks_and_softcap(extras, window):
    (q, k, v), (k_cache, v_cache), md = _tree_step()
    tree, layer = md.trees[0], _Layer(window, extras)
    backend = PagedAttention([(k_cache.clone(), v_cache.clone())])
    backend.metadata = md
    with torch.no_grad():
        out = backend(q[None], k[None], v[None], layer)[0]
    blocks = torch.tensor(tree.block_table)
    keys = torch.cat([k_cache[blocks].flatten(0, 1)[: tree.prefix_len], k])
    vals = torch.cat([v_cache[blocks].flatten(0, 1)[: tree.prefix_len], v])
    keep = torch.cat([torch.ones(tree.size, tree.prefix_len, dtype=torch.bool), tree.mask], 1)
    want = ref._attend(q, keys, vals, keep, layer.scaling, **layer.kw)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        direct = tree_attention(q, k, v, k_cache, v_cache, tree, layer.scaling, window, **layer.kw)
    torch.testing.assert_close(direct, want, atol=1e-5, rtol=1e-5)


def test_a_layer_without_the_attributes_still_works():
    """Before common.model.Attention has sinks / logit_softcap, the backend reads neither."""
    (q, k, v), (k_cache, v_cache), md = _step(torch.float32, [9], [(0, 6)])
    layer = _Layer(None, "sinks")
    del layer.sinks, layer.logit_softcap
    backend = PagedAttention([(k_cache.clone(), v_cache.clone())])
    backend.metadata = md
    out = backend(q[None], k[None], v[None], layer)[0]
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM).clone(), v_cache.view(-1, KV_HEADS, DIM).clone()
    flat_k[md.slot_mapping], flat_v[md.slot_mapping] = k, v
    plain = type("L", (), dict(sliding_window=None, scaling=layer.scaling, kw={}))()
    want = _want(q, k, v, flat_k.view_as(k_cache), flat_v.view_as(v_cache), md, plain)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
