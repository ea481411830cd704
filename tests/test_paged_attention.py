"""``piecewise_backend.ops``' paged decode attention and cache write, against SDPA over each row's own
keys: grouped heads, head sizes that are not powers of two, pages of several sizes, rows of length 0
(a padded row reads nothing); on CUDA the Triton kernels, also inside a CUDA graph replayed after
the lengths and block tables changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from piecewise_backend.ops import paged_cache_write, paged_decode_attention

CUDA = torch.cuda.is_available()


def _case(rows=3, heads=4, kv_heads=2, dim=16, page=4, pages=24, width=5, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g).to(device, dtype)
    k_cache = torch.randn(pages, page, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(pages, page, kv_heads, dim, generator=g).to(device, dtype)
    tables = torch.randperm(pages, generator=g)[: rows * width].view(rows, width).to(device, torch.int32)
    lens = torch.randint(1, width * page + 1, (rows,), generator=g).to(device)
    lens[-1] = 0  # a padded row
    return q, k_cache, v_cache, tables, lens


def _expected(q, k_cache, v_cache, tables, lens):
    """SDPA over each row's keys, gathered page by page (a row with no keys: zeros)."""
    page = k_cache.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    for row in range(q.shape[0]):
        n = int(lens[row])
        if n == 0:
            continue
        slots = [int(tables[row, i // page]) * page + i % page for i in range(n)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].float().transpose(0, 1)  # [kv_heads, n, dim]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].float().transpose(0, 1)
        out[row] = F.scaled_dot_product_attention(q[row].float()[:, None], keys, values, enable_gqa=True)[:, 0]
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,dim,page", [(4, 2, 16, 4), (6, 1, 24, 8), (4, 4, 8, 16)], ids=["gqa", "mqa-head24", "mha"]
)
def test_paged_decode_attention_matches_sdpa_over_each_rows_keys(heads, kv_heads, dim, page):
    q, k_cache, v_cache, tables, lens = _case(heads=heads, kv_heads=kv_heads, dim=dim, page=page, pages=40)
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(got, _expected(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[-1]) == 0  # length 0: nothing read, zeros out


def test_out_is_written_in_place_and_rows_past_q_are_not_read():
    q, k_cache, v_cache, tables, lens = _case()
    wide_tables = torch.cat([tables, torch.full((2, tables.shape[1]), 10**6, dtype=tables.dtype)])  # garbage rows
    out = torch.full((q.shape[0], q.shape[1], q.shape[2] * 2), 7.0)[..., ::2]  # strided out
    got = paged_decode_attention(q, k_cache, v_cache, wide_tables, torch.cat([lens, lens[:2]]), out=out)
    assert got is out
    torch.testing.assert_close(out, _expected(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused_with_what_is_expected():
    q, k_cache, v_cache, tables, lens = _case()
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens)
    with pytest.raises(ValueError, match=r"block_tables must be \[>= 3"):
        paged_decode_attention(q, k_cache, v_cache, tables[:2], lens)
    with pytest.raises(TypeError, match="integer"):
        paged_decode_attention(q, k_cache, v_cache, tables.float(), lens)


def test_paged_cache_write_stores_rows_at_their_slots_and_skips_slot_minus_one():
    _, k_cache, v_cache, _, _ = _case()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    paged_cache_write(k, v, k_cache, v_cache, torch.tensor([5, -1, 17]))
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    torch.testing.assert_close(flat_k[[5, 17]], k[[0, 2]])
    torch.testing.assert_close(flat_v[[5, 17]], v[[0, 2]])
    untouched = [i for i in range(flat_k.shape[0]) if i not in (5, 17)]
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, 16)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, 16)[untouched])


@pytest.mark.cuda
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page,width,dtype",
    [
        (12, 2, 128, 16, 80, torch.bfloat16),  # Qwen2.5-1.5B's heads, a long table: chunks of several blocks
        (8, 8, 64, 16, 4, torch.float32),
        (6, 2, 80, 32, 6, torch.float16),  # head size 80 (not a power of two), pages of 32
        (32, 8, 96, 8, 40, torch.bfloat16),
    ],
    ids=["qwen", "mha-fp32", "head80", "head96"],
)
def test_cuda_kernels_match_the_reference(heads, kv_heads, dim, page, width, dtype):
    q, k_cache, v_cache, tables, lens = _case(
        rows=5,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        page=page,
        pages=5 * width + 3,
        width=width,
        dtype=dtype,
        device="cuda",
    )
    lens[0] = width * page  # a full table
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _expected(q, k_cache, v_cache, tables, lens), atol=tol, rtol=tol)
    assert torch.count_nonzero(got[-1]) == 0
    k, v = (
        torch.randn(5, kv_heads, dim, device="cuda", dtype=dtype),
        torch.randn(5, kv_heads, dim, device="cuda", dtype=dtype),
    )
    slots = torch.tensor([3, -1, page * 2 + 1, -1, 0], device="cuda")
    k_ref, v_ref = k_cache.cpu().float(), v_cache.cpu().float()
    paged_cache_write(k.cpu().float(), v.cpu().float(), k_ref, v_ref, slots.cpu())
    paged_cache_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.cpu().float(), k_ref) and torch.equal(v_cache.cpu().float(), v_ref)


@pytest.mark.cuda
def test_cuda_kernels_in_a_graph_read_new_lengths_and_tables_at_replay():
    q, k_cache, v_cache, tables, lens = _case(
        rows=4, heads=4, kv_heads=2, dim=64, page=16, pages=64, width=8, device="cuda"
    )
    out = torch.empty_like(q)
    paged_decode_attention(q, k_cache, v_cache, tables, lens, out=out)  # warm-up: compiles the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, out=out)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        tables.copy_(torch.randperm(64, generator=g)[:32].view(4, 8))
        lens.copy_(torch.randint(0, 129, (4,), generator=g))
        graph.replay()
        torch.testing.assert_close(out, _expected(q, k_cache, v_cache, tables, lens), atol=1e-4, rtol=1e-4)
