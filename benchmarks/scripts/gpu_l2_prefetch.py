"""Lab probe (issue 41): can one rollout's decode step read its weights nearer the card's bandwidth if the next
projection's weights are pulled into L2 while the small kernels between projections run?

Why: at one row, a Terra-size step's layer projections (22 layers x 4: 1.94 GB of bf16) read at 2.37 TB/s on an
H200, about half its 4.8 (benchmarks/README.md, 2026-11-29: cuBLAS's GEMVs, 10-46 MB each, too short to stream
at full pace), and between them the step's small kernels (norms, rotary, cache writes, attention at one query)
leave the memory idle for ~25 us a layer. Here a step of Terra's shapes is replayed as one CUDA graph:
each layer's four projections (`F.linear` on one row, as the decoder runs them) with stand-ins for the kernels
between them (a norm's few elementwise kernels, SDPA of one query over a cache of `--keys` keys), with and
without a second stream that, once a projection ends, reads the next one's weights (its first `--cap-mb` MB)
through L2 with Triton's `evict_last` policy, so the projection finds them there.

    python3 benchmarks/scripts/gpu_l2_prefetch.py --out $OUT/l2_prefetch.json

Measured on an H100 (2026-12-06, benchmarks/README.md): every variant made the step slower (+11% at the least).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2048, 5632, 32, 4, 64, 22


def build_prefetch():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_kernel(src, sink, n, STEPS, BLOCK: tl.constexpr, POLICY: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        base = pid.to(tl.int64) * BLOCK * STEPS
        for i in range(STEPS):
            idx = base + i * BLOCK + offs
            acc ^= tl.load(src + idx, mask=idx < n, other=0, eviction_policy=POLICY)
        tl.store(sink + pid * BLOCK + offs, acc)  # kept so the loads are not dropped

    return prefetch_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=3500, help="the cache's keys a layer (a 6-frame context)")
    parser.add_argument("--cap-mb", default="0,8,16,24,32", help="MB of the next projection pulled into L2")
    parser.add_argument("--programs", default="32,66,132", help="the prefetch kernel's programs")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is not None and args.out.exists():
        parser.error(f"{args.out} exists")

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    props = torch.cuda.get_device_properties(0)
    layers = []
    for _ in range(LAYERS):
        layers.append({
            "qkv": torch.randn(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN, device=dev, dtype=bf16) * 0.02,
            "o": torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf16) * 0.02,
            "gate_up": torch.randn(2 * INTER, HIDDEN, device=dev, dtype=bf16) * 0.02,
            "down": torch.randn(HIDDEN, INTER, device=dev, dtype=bf16) * 0.02,
            "k": torch.randn(1, KV_HEADS, args.keys, HEAD_DIM, device=dev, dtype=bf16),
            "v": torch.randn(1, KV_HEADS, args.keys, HEAD_DIM, device=dev, dtype=bf16),
        })
    order = [(i, name) for i in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")]
    weight_bytes = sum(layer[name].numel() * 2 for layer in layers for name in ("qkv", "o", "gate_up", "down"))
    x0 = torch.randn(1, HIDDEN, device=dev, dtype=bf16)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=bf16)
    prefetch = build_prefetch()
    sink = torch.empty(1 << 20, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream()
    BLOCK = 1024

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * norm_w

    def pull(weight, cap_bytes, programs, policy):
        flat = weight.view(-1).view(torch.int32)
        n = min(flat.numel(), cap_bytes // 4)
        steps = -(-n // (programs * BLOCK))
        prefetch[(programs,)](flat, sink, n, steps, BLOCK=BLOCK, POLICY=policy)

    def step(cap_bytes, programs, policy, gemms_only=False):
        x = x0
        main = torch.cuda.current_stream()
        for index, (i, name) in enumerate(order):
            layer = layers[i]
            if name == "qkv":
                out = F.linear(x if gemms_only else rms(x), layer["qkv"])
                if gemms_only:
                    y = out[:, :HIDDEN]
                else:  # rotary's few kernels, then 32 query heads over 4 cached ones: 8 queries a cached head
                    q = (out[:, :HIDDEN] * 1.0001 + 0.0001).view(1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
                    y = F.scaled_dot_product_attention(q, layer["k"], layer["v"]).reshape(1, HIDDEN)
            elif name == "o":
                x = x + F.linear(y, layer["o"])
            elif name == "gate_up":
                gu = F.linear(x if gemms_only else rms(x), layer["gate_up"])
                g, u = gu.chunk(2, -1)
                a = g if gemms_only else F.silu(g) * u
            else:
                x = x + F.linear(a, layer["down"])
            if cap_bytes and index + 1 < len(order):
                done = torch.cuda.Event()
                done.record(main)
                side.wait_event(done)
                with torch.cuda.stream(side):
                    j, next_name = order[index + 1]
                    pull(layers[j][next_name], cap_bytes, programs, policy)
        if cap_bytes:
            main.wait_stream(side)
        return x

    def timed(**kw) -> float:
        static = {}
        for _ in range(2):  # warm: Triton compiles, cuBLAS picks
            static["x"] = step(**kw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static["x"] = step(**kw)
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / args.replays

    result = {"device": props.name, "l2_mb": props.L2_cache_size / 2 ** 20, "sms": props.multi_processor_count,
              "weight_gb": weight_bytes / 1e9, "keys": args.keys, "rows": []}

    def row(name, **kw):
        ms = timed(**kw)
        entry = {"variant": name, "ms_per_step": round(ms, 4)}
        if kw.get("gemms_only"):
            entry["weights_tb_per_s"] = round(weight_bytes / ms / 1e9, 2)
        result["rows"].append(entry)
        print(json.dumps(entry), flush=True)
        return ms

    with torch.inference_mode():
        row("projections alone", cap_bytes=0, programs=0, policy="", gemms_only=True)
        base = row("step", cap_bytes=0, programs=0, policy="")
        for programs in [int(p) for p in args.programs.split(",")]:
            for cap in [int(c) for c in args.cap_mb.split(",") if int(c) > 0]:
                for policy in ("evict_last", ""):
                    ms = row(f"step, next projection's first {cap} MB pulled by {programs} programs"
                             f"{' evict_last' if policy else ''}", cap_bytes=cap << 20, programs=programs, policy=policy)
                    result["rows"][-1]["vs_step"] = round(ms / base - 1, 4)
        row("step again", cap_bytes=0, programs=0, policy="")
    if args.out is not None:
        with open(args.out, "x") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
