"""The refiner UNet's parts one shape at a time, each beside a faster equivalent (issue 40): what each
would take off a 25-frame window before the whole UNet is compiled with it.

The UNet is walked on the meta device to list every [3, 1, 1] temporal convolution, self-attention and
GEGLU projection it runs in one call of `--windows` windows, with their shapes and counts; each
distinct shape is then timed on the GPU (bf16, CUDA events, median of `--iters` calls after a warm call):

- temporal convolution: the Conv3d in channels_last_3d (the product) against `FramesPlaneConv` (the
  same kernel as a [3, 1] Conv2d over frames x pixels, on a view);
- self-attention: torch's SDPA as diffusers calls it, compiled as the product is (cuDNN's kernel on Hopper;
  eager beside it) against FlashAttention-3 (vLLM's build);
- GEGLU: the projection and gelu x mul as Inductor compiles them (the product: cuBLAS, then one fused
  pointwise kernel) against terra's fused Triton kernel, each tile of `PROBE_TILES`.

Each row's seconds x count x 15 steps / windows gives ms a window; each variant's output is compared
with the product's (relative max error). Needs vLLM's GPU build on PYTHONPATH for FlashAttention-3.

  python3 benchmarks/scripts/gpu_refiner_ops.py --out $OUT/refiner_ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path


def census(windows: int) -> list[dict]:
    """One UNet call's temporal convolutions, self-attentions and GEGLUs: kind, shape, count."""
    import torch
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention_processor import Attention

    from terra_cli.refiner.config import TERRA_REFINER as C
    from terra_cli.refiner.unet import added_time_ids, build_unet, zero_context
    from terra_cli.refiner.unet_ops import plane_convertible

    unet = build_unet(C, device="meta", dtype=torch.bfloat16)
    counts: collections.Counter = collections.Counter()

    def hook(kind, module):
        def record(_, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            if kind == "attention":
                counts[(kind, tuple(x.shape), module.heads)] += 1
            elif kind == "geglu":
                counts[(kind, (x.shape[:-1].numel(), x.shape[-1]), module.proj.out_features // 2)] += 1
            else:
                counts[(kind, tuple(x.shape), module.out_channels)] += 1
        return record

    for name, module in unet.named_modules():
        if plane_convertible(module):
            module.register_forward_hook(hook("time_conv", module), with_kwargs=True)
        elif isinstance(module, GEGLU):
            module.register_forward_hook(hook("geglu", module), with_kwargs=True)
        elif isinstance(module, Attention) and name.endswith("attn1"):
            module.register_forward_hook(hook("attention", module), with_kwargs=True)
    h, w = C.latent_hw
    x = torch.zeros(windows, C.window, C.in_channels, h, w, device="meta", dtype=torch.bfloat16)
    with torch.no_grad():
        unet(x, torch.zeros(windows, device="meta"), zero_context(windows, C, "meta", torch.bfloat16),
             added_time_ids(windows, C, "meta", torch.float32), return_dict=False)
    return [{"kind": k, "shape": list(s), "out": o, "count": n} for (k, s, o), n in sorted(counts.items(), key=str)]


def timed_ms(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def relative_error(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def time_conv_rows(shape, out_channels, iters):
    import torch

    from terra_cli.refiner.unet_ops import FramesPlaneConv

    conv = torch.nn.Conv3d(shape[1], out_channels, (3, 1, 1), padding=(1, 0, 0), device="cuda", dtype=torch.bfloat16)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    plane = FramesPlaneConv(conv)
    want = conv(x)
    return {"conv3d": (timed_ms(lambda: conv(x), iters), 0.0),
            "plane": (timed_ms(lambda: plane(x), iters), relative_error(plane(x), want))}


def attention_rows(shape, heads, iters, flash):
    import torch
    import torch.nn.functional as F

    from terra_cli.refiner.unet_ops import flash_self_attention

    batch, tokens, channels = shape
    d = channels // heads
    q, k, v = (torch.randn(batch, tokens, channels, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def sdpa():  # as diffusers' AttnProcessor2_0 lays the heads out
        split = [t.view(batch, tokens, heads, d).transpose(1, 2) for t in (q, k, v)]
        return F.scaled_dot_product_attention(*split).transpose(1, 2).reshape(batch, tokens, channels)

    def fa3():
        flat = [t.view(batch * tokens, heads, d) for t in (q, k, v)]
        return flash_self_attention(*flat, batch, d ** -0.5).view(batch, tokens, channels)

    # Compiled, as in the product: eager, SDPA got the heads' strided layout and its cuDNN kernel took 195 ms
    # a window where the compiled UNet's took 146 (H200, 2026-12-06), which made FA3 look 50 ms ahead
    sdpa_compiled = torch.compile(sdpa, dynamic=False)
    want = sdpa()
    rows = {"sdpa-eager": (timed_ms(sdpa, iters), 0.0),
            "sdpa": (timed_ms(sdpa_compiled, iters), relative_error(sdpa_compiled(), want))}
    if flash:
        rows["fa3"] = (timed_ms(fa3, iters), relative_error(fa3(), want))
    return rows


def geglu_rows(shape, out_channels, iters, tiles):
    import torch
    import torch.nn.functional as F

    from terra_cli.kernels import geglu_matmul as kernel

    rows_m, k = shape
    x = torch.randn(rows_m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * out_channels, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    bias = torch.randn(2 * out_channels, device="cuda", dtype=torch.bfloat16) * 0.1

    def split(x, weight, bias):
        hidden, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
        return hidden * F.gelu(gate)

    compiled = torch.compile(split, dynamic=False)
    want = compiled(x, weight, bias)
    rows = {"split": (timed_ms(lambda: compiled(x, weight, bias), iters), 0.0)}
    chosen = kernel.tile_for(rows_m, out_channels, k)
    for tile in [chosen] + [t for t in tiles if t != chosen]:
        name = "fused" if tile == chosen else "fused-" + "-".join(str(v) for v in tile.__dict__.values())
        try:
            got = kernel.geglu_matmul(x, weight, bias, tile=tile)
            rows[name] = (timed_ms(lambda: kernel.geglu_matmul(x, weight, bias, tile=tile), iters),
                          relative_error(got, want))
        except Exception as exc:  # noqa: BLE001 - a tile this card cannot run: say so, go on
            rows[name] = (None, repr(exc)[:200])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="UNet calls a window (Terra's sampler: 15)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", default="time_conv,attention,geglu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out is not None and args.out.exists():
        parser.error(f"{args.out} exists; remove it or name another --out")

    import torch

    from terra_cli.kernels import geglu_matmul as kernel
    from terra_cli.refiner.unet_ops import flash_kernel

    torch._dynamo.config.recompile_limit = 64  # one compiled function per shape: 8 attention shapes, 4 GEGLU ones
    started = time.perf_counter()
    flash = flash_kernel("cuda")[0] is not None
    wanted = set(args.only.split(","))
    shapes = [row for row in census(args.windows) if row["kind"] in wanted]
    per_window: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    with torch.inference_mode():
        for row in shapes:
            if row["kind"] == "time_conv":
                variants = time_conv_rows(row["shape"], row["out"], args.iters)
            elif row["kind"] == "attention":
                variants = attention_rows(row["shape"], row["out"], args.iters, flash)
            else:
                variants = geglu_rows(row["shape"], row["out"], args.iters, kernel.PROBE_TILES)
            row["variants"] = {name: {"ms": ms, "error": err} for name, (ms, err) in variants.items()}
            for name, (ms, _) in variants.items():
                if ms is not None:
                    per_window[row["kind"]][name] += ms * row["count"] * args.steps / args.windows
            print(row["kind"], row["shape"], row["out"], "x", row["count"],
                  {n: (round(v["ms"], 3) if v["ms"] else None, v["error"] if isinstance(v["error"], str)
                       else round(v["error"], 5)) for n, v in row["variants"].items()}, flush=True)
    result = {"device": torch.cuda.get_device_name(), "windows_per_call": args.windows, "steps": args.steps,
              "flash_attention_3": flash, "ms_per_window": {k: dict(v) for k, v in per_window.items()},
              "shapes": shapes, "seconds": round(time.perf_counter() - started, 1)}
    for kind, variants in result["ms_per_window"].items():
        print(kind, {name: round(ms, 1) for name, ms in sorted(variants.items(), key=lambda item: item[1])})
    if args.out is not None:
        with open(args.out, "x") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
