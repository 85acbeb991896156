"""FlashAttention's paged varlen kernel over `StaticKVDecoder`'s cache (the kernel vLLM's decode runs).

The static cache is read as FlashAttention's paged layout: each row's region is a run of pages of
`flash_page()` positions in order, and `seqused_k` (on the device) says how many keys a row has, so one
kernel reads exactly the keys so far and one CUDA graph serves every step of every frame.
"""

from __future__ import annotations

import torch

from terra_cli.runtime import choice_switch

# TERRA_SINGLE_STREAM_ATTENTION=torch keeps the torch attention on CUDA too (to compare).
ATTENTION_ENV = "TERRA_SINGLE_STREAM_ATTENTION"
# FlashAttention-3 plans each call's split of the keys with a kernel of its own
# (`prepare_varlen_num_blocks`, 2.3 us, 22 a step). The plan depends only on the step's shapes and
# `seqused_k`, the same for every layer, so the decoder makes it once a step (`get_scheduler_metadata`,
# as vLLM's own decode does) and hands it to every layer: 1.4% off a step on an H200, the same codes
# (2026-11-29, lease 6). TERRA_SINGLE_STREAM_FLASH_PLAN=call lets each call plan again (to compare).
FLASH_PLAN_ENV = "TERRA_SINGLE_STREAM_FLASH_PLAN"

# The cache seen as FlashAttention's paged layout: pages of this many positions, in order. A row's region
# is contiguous, so any page size is the same memory; FA3's paged kernel gathers its key tiles page by
# page, and with an fp8 cache pages of 256 made a 32-row step's attention 17% faster than pages of 16
# (1.08 against 1.30 ms at 10-frame contexts, 8 rows 0.42 against 0.50; bf16 within 1%; the outputs
# equal to the bit; one H100, 2026-12-06, benchmarks/scripts/gpu_flash_decode.py). 960 and 1024 measured
# as 256; the splits of the keys (1 to 32) changed nothing at 32 rows. TERRA_SINGLE_STREAM_FLASH_PAGE=16
# keeps the old pages (to compare).
FLASH_PAGE_ENV = "TERRA_SINGLE_STREAM_FLASH_PAGE"
FLASH_PAGES = ("256", "16")


def flash_page(environ=None) -> int:
    """Positions a page of the static cache holds as FlashAttention reads it (256, or the lab switch's)."""
    return int(choice_switch(FLASH_PAGE_ENV, FLASH_PAGES, "256 (the default) or 16", environ) or FLASH_PAGES[0])


# FA3's batch layout (the rows' regions as (rows, region, KV, d) with `kv_batch_idx`, no page table) measured
# no faster than pages of 256 in the product (32-row fp8 step: FA3 1.065 against 1.057 ms; 32 sessions 0.541
# against 0.545 frames/s each; one H100, 2026-12-06): the lab switch was taken out again, and
# benchmarks/scripts/gpu_flash_decode.py keeps the op's call.


def flash_varlen_kernel(device: torch.device, dtype: torch.dtype):
    """vLLM's FlashAttention `flash_attn_varlen_func` and the version to run (3 on Hopper, else 2)
    where it can run here (a CUDA device, 16-bit cache, vLLM's GPU build installed, not turned off
    by TERRA_SINGLE_STREAM_ATTENTION=torch), else None."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if choice_switch(ATTENTION_ENV, ("flash", "torch"), "torch (to compare) or flash") == "torch":
        return None
    return vllm_flash_varlen((3, 2))


def vllm_flash_varlen(versions: tuple[int, ...]):
    """vLLM's `flash_attn_varlen_func` and the first of `versions` this card and build run, else None
    (vLLM's GPU build not installed, a build without it, no version supported here)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported
    except Exception:  # noqa: BLE001 - not installed, or a build without it
        return None
    for version in versions:
        try:
            if is_fa_version_supported(version):
                return flash_attn_varlen_func, version
        except Exception:  # noqa: BLE001 - a build that cannot say: try the next version
            continue
    return None


def flash_planner(version: int, environ=None):
    """FlashAttention-3's `get_scheduler_metadata`, for one plan a step; None (each call plans) on
    FlashAttention-2 or where TERRA_SINGLE_STREAM_FLASH_PLAN=call asks for it."""
    choice = choice_switch(FLASH_PLAN_ENV, ("step", "call"), "step (the default) or call", environ) or "step"
    if choice == "call" or version != 3:
        return None
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata
    except ImportError:  # a build without the planner: each call plans, as before
        return None
    return get_scheduler_metadata


class FlashCacheAttention:
    """Attention over the static cache through FlashAttention's paged kernel (the one vLLM's decode
    runs): each row's region of the cache (`rows` regions of `cache_positions`, (1, positions, KV, d))
    is read as pages of `page` positions in order, and `seqused_k` (on the device) says how many
    keys a row has written, so one kernel reads exactly the keys so far and one CUDA graph serves
    every step of every frame. `sequences` rows of the block table go into a call: one rollout's
    (its row's), or a batched step's first `sequences` rows, one query each."""

    def __init__(self, kernel, version: int, cache_positions: int, device: torch.device, planner=None, rows: int = 1,
                 page: int | None = None):
        page = page or flash_page()
        if cache_positions % page:
            raise ValueError(f"a row's region of {cache_positions} positions is not whole pages of {page}")
        self.kernel, self.version, self.planner, self.page = kernel, version, planner, page
        blocks = cache_positions // page
        self.block_table = torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks)
        self.query_starts: dict[tuple[int, int], torch.Tensor] = {}
        self.max_keys = cache_positions

    def starts(self, n: int, device, sequences: int = 1) -> torch.Tensor:
        """`cu_seqlens_q` for `sequences` sequences of n queries each."""
        if (n, sequences) not in self.query_starts:
            self.query_starts[n, sequences] = torch.arange(sequences + 1, dtype=torch.int32, device=device) * n
        return self.query_starts[n, sequences]

    def plan(self, n: int, seen: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        """One step's plan for every layer's call (`FLASH_PLAN_ENV`), or None: each call makes its own."""
        if self.planner is None:
            return None
        return self.planner(batch_size=seen.shape[0], max_seqlen_q=n, max_seqlen_k=self.max_keys, num_heads_q=heads,
                            num_heads_kv=kv_heads, headdim=head_dim, cache_seqlens=seen, qkv_dtype=dtype,
                            cu_seqlens_q=self.starts(n, seen.device, seen.shape[0]), page_size=self.page, causal=True)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor,
                 scale: float, plan: torch.Tensor | None = None, first_row: int = 0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """q (1, S * n, heads, d) for S = len(seen) rows from `first_row` on (or the rows `rows` names), n
        queries each; keys/values (1, positions, KV, d); seen (S,) int32 -> (1, S * n, heads * d)."""
        sequences = seen.shape[0]
        n = q.shape[1] // sequences
        paged = (-1, self.page) + tuple(keys.shape[2:])
        planned = {} if plan is None else {"scheduler_metadata": plan}
        out = self.kernel(q[0], keys.view(paged), values.view(paged), max_seqlen_q=n,
                          cu_seqlens_q=self.starts(n, q.device, sequences), max_seqlen_k=self.max_keys, seqused_k=seen,
                          block_table=(self.block_table[first_row:first_row + sequences] if rows is None
                                       else self.block_table[rows]), softmax_scale=scale,
                          causal=True, fa_version=self.version, **planned)
        return out.reshape(1, q.shape[1], -1)
