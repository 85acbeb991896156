"""Lab probe (issue 41): FlashAttention's decode over the single-stream row batch's static cache, in
the ways it can be called.

The row batch (`backends/static_kv.py`, `flash_cache.py`) keeps each row's keys in one contiguous
region of `cache_positions` and shows it to FlashAttention as pages (of 16 until 2026-12-06, of 256
since), with `max_seqlen_k` the whole region. `--variants pages` (lease 12 of 2026-12-06): page sizes,
fixed split counts, a plan a call, `max_seqlen_k` the frame's bound; pages of 256 made the fp8 kernel
17% faster, at 58% of the bandwidth against bf16's 78%. `--variants layouts` (the default, not run
yet): FA3's op called directly (vLLM's wrapper refuses `seqused_k` without pages) on the batch layout
(rows, region, KV, d), where FA3 loads keys without a page table, `pack_gqa` forced on and off, and
FA4 where vLLM's build has it.

Terra's attention shapes (32 query heads over 4 KV heads of 64), 22 layers' distinct caches in one
CUDA graph, timed by replaying it. Every variant's output is compared with the first variant's.

    python3 benchmarks/scripts/gpu_flash_decode.py --out $OUT/flash_decode.json [--variants pages]
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


def fa3_forward(q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal=True,
                block_table=None, kv_batch_idx=None, scheduler_metadata=None, num_splits=0, pack_gqa=None, out=None):
    """FlashAttention-3's op with what vLLM's wrapper does not pass: `seqused_k` without a page table,
    `kv_batch_idx`, `pack_gqa`. The positional list is vLLM 0.25's own call of the op
    (`vllm_flash_attn.flash_attn_varlen_func`)."""
    result, *_ = torch.ops._vllm_fa3_C.fwd(
        q, k, v, None, None, None, out, cu_seqlens_q, None, None, None, seqused_k, max_seqlen_q, max_seqlen_k,
        block_table, kv_batch_idx, None, None, None, None, None, None, None, softmax_scale, causal, -1, -1, 0.0, True,
        scheduler_metadata, num_splits, pack_gqa, 0, None, 1, 0, None)
    return result


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
        self.out = torch.empty((rows, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
        elt = 1 if dtype == FP8 else 2
        self.bytes = int(self.seen.sum()) * KV_HEADS * HEAD_DIM * 2 * elt * LAYERS

    def table(self, page: int) -> torch.Tensor:
        per_row = REGION // page
        return torch.arange(self.rows * per_row, dtype=torch.int32, device="cuda").view(self.rows, per_row)


def variant_step(batch: Batch, v: dict):
    """One layer's call of variant `v`: `layout` "paged" (pages of `page`, through vLLM's wrapper unless `direct`)
    or "batch" (the rows' regions as (rows, REGION, KV, d), FA3's op directly); `splits` (0: the plan's), `planned`
    (one plan for every layer), `max_k`, `pack_gqa` (None: FA3's heuristic), `fa` (3, or 4: FA4)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    from vllm.vllm_flash_attn.flash_attn_interface import get_scheduler_metadata

    page = v.get("page") if v["layout"] == "paged" else None
    table = batch.table(page) if page is not None else None
    splits, max_k, pack_gqa = v.get("splits", 0), v.get("max_k", REGION), v.get("pack_gqa")
    direct = v["layout"] == "batch" or v.get("direct", False)
    plan = None
    if v.get("planned", True) and v.get("fa", 3) == 3:
        plan = get_scheduler_metadata(batch_size=batch.rows, max_seqlen_q=1, max_seqlen_k=max_k, num_heads_q=HEADS,
                                      num_heads_kv=KV_HEADS, headdim=HEAD_DIM, cache_seqlens=batch.seen,
                                      qkv_dtype=batch.dtype, cu_seqlens_q=batch.query_starts, page_size=page,
                                      causal=True, num_splits=splits, pack_gqa=pack_gqa)

    def step(layer: int):
        keys, values = batch.keys[layer], batch.values[layer]
        shape = (-1, page, KV_HEADS, HEAD_DIM) if page is not None else (batch.rows, REGION, KV_HEADS, HEAD_DIM)
        keys, values = keys.view(shape), values.view(shape)
        if direct:
            fa3_forward(batch.query, keys, values, cu_seqlens_q=batch.query_starts, seqused_k=batch.seen, max_seqlen_q=1,
                        max_seqlen_k=max_k, softmax_scale=SCALE, block_table=table, scheduler_metadata=plan,
                        num_splits=splits, pack_gqa=pack_gqa, out=batch.out)
        else:
            flash_attn_varlen_func(batch.query, keys, values, max_seqlen_q=1, cu_seqlens_q=batch.query_starts,
                                   max_seqlen_k=max_k, seqused_k=batch.seen, block_table=table, softmax_scale=SCALE,
                                   causal=True, out=batch.out, fa_version=v.get("fa", 3), num_splits=splits,
                                   **({"scheduler_metadata": plan} if plan is not None else {}))
    return step


def variants(bound: int, which: str) -> list[tuple[str, dict]]:
    """`which`: "pages" (lease 12 of 2026-12-06: page sizes, split counts, plans) or "layouts" (the next:
    the batch layout, pack_gqa, FA4)."""
    paged = lambda page, **kw: {"layout": "paged", "page": page, **kw}  # noqa: E731
    if which == "pages":
        return ([("pages of 16, planned, region", paged(16)), ("pages of 16, call plans", paged(16, planned=False)),
                 ("pages of 16, planned, frame's bound", paged(16, max_k=bound))]
                + [(f"pages of 16, {n} split(s)", paged(16, splits=n)) for n in (1, 2, 4, 8, 16, 32)]
                + [(f"pages of {p}", paged(p)) for p in (256, 960, 1024)])
    return [("pages of 256 (the default since a87ccf1)", paged(256)),
            ("pages of 16", paged(16)),
            ("pages of 256, FA3's op directly", paged(256, direct=True)),
            ("pages of 256, pack_gqa", paged(256, direct=True, pack_gqa=True)),
            ("pages of 256, no pack_gqa", paged(256, direct=True, pack_gqa=False)),
            ("batch layout (rows, region), seqused_k", {"layout": "batch"}),
            ("batch layout, call plans", {"layout": "batch", "planned": False}),
            ("batch layout, frame's bound", {"layout": "batch", "max_k": bound}),
            ("batch layout, pack_gqa", {"layout": "batch", "pack_gqa": True}),
            ("batch layout, no pack_gqa", {"layout": "batch", "pack_gqa": False}),
            ("FA4, pages of 256", paged(256, fa=4, planned=False)),
            ("FA4, pages of 128", paged(128, fa=4, planned=False))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="32,8,1")
    parser.add_argument("--context-frames", type=int, default=10, help="keys so far: this many frames, +-1 frame")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--variants", choices=("layouts", "pages"), default="layouts",
                        help="pages: lease 12's (2026-12-06); layouts: the batch layout, pack_gqa, FA4")
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
            reference = None
            for name, v in variants(bound, args.variants):
                row = {"rows": rows, "cache": "fp8" if dtype == FP8 else "bf16", "variant": name,
                       "max_seqlen_k": v.get("max_k", REGION), "mean_keys": round(sum(seen) / rows)}
                try:
                    step = variant_step(batch, v)
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
