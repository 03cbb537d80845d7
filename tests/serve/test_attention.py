"""The serving attention backend over one packed step (decode rows, then prefill chunks, some with a
cached prefix), against the torch references of kernels/reference.py: on CPU the whole step goes
through the C++ decode kernel (a chunk's tokens as decode rows), elsewhere through the dispatchers."""

import pytest
import torch
from baton.kernels.reference import flash_attn_with_paged_prefix_ref, paged_attention_decode_ref
from baton.serve.runner.attention import AttentionMetadata, PagedAttention

BLOCK, HEADS, KV_HEADS, DIM = 4, 8, 2, 64


class _Layer:  # the attributes PagedAttention reads from an Attention module
    layer_idx, scaling = 0, DIM**-0.5

    def __init__(self, window):
        self.sliding_window = window


def _step(dtype, decode_lens, chunks, seed=0):
    """Pools holding every sequence's cached tokens, and the step's q/k/v + metadata. decode_lens:
    context lengths (the new token included); chunks: (prefix, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    seqs = [(n - 1, 1) for n in decode_lens] + list(chunks)
    blocks = [list(range(1 + 8 * i, 1 + 8 * i + (p + n + BLOCK - 1) // BLOCK)) for i, (p, n) in enumerate(seqs)]
    k_cache, v_cache = rnd(1 + 8 * len(seqs), BLOCK, KV_HEADS, DIM), rnd(1 + 8 * len(seqs), BLOCK, KV_HEADS, DIM)
    slots = [t[pos // BLOCK] * BLOCK + pos % BLOCK for t, (p, n) in zip(blocks, seqs) for pos in range(p, p + n)]
    tokens = len(slots)

    def table(ts):
        w = max((len(t) for t in ts), default=0)
        return torch.tensor([t + [0] * (w - len(t)) for t in ts], dtype=torch.int32).view(len(ts), w)

    nd = len(decode_lens)
    cu = [0]
    for _, n in chunks:
        cu.append(cu[-1] + n)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=nd,
        decode_block_tables=table(blocks[:nd]),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
        prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        prefill_block_tables=table(blocks[nd:]),
        prefill_prefix_lens=torch.tensor([p for p, _ in chunks], dtype=torch.int32),
        max_prefill_len=max((n for _, n in chunks), default=0),
    )
    return (rnd(tokens, HEADS, DIM), rnd(tokens, KV_HEADS, DIM), rnd(tokens, KV_HEADS, DIM)), (k_cache, v_cache), md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "decode_lens, chunks",
    [([], [(0, 7), (0, 1), (0, 13)]), ([9, 1, 17], [(0, 6), (5, 11), (12, 3)]), ([3, 30], [])],
    ids=["chunks", "mixed", "decodes"],
)
def test_step_matches_references(dtype, window, decode_lens, chunks):
    (q, k, v), (k_cache, v_cache), md = _step(dtype, decode_lens, chunks)
    pools = (k_cache.clone(), v_cache.clone())
    backend = PagedAttention([pools])
    backend.metadata = md
    out = backend(q[None], k[None], v[None], _Layer(window))[0]

    # the references get the pools as the backend found them, with the step's K/V written
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, DIM).clone(), v_cache.view(-1, KV_HEADS, DIM).clone()
    flat_k[md.slot_mapping], flat_v[md.slot_mapping] = k, v
    kc, vc = flat_k.view_as(k_cache), flat_v.view_as(v_cache)
    assert torch.equal(pools[0], kc) and torch.equal(pools[1], vc)  # the backend wrote them
    nd, scale = md.num_decodes, DIM**-0.5
    want = torch.empty_like(q)
    want[:nd] = paged_attention_decode_ref(
        q[:nd], kc, vc, md.decode_block_tables, md.decode_context_lens, softmax_scale=scale, sliding_window=window
    )
    if chunks:
        want[nd:] = flash_attn_with_paged_prefix_ref(
            q[nd:], k[nd:], v[nd:], md.prefill_cu_seqlens, kc, vc, md.prefill_block_tables,
            md.prefill_prefix_lens, md.max_prefill_len, causal=True, sliding_window=window, softmax_scale=scale,
        )  # fmt: skip
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def test_rows_over_cache_lists_each_chunk_token_as_a_decode_row():
    _, _, md = _step(torch.float32, [9, 1], [(0, 3), (5, 2)])
    tables, lens = md.rows_over_cache
    assert lens.tolist() == [9, 1, 1, 2, 3, 6, 7]
    assert tables.dtype == torch.int32 and tables.shape[0] == 7
    for row, seq_table in zip(tables.tolist(), [md.decode_block_tables[0], md.decode_block_tables[1]]):
        assert row[: seq_table.numel()] == seq_table.tolist()
    assert tables[2:5].tolist() == [tables[2].tolist()] * 3 and tables[5].tolist() == tables[6].tolist()
    assert tables[5].tolist()[: md.prefill_block_tables.shape[1]] == md.prefill_block_tables[1].tolist()
