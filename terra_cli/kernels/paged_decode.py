"""Paged decode attention over an fp8 (or 16-bit) KV cache, for Terra's shapes.

One query token per sequence attends to that sequence's whole cache, read page by page through
the block table in vLLM's layout: `key_cache[block, slot, kv_head, dim]` (a view of the
`(blocks, 2, block_size, kv_heads, head_dim)` tensor, strides taken as given). A program owns one
sequence, one KV head and one split of the sequence: it loads the KV head's query group once
(Terra: 8 query heads per KV head, padded to the 16 rows a tensor-core product needs), streams
its share of the cache tile by tile, converting fp8 to fp16 in registers, and keeps an online
softmax. With more than one split, a second kernel merges the splits by their log-sum-exp.

Why not FlashAttention-3 for this: with many long rollouts a decode step is almost all KV reads,
and FA3's fp8 path read them at half the copy rate on an H200 (benchmarks/README.md, issue 28),
so an fp8 cache bought capacity but no speed. Here the bytes read are the cost: each KV byte is
read once, converted once and used by all 8 query heads of its group.

Numerics: scores and the value sum accumulate in fp32; the query is used as given (bf16/fp16, or
fp8 with its scale), probabilities enter the value product as fp16. Splits are a function of the
batch size only, so a CUDA graph captured for a batch size stays valid for any context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference below still works; the kernel needs Triton
    triton = None

MAX_SPLITS = 64
TILE = 32  # cache tokens per loop step of the all-heads program: 8 KB of fp8 K and V


@dataclass(frozen=True)
class DecodePlan:
    """How one decode launch is cut: `program` "all-heads" (a program per sequence and split,
    every KV head) or "per-head" (a program per sequence, KV head and split), and its tiling."""

    program: str
    splits: int
    tile: int
    warps: int = 4
    stages: int = 3


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def decode_plan(num_seqs: int, num_kv_heads: int, sm_count: int) -> DecodePlan:
    """The launch for a batch, from its size alone (a CUDA graph captured for one batch size
    replays for any context length). Many sequences: all heads per program, about 16 programs
    per SM, so long and short contexts even out; a few: a program per head and many splits, so a
    single rollout still spreads over the GPU (benchmarks/README.md, issue 28, has the sweep)."""
    if num_seqs >= 16:
        return DecodePlan("all-heads", min(MAX_SPLITS, _pow2_floor(16 * sm_count // max(1, num_seqs))), TILE)
    programs = max(1, num_seqs * num_kv_heads)
    return DecodePlan("per-head", min(MAX_SPLITS, _pow2_floor(2 * sm_count // programs)), 64)


def workspace_rows(max_seqs: int, num_kv_heads: int, sm_count: int) -> int:
    """Sequences x splits of the largest split launch up to `max_seqs` sequences (partials are
    kept per query head: multiply by the heads)."""
    return max(n * decode_plan(n, num_kv_heads, sm_count).splits for n in range(1, max(1, max_seqs) + 1))


@dataclass
class PrefillRows:
    """The requests of a mixed batch that are not single-token decodes (a prompt, or its uncached
    tail): their query rows and their own cu_seqlens, lengths and block tables, for another kernel."""

    token_index: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int


def prefill_rows(query_start_loc_cpu: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                 device) -> PrefillRows | None:
    """`query_start_loc_cpu` (requests + 1, on the host); `seq_lens`, `block_table` on the device.
    None when every request is a single-token decode (or empty)."""
    lengths = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    requests = torch.nonzero(lengths > 1).flatten()
    if requests.numel() == 0:
        return None
    counts = lengths[requests]
    starts = query_start_loc_cpu[:-1][requests]
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    token_index = torch.repeat_interleave(starts, counts) + offsets
    cumulative = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    cumulative[1:] = torch.cumsum(counts, 0)
    on_device = requests.to(device, non_blocking=True)
    return PrefillRows(token_index=token_index.to(device, non_blocking=True),
                       query_start_loc=cumulative.to(device, non_blocking=True),
                       seq_lens=seq_lens.index_select(0, on_device),
                       block_table=block_table.index_select(0, on_device),
                       max_query_len=int(counts.max()))


if triton is not None:

    @triton.jit
    def _paged_decode_per_head(
        q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        stride_q_tok, stride_q_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_bt, stride_o_tok, stride_o_head,
        scale_log2, q_scale_ptr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, Q_IS_FP8: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        token = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - token != 1:
            return  # a prefill (another kernel's) or a padded slot with no query
        seq_len = tl.load(seq_lens_ptr + seq)

        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
        if Q_IS_FP8:
            qk_scale = qk_scale * tl.load(q_scale_ptr)
        q = q.to(tl.float16)

        num_tiles = tl.cdiv(seq_len, TILE_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, num_tiles)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        cols = tl.arange(0, TILE_N)
        table = block_table_ptr + seq * stride_bt
        for tile in range(first, last):
            pos = tile * TILE_N + cols
            valid = pos < seq_len
            block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = pos % PAGE
            k = tl.load(k_ptr + (block * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head)[:, None]
                        + dims[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (block * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head)[:, None]
                        + dims[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            m = m_new

        # A split with no tile (or an empty sequence) has l == 0: its output is 0, its weight 0.
        seen = l > 0
        o = acc * (tl.load(v_scale_ptr) / tl.where(seen, l, 1.0))[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # Partials: (seq, head, split, dim) and the split's log2-sum-exp.
            part = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=row_ok[:, None])
            lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)

    @triton.jit
    def _paged_decode_all_heads(
        q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
        out_ptr, part_out_ptr, part_lse_ptr,
        stride_q_tok, stride_q_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_bt, stride_o_tok, stride_o_head,
        scale_log2, q_scale_ptr,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, Q_IS_FP8: tl.constexpr,
    ):
        # One program, every KV head of a sequence: a cache token's heads lie side by side (256
        # bytes in fp8), so each tile is read as whole contiguous pages instead of 64-byte pieces.
        seq = tl.program_id(0)
        split = tl.program_id(1)
        token = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - token != 1:
            return
        seq_len = tl.load(seq_lens_ptr + seq)

        kvh = tl.arange(0, KV_HEADS)[:, None, None]
        rows = tl.arange(0, GROUP_PAD)[None, :, None]
        dims = tl.arange(0, HEAD_DIM)[None, None, :]
        heads = kvh * GROUP + rows  # (KV_HEADS, GROUP_PAD, 1)
        row_ok = rows < GROUP
        q = tl.load(q_ptr + token * stride_q_tok + heads * stride_q_head + dims, mask=row_ok, other=0.0)
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
        if Q_IS_FP8:
            qk_scale = qk_scale * tl.load(q_scale_ptr)
        q = q.to(tl.float16)

        num_tiles = tl.cdiv(seq_len, TILE_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, num_tiles)

        m = tl.full([KV_HEADS, GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([KV_HEADS, GROUP_PAD], tl.float32)
        acc = tl.zeros([KV_HEADS, GROUP_PAD, HEAD_DIM], tl.float32)
        cols = tl.arange(0, TILE_N)[None, :, None]  # cache tokens: (1, TILE_N, 1)
        table = block_table_ptr + seq * stride_bt
        for tile in range(first, last):
            pos = tile * TILE_N + cols
            valid = pos < seq_len
            block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = pos % PAGE
            k = tl.load(k_ptr + block * stride_k_block + slot * stride_k_slot + kvh * stride_k_head + dims,
                        mask=valid, other=0.0)  # (KV_HEADS, TILE_N, HEAD_DIM)
            s = tl.dot(q, tl.trans(k.to(tl.float16), (0, 2, 1))) * qk_scale  # (KV_HEADS, GROUP_PAD, TILE_N)
            s = tl.where(tl.reshape(valid, (1, 1, TILE_N)), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 2))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, :, None])
            l = l * alpha + tl.sum(p, 2)
            v = tl.load(v_ptr + block * stride_v_block + slot * stride_v_slot + kvh * stride_v_head + dims,
                        mask=valid, other=0.0)
            acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            m = m_new

        seen = l > 0
        o = acc * (tl.load(v_scale_ptr) / tl.where(seen, l, 1.0))[:, :, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + token * stride_o_tok + heads * stride_o_head + dims, o.to(out_ptr.dtype.element_ty),
                     mask=row_ok)
        else:
            part = (seq * (KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
            tl.store(part_out_ptr + part * HEAD_DIM + dims, o, mask=row_ok)
            lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
            part2 = (seq * (KV_HEADS * GROUP) + tl.reshape(heads, (KV_HEADS, GROUP_PAD))) * NUM_SPLITS + split
            tl.store(part_lse_ptr + part2, lse, mask=tl.reshape(row_ok, (1, GROUP_PAD)))

    @triton.jit
    def _paged_decode_merge(
        part_out_ptr, part_lse_ptr, query_start_ptr, out_ptr, stride_o_tok, stride_o_head,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        token = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - token != 1:
            return
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
        lse = tl.load(part_lse_ptr + part)
        top = tl.max(lse, 0)
        seen = lse > float("-inf")
        weight = tl.where(seen, tl.exp2(lse - tl.where(seen, top, 0.0)), 0.0)
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :])
        total = tl.sum(weight, 0)
        merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, merged.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of every sequence whose query length is 1 (per `query_start_loc`); rows of other
    sequences in `out` are left as they are. `query`, `out`: (tokens, heads, head_dim);
    `key_cache`, `value_cache`: (blocks, block_size, kv_heads, head_dim), fp8 or 16-bit;
    `k_scale`, `v_scale`, `q_scale` (for an fp8 query): one-element float32 tensors, read on the
    device so a captured graph sees a changed scale. `plan`: `decode_plan` for the batch when
    None. `workspace`: (partial outputs, partial lse), at least sequences x splits x heads
    (x head_dim) float32, allocated here when None and the plan splits."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = query.shape
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged decode: {num_heads} heads over {num_kv_heads} KV heads of size {head_dim}")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged decode: the head dimension must be contiguous")
    if plan is None:
        plan = decode_plan(num_seqs, num_kv_heads, torch.cuda.get_device_properties(query.device).multi_processor_count
                           if query.is_cuda else 1)
    splits = plan.splits
    if splits & (splits - 1) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"paged decode: splits must be a power of two up to {MAX_SPLITS}")
    if splits > 1:
        if workspace is None:
            rows = num_seqs * num_heads * splits
            workspace = (torch.empty(rows * head_dim, device=query.device, dtype=torch.float32),
                         torch.empty(rows, device=query.device, dtype=torch.float32))
        part_out, part_lse = workspace
    else:
        part_out = part_lse = out  # not read
    q_is_fp8 = query.element_size() == 1
    args = (query, key_cache, value_cache, block_table, seq_lens, query_start_loc, k_scale, v_scale,
            out, part_out, part_lse,
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table.stride(0), out.stride(0), out.stride(1),
            scale * math.log2(math.e), q_scale if q_is_fp8 else k_scale)
    shapes = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
                  TILE_N=plan.tile, NUM_SPLITS=splits, Q_IS_FP8=q_is_fp8, num_warps=plan.warps,
                  num_stages=plan.stages)
    if plan.program == "all-heads":
        _paged_decode_all_heads[(num_seqs, splits)](*args, KV_HEADS=num_kv_heads, **shapes)
    elif plan.program == "per-head":
        _paged_decode_per_head[(num_seqs, num_kv_heads, splits)](*args, **shapes)
    else:
        raise ValueError(f"paged decode: unknown program {plan.program!r}")
    if splits > 1:
        _paged_decode_merge[(num_seqs, num_heads)](part_out, part_lse, query_start_loc, out, out.stride(0), out.stride(1),
                                             HEAD_DIM=head_dim, NUM_SPLITS=splits, num_warps=1)
    return out


def mixed_batch_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, *,
                          prefill: PrefillRows | None, prompt_attention, **decode_options) -> torch.Tensor:
    """A step's attention: the rows in `prefill` through `prompt_attention(query_rows, prefill)`
    (returns their output rows), every single-token decode through `paged_decode_attention`."""
    if prefill is not None:
        out.index_copy_(0, prefill.token_index, prompt_attention(query.index_select(0, prefill.token_index), prefill))
    return paged_decode_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out,
                                  **decode_options)


def paged_decode_reference(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
                           scale: float, k_scale: float = 1.0, v_scale: float = 1.0, q_scale: float = 1.0):
    """The same attention in float64 on gathered pages: (tokens, heads, head_dim), with NaN in the
    rows of sequences whose query length is not 1."""
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.full(query.shape, float("nan"), dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        token = starts[seq]
        if starts[seq + 1] - token != 1:
            continue
        if seq_len == 0:
            out[token] = 0
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_table[seq, positions // key_cache.shape[1]].long()
        slots = positions % key_cache.shape[1]
        k = _gather(key_cache, blocks, slots).repeat_interleave(group, dim=1) * k_scale  # (len, heads, dim)
        v = _gather(value_cache, blocks, slots).repeat_interleave(group, dim=1) * v_scale
        q = query[token].double() * q_scale
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
        out[token] = torch.einsum("hn,nhd->hd", weights, v)
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if cache.element_size() == 1:  # index fp8 as bytes: not every device indexes float8 tensors
        return cache.view(torch.uint8)[blocks, slots].view(cache.dtype).double()
    return cache[blocks, slots].double()
