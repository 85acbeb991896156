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
ROWS = 16  # query rows per KV head in a program: the smallest tensor-core tile
# Programs along the queries x splits at most, so the split partials have a fixed-size workspace.
WORKSPACE_BLOCKS = 4096


@dataclass(frozen=True)
class DecodePlan:
    """How one launch is cut: `program` "all-heads" (a program per query block and split, every
    KV head) or "per-head" (a program per query block, KV head and split), and its tiling."""

    program: str
    splits: int
    tile: int
    warps: int = 4
    stages: int = 3


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def decode_plan(num_seqs: int, num_kv_heads: int, sm_count: int, query_blocks: int | None = None) -> DecodePlan:
    """The launch for a batch, from its shape alone (a CUDA graph captured for one batch size
    replays for any context length). Many sequences: all heads per program, about 16 programs
    per SM, so long and short contexts even out; a few: a program per head and many splits, so a
    single rollout still spreads over the GPU (benchmarks/README.md, issue 28, has the sweep).
    `query_blocks`: programs along the queries, when not one per sequence (chunked prompts)."""
    blocks = max(1, query_blocks or num_seqs)
    if num_seqs >= 8:
        plan = DecodePlan("all-heads", min(MAX_SPLITS, _pow2_floor(16 * sm_count // num_seqs)), TILE)
    else:
        plan = DecodePlan("per-head", min(MAX_SPLITS, _pow2_floor(2 * sm_count // (num_seqs * num_kv_heads))), 64)
    splits = min(plan.splits, _pow2_floor(WORKSPACE_BLOCKS // blocks)) if blocks <= WORKSPACE_BLOCKS else 1
    return DecodePlan(plan.program, splits, plan.tile, plan.warps, plan.stages)


def query_rows(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(group rows, query tokens) per KV head in a program: a KV head's query heads padded to a
    power of two, and as many query tokens as fill `ROWS` (Terra: 8 heads x 2 tokens)."""
    group = triton.next_power_of_2(num_heads // num_kv_heads) if triton else 1 << (num_heads // num_kv_heads - 1).bit_length()
    return group, max(1, ROWS // group)


def make_workspace(num_heads: int, num_kv_heads: int, head_dim: int, device) -> tuple[torch.Tensor, ...]:
    """Scratch for any launch: split partials (outputs, log-sum-exps) float32, and each query
    block's request (int32)."""
    group, chunk = query_rows(num_heads, num_kv_heads)
    entries = WORKSPACE_BLOCKS * num_kv_heads * group * chunk
    return (torch.empty(entries * head_dim, dtype=torch.float32, device=device),
            torch.empty(entries, dtype=torch.float32, device=device),
            torch.empty(WORKSPACE_BLOCKS, dtype=torch.int32, device=device))


@dataclass
class PrefillRows:
    """The requests of a batch that are not single-token decodes (a prompt, or its uncached
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
    def _block_requests(query_start_ptr, block_seq_ptr, num_seqs, num_blocks, CHUNK: tl.constexpr):
        # Request r's query blocks are numbered from start[r] // CHUNK + r: one per CHUNK query
        # tokens, then a gap up to the next request's first block. Program r writes r into its
        # blocks and -1 into its gap (the last request: up to the launch's last block).
        seq = tl.program_id(0)
        q_start = tl.load(query_start_ptr + seq)
        q_end = tl.load(query_start_ptr + seq + 1)
        first = q_start // CHUNK + seq
        owned = tl.cdiv(q_end - q_start, CHUNK)
        end = tl.where(seq + 1 < num_seqs, q_end // CHUNK + seq + 1, num_blocks)
        for block in range(first, end):
            tl.store(block_seq_ptr + block, tl.where(block < first + owned, seq, -1))

    @triton.jit
    def _query_block(query_start_ptr, block_seq_ptr, block, CHUNKED: tl.constexpr, CHUNK: tl.constexpr):
        """(request or -1 for a gap, its first query token in this block, query start, query
        length). Chunked: from the block's request in `block_seq`; otherwise block r is request r."""
        seq = block
        if CHUNKED:
            seq = tl.load(block_seq_ptr + block)
        safe = tl.maximum(seq, 0)
        q_start = tl.load(query_start_ptr + safe)
        q_len = tl.load(query_start_ptr + safe + 1) - q_start
        first = (block - (q_start // CHUNK + safe)) * CHUNK if CHUNKED else block * 0
        return seq, first, q_start, q_len

    @triton.jit
    def _paged_attention(
        q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr, q_scale_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, block_seq_ptr,
        stride_q_tok, stride_q_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_bt, stride_o_tok, stride_o_head,
        scale_log2,
        KV_HEADS: tl.constexpr, KV_PER_PROGRAM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, Q_IS_FP8: tl.constexpr, CHUNKED: tl.constexpr,
    ):
        # A program: CHUNK query tokens of one request (each a row per query head of its KV heads),
        # KV_PER_PROGRAM KV heads (all of them: a cache token's heads lie side by side, 256 bytes in
        # fp8, so tiles are read as whole contiguous pages), one split of the cache.
        block = tl.program_id(0)
        split = tl.program_id(2)
        seq, first, q_start, q_len = _query_block(query_start_ptr, block_seq_ptr, block, CHUNKED, CHUNK)
        if CHUNKED:
            if seq < 0:
                return  # a gap in the block numbering
        elif q_len != 1:
            return  # a prompt: another kernel's rows (or a padded slot with no query)
        seq_len = tl.load(seq_lens_ptr + seq)

        kvh = tl.program_id(1) * KV_PER_PROGRAM + tl.arange(0, KV_PER_PROGRAM)[:, None, None]
        rows = tl.arange(0, CHUNK * GROUP_PAD)[None, :, None]
        dims = tl.arange(0, HEAD_DIM)[None, None, :]
        token = first + rows // GROUP_PAD  # within the request's query
        head = rows % GROUP_PAD
        row_ok = (head < GROUP) & (token < q_len)
        heads = kvh * GROUP + head
        visible = seq_len - q_len + token + 1  # causal: cache tokens each row attends to
        q = tl.load(q_ptr + (q_start + token) * stride_q_tok + heads * stride_q_head + dims, mask=row_ok, other=0.0)
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
        if Q_IS_FP8:
            qk_scale = qk_scale * tl.load(q_scale_ptr)
        q = q.to(tl.float16)

        span = seq_len - q_len + tl.minimum(first + CHUNK, q_len)  # what the block's last row sees
        num_tiles = tl.cdiv(span, TILE_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_first = split * per_split
        tile_last = tl.minimum(tile_first + per_split, num_tiles)

        m = tl.full([KV_PER_PROGRAM, CHUNK * GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([KV_PER_PROGRAM, CHUNK * GROUP_PAD], tl.float32)
        acc = tl.zeros([KV_PER_PROGRAM, CHUNK * GROUP_PAD, HEAD_DIM], tl.float32)
        cols = tl.arange(0, TILE_N)[None, :, None]  # cache tokens: (1, TILE_N, 1)
        seen_by = tl.reshape(visible, (1, CHUNK * GROUP_PAD, 1))
        table = block_table_ptr + seq * stride_bt
        for tile in range(tile_first, tile_last):
            pos = tile * TILE_N + cols
            valid = pos < span
            page = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = pos % PAGE
            k = tl.load(k_ptr + page * stride_k_block + slot * stride_k_slot + kvh * stride_k_head + dims,
                        mask=valid, other=0.0)  # (KV_PER_PROGRAM, TILE_N, HEAD_DIM)
            s = tl.dot(q, tl.trans(k.to(tl.float16), (0, 2, 1))) * qk_scale  # (KV_PER_PROGRAM, rows, TILE_N)
            s = tl.where(tl.reshape(pos, (1, 1, TILE_N)) < seen_by, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 2))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays empty
            alpha = tl.exp2(m - base)
            p = tl.exp2(s - base[:, :, None])
            l = l * alpha + tl.sum(p, 2)
            v = tl.load(v_ptr + page * stride_v_block + slot * stride_v_slot + kvh * stride_v_head + dims,
                        mask=valid, other=0.0)
            acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
            m = m_new

        # A split with no tile (or an empty sequence) has l == 0: its output is 0, its weight 0.
        seen = l > 0
        o = acc * (tl.load(v_scale_ptr) / tl.where(seen, l, 1.0))[:, :, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + (q_start + token) * stride_o_tok + heads * stride_o_head + dims,
                     o.to(out_ptr.dtype.element_ty), mask=row_ok)
        else:  # partials (block, KV head, row, split)
            entry = ((block * KV_HEADS + kvh) * (CHUNK * GROUP_PAD) + rows) * NUM_SPLITS + split
            tl.store(part_out_ptr + entry * HEAD_DIM + dims, o, mask=row_ok)
            lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + tl.reshape(entry, (KV_PER_PROGRAM, CHUNK * GROUP_PAD)), lse,
                     mask=tl.reshape(row_ok, (1, CHUNK * GROUP_PAD)))

    @triton.jit
    def _paged_attention_merge(
        part_out_ptr, part_lse_ptr, query_start_ptr, block_seq_ptr, out_ptr, stride_o_tok, stride_o_head,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK: tl.constexpr,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNKED: tl.constexpr,
    ):
        # One program per query row (block, KV head, row): its splits, merged by log-sum-exp.
        block = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.program_id(2)
        seq, first, q_start, q_len = _query_block(query_start_ptr, block_seq_ptr, block, CHUNKED, CHUNK)
        token = first + row // GROUP_PAD
        if CHUNKED:
            if seq < 0 or token >= q_len:
                return
        elif q_len != 1 or token > 0:
            return
        if row % GROUP_PAD >= GROUP:
            return
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        entry = ((block * KV_HEADS + kvh) * (CHUNK * GROUP_PAD) + row) * NUM_SPLITS + splits
        lse = tl.load(part_lse_ptr + entry)
        top = tl.max(lse, 0)
        seen = lse > float("-inf")
        weight = tl.where(seen, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)), 0.0)
        o = tl.load(part_out_ptr + entry[:, None] * HEAD_DIM + dims[None, :], mask=seen[:, None], other=0.0)
        total = tl.sum(weight, 0)
        merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        head = kvh * GROUP + row % GROUP_PAD
        tl.store(out_ptr + (q_start + token) * stride_o_tok + head * stride_o_head + dims,
                 merged.to(out_ptr.dtype.element_ty))


def paged_attention(
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
    decode_only: bool = False,
    plan: DecodePlan | None = None,
    sm_count: int | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged cache (the cache already
    holds the rows' own keys and values): decodes, and prompts chunked CHUNK tokens per program,
    each program reading the cache once for its rows. `decode_only`: only sequences whose query is
    one token, the others' rows left as they are (for a batch whose prompts another kernel runs).
    `query`, `out`: (tokens, heads, head_dim); `key_cache`, `value_cache`: (blocks, block_size,
    kv_heads, head_dim), fp8 or 16-bit; `k_scale`, `v_scale`, `q_scale` (an fp8 query): one-element
    float32 tensors, read on the device so a captured graph sees a changed scale. `plan`:
    `decode_plan` for the batch (on `sm_count` SMs, the device's when None) when None.
    `workspace`: `make_workspace(...)`, made when None."""
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"paged attention: {num_heads} heads over {num_kv_heads} KV heads of size {head_dim}")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged attention: the head dimension must be contiguous")
    group_pad, chunk = query_rows(num_heads, num_kv_heads)
    blocks = num_seqs if decode_only else num_tokens // chunk + num_seqs
    if plan is None:
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 1
        plan = decode_plan(num_seqs, num_kv_heads, sm_count, blocks)
    splits = plan.splits
    if splits & (splits - 1) or not 1 <= splits <= MAX_SPLITS or (splits > 1 and blocks * splits > WORKSPACE_BLOCKS):
        raise ValueError(f"paged attention: {splits} splits (a power of two up to {MAX_SPLITS}, "
                         f"at most {WORKSPACE_BLOCKS} blocks x splits)")
    if not decode_only and blocks > WORKSPACE_BLOCKS:
        raise ValueError(f"paged attention: {num_tokens} query tokens are more than a chunked launch takes; "
                         "send the prompts to another kernel (decode_only=True)")
    part_out, part_lse, block_seq = workspace or make_workspace(num_heads, num_kv_heads, head_dim, query.device)
    if not decode_only:
        _block_requests[(num_seqs,)](query_start_loc, block_seq, num_seqs, blocks, CHUNK=chunk)
    per_program = num_kv_heads if plan.program == "all-heads" else 1
    if plan.program not in ("all-heads", "per-head"):
        raise ValueError(f"paged attention: unknown program {plan.program!r}")
    q_is_fp8 = query.element_size() == 1
    shapes = dict(KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad, CHUNK=chunk,
                  HEAD_DIM=head_dim, NUM_SPLITS=splits, CHUNKED=not decode_only)
    _paged_attention[(blocks, num_kv_heads // per_program, splits)](
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc, k_scale, v_scale,
        q_scale if q_is_fp8 else k_scale, out, part_out, part_lse, block_seq,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        KV_PER_PROGRAM=per_program, PAGE=page, TILE_N=plan.tile, Q_IS_FP8=q_is_fp8, **shapes,
        num_warps=plan.warps, num_stages=plan.stages)
    if splits > 1:
        _paged_attention_merge[(blocks, num_kv_heads, chunk * group_pad)](
            part_out, part_lse, query_start_loc, block_seq, out, out.stride(0), out.stride(1), **shapes, num_warps=1)
    return out


def split_batch_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, *,
                          prefill: PrefillRows | None, prompt_attention, **options) -> torch.Tensor:
    """A large prompt batch (run eagerly): the rows in `prefill` through
    `prompt_attention(query_rows, prefill)` (returns their output rows), whose cost grows with the
    prompt only once, every single-token decode through `paged_attention`."""
    if prefill is not None:
        out.index_copy_(0, prefill.token_index, prompt_attention(query.index_select(0, prefill.token_index), prefill))
    return paged_attention(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out,
                           decode_only=True, **options)


def paged_attention_reference(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, *,
                              scale: float, k_scale: float = 1.0, v_scale: float = 1.0, q_scale: float = 1.0,
                              decode_only: bool = False):
    """The same attention in float64 on gathered pages: (tokens, heads, head_dim). Query token t of a
    request with q_len query tokens sees cache tokens [0, seq_len - q_len + t]. `decode_only`: NaN
    in the rows of requests whose query is not one token."""
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.full(query.shape, float("nan"), dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_len = starts[seq], starts[seq + 1] - starts[seq]
        if q_len == 0 or (decode_only and q_len != 1):
            continue
        if seq_len == 0:
            out[q_start:q_start + q_len] = 0
            continue
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_table[seq, positions // key_cache.shape[1]].long()
        slots = positions % key_cache.shape[1]
        k = _gather(key_cache, blocks, slots).repeat_interleave(group, dim=1) * k_scale  # (len, heads, dim)
        v = _gather(value_cache, blocks, slots).repeat_interleave(group, dim=1) * v_scale
        for t in range(q_len):
            seen = seq_len - q_len + t + 1
            q = query[q_start + t].double() * q_scale
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q, k[:seen]) * scale, dim=-1)
            out[q_start + t] = torch.einsum("hn,nhd->hd", weights, v[:seen])
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    if cache.element_size() == 1:  # index fp8 as bytes: not every device indexes float8 tensors
        return cache.view(torch.uint8)[blocks, slots].view(cache.dtype).double()
    return cache[blocks, slots].double()
