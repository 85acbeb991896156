"""Lab probe (issue 41): FlashAttention-3's decode over the single-stream row batch's static cache, in
the ways it can be called.

The row batch (`backends/static_kv.py`, `flash_cache.py`) keeps each row's keys in one contiguous
region of `cache_positions` and showed it to FlashAttention as pages of 16 (now `flash_page()`, 256), with
`max_seqlen_k` the whole region. At 32 rows and 10-frame contexts FA3's fp8 kernel read at 52% of
the bandwidth, its bf16 kernel at 82% (benchmarks/README.md, 2026-12-06). Things that might change
that, all with the same keys: the number of splits of the keys (the plan's heuristic, or fixed),
`max_seqlen_k` the frame's real bound instead of the region, larger pages (the region is contiguous,
so any page size dividing it is the same memory), and no pages at all (`cu_seqlens_k` at the rows'
starts plus `seqused_k`, which lets FA3 use its TMA loads).

Terra's attention shapes (32 query heads over 4 KV heads of 64), 22 layers' distinct caches in one
CUDA graph, timed by replaying it. Every variant's output is compared with the default's.

    python3 benchmarks/scripts/gpu_flash_decode.py --out $OUT/flash_decode.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# the same CUDA-graph timing as the paged-attention probe beside this one (LAYERS calls a replay)
from gpu_paged_attention import time_graph  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 4, 64, 22
FRAME = 582  # 576 codes + 6 action slots
REGION = 15360  # a row's region: divisible by 16..1024 and by FA3's 160/192-key tiles (Terra's is 14,560)
SCALE = HEAD_DIM ** -0.5
FP8 = torch.float8_e4m3fn


def log(*args):
    print(*args, flush=True)


class Batch:
    """`rows` rows' caches for every layer and one query a row, keys so far `seen`."""

    def __init__(self, seen: list[int], dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        rows = len(seen)
        self.rows, self.dtype = rows, dtype
        self.seen = torch.tensor(seen, dtype=torch.int32, device="cuda")
        self.max_seen = max(seen)
        shape = (rows * REGION, KV_HEADS, HEAD_DIM)

        def cache():
            return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.5).to(dtype)

        self.keys = [cache() for _ in range(LAYERS)]
        self.values = [cache() for _ in range(LAYERS)]
        self.query = torch.randn((rows, HEADS, HEAD_DIM), generator=gen, device="cuda",
                                 dtype=torch.bfloat16).to(dtype)
        self.query_starts = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        self.key_starts = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * REGION
        self.out = torch.empty((rows, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
        elt = 1 if dtype == FP8 else 2
        self.bytes = int(self.seen.sum()) * KV_HEADS * HEAD_DIM * 2 * elt * LAYERS

    def table(self, page: int) -> torch.Tensor:
        per_row = REGION // page
        return torch.arange(self.rows * per_row, dtype=torch.int32, device="cuda").view(self.rows, per_row)


def variant_step(batch: Batch, page: int | None, splits: int, planned: bool, max_k: int):
    """One layer's call: `page` None reads the rows' regions unpaged (cu_seqlens_k + seqused_k)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata

    table = batch.table(page) if page is not None else None
    plan = None
    if planned:
        plan = get_scheduler_metadata(batch_size=batch.rows, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=HEADS,
                                      num_heads_kv=KV_HEADS, headdim=HEAD_DIM, cache_seqlens=batch.seen,
                                      qkv_dtype=batch.dtype, cu_seqlens_q=batch.query_starts, page_size=page,
                                      causal=True, num_splits=splits)
    extra = {"scheduler_metadata": plan} if plan is not None else {}

    def step(layer: int):
        keys, values = batch.keys[layer], batch.values[layer]
        if page is not None:
            keys, values = keys.view(-1, page, KV_HEADS, HEAD_DIM), values.view(-1, page, KV_HEADS, HEAD_DIM)
            flash_attn_varlen_func(batch.query, keys, values, max_seqlen_q=1, cu_seqlens_q=batch.query_starts,
                                   max_seqlen_k=max_k, seqused_k=batch.seen, block_table=table, softmax_scale=SCALE,
                                   causal=True, out=batch.out, fa_version=3, num_splits=splits, **extra)
        else:
            flash_attn_varlen_func(batch.query, keys, values, max_seqlen_q=1, cu_seqlens_q=batch.query_starts,
                                   max_seqlen_k=max_k, cu_seqlens_k=batch.key_starts, seqused_k=batch.seen,
                                   softmax_scale=SCALE, causal=True, out=batch.out, fa_version=3,
                                   num_splits=splits, **extra)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="32,8,1")
    parser.add_argument("--context-frames", type=int, default=10, help="keys so far: this many frames, +-1 frame")
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    bandwidth = 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12
    results = []

    def save():
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "region": REGION,
                                        "context_frames": args.context_frames, "results": results}, indent=2) + "\n")

    for rows in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator().manual_seed(rows)
        seen = [int(args.context_frames * FRAME + torch.randint(-FRAME, FRAME, (1,), generator=gen)) for _ in range(rows)]
        for dtype in (FP8, torch.bfloat16):
            batch = Batch(seen, dtype)
            bound = -(-batch.max_seen // FRAME) * FRAME  # the frame's end: what a graph a frame could use
            variants = [("default: pages of 16, planned, region", 16, 0, True, REGION),
                        ("pages of 16, call plans", 16, 0, False, REGION),
                        ("pages of 16, planned, frame's bound", 16, 0, True, bound)]
            variants += [(f"pages of 16, {s} split(s)", 16, s, True, REGION) for s in (1, 2, 4, 8, 16, 32)]
            variants += [(f"pages of {p}", p, 0, True, REGION) for p in (256, 960, 1024)]
            variants += [("unpaged (cu_seqlens_k + seqused_k)", None, 0, True, REGION),
                         ("unpaged, call plans", None, 0, False, REGION),
                         ("unpaged, frame's bound", None, 0, True, bound)]
            variants += [(f"unpaged, {s} split(s)", None, s, True, REGION) for s in (1, 4, 16)]
            reference = None
            for name, page, splits, planned, max_k in variants:
                row = {"rows": rows, "cache": "fp8" if dtype == FP8 else "bf16", "variant": name,
                       "max_seqlen_k": max_k, "mean_keys": round(sum(seen) / rows)}
                try:
                    step = variant_step(batch, page, splits, planned, max_k)
                    batch.out.fill_(float("nan"))
                    step(0)
                    torch.cuda.synchronize()
                    got = batch.out.float().clone()
                    if reference is None:
                        reference = got
                    row["max_abs_diff"] = float((got - reference).abs().max())
                    row["nan"] = bool(torch.isnan(got).any())
                    ms = time_graph(step, args.replays)
                    row["ms_22_layers"] = round(ms, 4)
                    row["bandwidth_share"] = round(batch.bytes / (ms / 1e3) / bandwidth, 3)
                except Exception as exc:  # noqa: BLE001 - a variant the build refuses is a result too
                    row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                results.append(row)
                log(json.dumps(row))
                save()
            del batch
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
