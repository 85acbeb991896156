"""Where a refiner window's GPU time goes (issue 40): the product's UNet (compiled as `--refiner-compile`
does), one sampler call of `--windows` windows profiled, its kernels grouped by what they compute, each
group's time per window beside the FLOPs of the ops it runs (counted on the meta device), so each group's
achieved TFLOP/s says which part of the UNet keeps MFU at ~37% (1.17 s a window against a 0.43 s floor,
4 x H200, 2026-11-27).

  python3 benchmarks/scripts/gpu_refiner_profile.py --windows 4 --compile default --out $OUT/refiner_profile.json
  python3 benchmarks/scripts/gpu_refiner_profile.py --device cpu --tiny --compile none   # dry run (CPU ops)

On the CPU there are no kernels: the dry run groups the CPU ops instead, which checks the script, not a speed.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

# Kernel (or CPU op) names -> what they compute. First match wins: layout copies before convolutions
# (cuDNN names both "nchw"), convolutions before GEMMs (implicit-GEMM convolutions say "gemm").
GROUPS = (
    ("layout", r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw"),
    ("attention", r"flash|fmha|attention|scaled_dot_product|sdpa"),
    ("conv", r"conv|fprop|implicit_gemm|implicit_convolve|winograd|cudnn"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|\bmm\b|addmm|bmm|matmul|linear|scaled_mm|f8f8"),
    ("norm", r"group_norm|layer_norm|native_group_norm|native_layer_norm|rms_norm"),
    ("reduction", r"triton_red|triton_per|reduce"),
    ("elementwise", r"triton_poi|elementwise|vectorized|unrolled|add_|mul_|silu|gelu|copy_|cat"),
)
# FLOP counter ops -> the same groups (FlopCounterMode counts only these kinds). On the meta device attention
# is counted through its math form, batched matmuls, which nothing else in the UNet runs: those are attention.
FLOP_GROUPS = (("attention", r"attention|sdpa|scaled_dot|\bbmm|baddbmm"), ("conv", r"convolution"),
               ("gemm", r"\bmm|addmm|matmul"))


def group_of(name: str, table=GROUPS) -> str:
    for group, pattern in table:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def flops_by_group(config, exact_cross_attention: bool) -> dict[str, float]:
    """One UNet evaluation of one window, by group (meta device, as `terra bench --refiner` counts it)."""
    from terra_cli.bench.refiner import unet_flop_counter

    counter = unet_flop_counter(config, exact_cross_attention)
    groups: dict[str, float] = defaultdict(float)
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        groups[group_of(str(op), FLOP_GROUPS)] += float(flops)
    return dict(groups)


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The union of (start, end) intervals: time at least one kernel ran."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def profile_rows(events: list[dict], windows: int, on_gpu: bool) -> tuple[dict, list, float]:
    """Per group: seconds per window; the heaviest names; the busy seconds (kernels' union, GPU only).
    `events`: the chrome trace's complete events."""
    wanted = ("kernel", "gpu_memcpy", "gpu_memset") if on_gpu else ("cpu_op",)
    picked = [e for e in events if e.get("ph") == "X" and e.get("cat") in wanted]
    if not on_gpu:  # only the ops a CPU thread ran at the top level: a convolution's inner ops count once
        picked = top_level(picked)
    per_group: dict[str, float] = defaultdict(float)
    per_name: dict[str, float] = defaultdict(float)
    for e in picked:
        seconds = e["dur"] / 1e6
        name = e.get("name", "")
        group = "memcpy" if e.get("cat") in ("gpu_memcpy", "gpu_memset") else group_of(name)
        per_group[group] += seconds / windows
        per_name[name[:120]] += seconds / windows
    top = sorted(per_name.items(), key=lambda item: -item[1])[:20]
    busy = busy_seconds([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in picked]) if on_gpu else sum(per_group.values()) * windows
    return dict(per_group), top, busy


def top_level(ops: list[dict]) -> list[dict]:
    """CPU ops not inside another op of the same thread."""
    kept, open_until = [], defaultdict(lambda: float("-inf"))
    for e in sorted(ops, key=lambda e: (e.get("tid"), e["ts"], -e["dur"])):
        if e["ts"] >= open_until[e.get("tid")]:
            kept.append(e)
            open_until[e.get("tid")] = e["ts"] + e["dur"]
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4, help="windows per UNet call (the product's batch)")
    parser.add_argument("--compile", default="default", help="--refiner-compile: default, reduce-overhead, max-autotune-no-cudagraphs, none, ...")
    parser.add_argument("--refiner-dtype", default="auto", help="auto (the run's dtype) or fp8 (the transformer blocks' Linears)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny refiner config (a CPU dry run)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN time its algorithms for each convolution shape (torch.backends.cudnn.benchmark)")
    parser.add_argument("--repeat", type=int, default=1, help="timed calls after the compile (their median)")
    parser.add_argument("--lock", type=Path, default=None,
                        help="hold this file's lock while timing: variants compile side by side, time one at a time")
    args = parser.parse_args()
    if args.out is not None and args.out.exists():  # before minutes of work: a file it did not make stays
        parser.error(f"{args.out} exists; remove it or name another --out")

    import torch

    from terra_cli.refiner import sampler
    from terra_cli.refiner.config import TERRA_REFINER, tiny_refiner_config
    from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner

    on_gpu = args.device.startswith("cuda")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    config = tiny_refiner_config() if args.tiny else TERRA_REFINER
    options = RefinerOptions(compile=args.compile, batch_windows=args.windows, dtype=args.refiner_dtype)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    refiner = VideoRefiner.random(config, args.device, dtype, options=options)
    h, w = config.latent_hw
    gen = torch.Generator().manual_seed(0)
    concat = torch.randn(args.windows, config.window, config.latent_channels, h, w, generator=gen).to(args.device)
    noise = torch.randn(args.windows, config.window, config.latent_channels, h, w, generator=gen).to(args.device)

    def one() -> None:
        with torch.inference_mode():
            sampler.sample(refiner.network, noise, concat, uncond=concat, sigmas=refiner.sigmas,
                           scales=refiner.scales, same_uncond=options.same_uncond)
        if on_gpu:
            torch.cuda.synchronize()

    started = time.perf_counter()
    one()  # compile, choose kernels
    first_s = time.perf_counter() - started
    lock = open(args.lock, "a") if args.lock is not None else None  # noqa: SIM115 - held to the end
    if lock is not None:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
    calls = []
    for _ in range(max(1, args.repeat)):
        started = time.perf_counter()
        one()
        calls.append(time.perf_counter() - started)
    plain_s = sorted(calls)[len(calls) // 2]
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        one()
        profiled_s = time.perf_counter() - started
    trace = Path(f"/tmp/refiner-profile-{time.time_ns()}.json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    per_group, top, busy = profile_rows(events, args.windows, on_gpu)

    evals = config.steps * (1 if options.same_uncond else 2)
    flops = {group: f * evals for group, f in flops_by_group(config, options.exact_cross_attention).items()}
    groups = {}
    for group, seconds in sorted(per_group.items(), key=lambda item: -item[1]):
        row = {"seconds_per_window": round(seconds, 4), "share": round(seconds / max(sum(per_group.values()), 1e-12), 4)}
        if group in flops:
            row["tflop_per_window"] = round(flops[group] / 1e12, 2)
            row["achieved_tflops"] = round(flops[group] / seconds / 1e12, 1) if seconds else None
        groups[group] = row
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "config": "tiny" if args.tiny else "terra",
        "windows_per_call": args.windows, "compile": refiner.compile_mode,
        "refiner_dtype": options.dtype, "fp8_layers": refiner.fp8_layers, "first_call_s": round(first_s, 2),
        "lab_switches": refiner.switches.as_env(),  # TERRA_REFINER_CHANNELS_LAST / _ATTENTION, as the refiner read them
        "seconds_per_window": round(plain_s / args.windows, 4),
        "calls_s": [round(c, 4) for c in calls], "cudnn_benchmark": args.cudnn_benchmark,
        "profiled_seconds_per_window": round(profiled_s / args.windows, 4),
        "busy_share": round(busy / profiled_s, 4) if on_gpu else None,
        "flops_per_window_tflop": round(sum(flops.values()) / 1e12, 2), "groups": groups,
        "top": [{"name": name, "seconds_per_window": round(seconds, 5)} for name, seconds in top],
    }
    for group, row in groups.items():
        extra = f", {row['tflop_per_window']} TFLOP, {row['achieved_tflops']} TFLOP/s" if "tflop_per_window" in row else ""
        print(f"{group:12s} {row['seconds_per_window'] * 1e3:9.1f} ms a window ({row['share']:.0%}){extra}")
    print(f"{result['seconds_per_window']:.3f} s a window ({args.windows} a call, {refiner.compile_mode}, "
          f"{refiner.switches.as_env()}, refiner dtype {options.dtype}); GPU busy "
          f"{result['busy_share']}; first call {result['first_call_s']} s")
    if args.out is not None:
        with open(args.out, "x") as f:  # "x": never replaces a file that appeared meanwhile
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
