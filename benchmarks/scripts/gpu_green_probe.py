"""Does a CUDA green context bound the decoder's kernels, and does that spare the engine's steps?

Issue 37's last gap is the engine's decode steps running 13-15% slower beside the tokenizer's
decoder, whose kernels take only ~7% of the card's time (benchmarks/README.md, 2026-11-27 night).
TERRA_DECODE_SMS=N puts the decoder on a green context of N SMs (`local_writer.GreenContextScope`).
This probe checks that mechanism apart from terra, in well under a minute:

1. kernels of every kind the decoder runs (cuDNN convolution, cuBLAS GEMM, a Triton kernel from
   torch.compile) launch on the green context's stream and give the default stream's results;
2. a bounded context is slower alone (a convolution stack on N SMs against the whole card): the
   partition holds;
3. the question itself, in miniature: an "engine" (a chain of small memory-bound GEMMs, one after
   the other, like a decode step) timed alone, then beside a "decoder" (a compiled conv stack in a
   loop) on a plain side stream, then beside the same decoder on green contexts of N SMs.

Run: `python3 benchmarks/scripts/gpu_green_probe.py --out probe.json` (a CUDA GPU; torch >= 2.10).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.nn.functional as F

from terra_cli.media.atomic import atomic_write_json


def decoder_like(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """A stack of 3x3 convolutions with GroupNorm and SiLU, the tokenizer decoder's kind of work."""
    for w in weights:
        x = F.silu(F.group_norm(F.conv2d(x, w, padding=1), 32))
    return x


def engine_step(h: torch.Tensor, layers: list[torch.Tensor]) -> torch.Tensor:
    """Small-M GEMMs one after the other, a decode step's kind of work (reads weights, little math)."""
    for w in layers:
        h = torch.tanh(h @ w)
    return h


def timed(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def green_scope(sms: int):
    """What the writer's thread enters (`local_writer.GreenContextScope`): its work on `sms` SMs."""
    from terra_cli.scenarios.local_writer import GreenContextScope

    return GreenContextScope(torch.device("cuda", 0), sms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sms", default="8,16,32", help="green context sizes to try")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.out and os.path.exists(args.out):
        parser.error(f"{args.out} exists: name another --out")
    sizes = [int(s) for s in args.sms.split(",")]
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    native = getattr(torch._C, "_CUDAGreenContext", None)  # what GreenContext.create returns
    report: dict = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                    "green_context_stream_api": native is not None and hasattr(native, "Stream")}

    x = torch.randn(8, 256, 72, 128, device=device, dtype=torch.bfloat16)
    conv_weights = [torch.randn(256, 256, 3, 3, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(6)]
    compiled = torch.compile(decoder_like, dynamic=False)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = (compiled(x, conv_weights), F.conv2d(x, conv_weights[0], padding=1), a @ a)
        torch.cuda.synchronize()

        # 1. every kind of kernel on a green stream, results equal
        checks = {}
        for sms in sizes:
            try:
                with green_scope(sms):
                    got = (compiled(x, conv_weights), F.conv2d(x, conv_weights[0], padding=1), a @ a)
                    torch.cuda.synchronize()
                checks[sms] = {"ok": all(torch.equal(g, r) for g, r in zip(got, reference)),
                               "max_diff": max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, reference))}
            except Exception as error:  # noqa: BLE001 - the point of the probe is to say which fails
                checks[sms] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        report["kernels_on_green_stream"] = checks
        print("kernels on a green stream:", checks, flush=True)

        # 2. the partition holds: the conv stack alone on N SMs against the whole card
        alone = {"all": timed(lambda: compiled(x, conv_weights), 10)}
        for sms in sizes:
            if "error" in checks[sms]:
                continue
            with green_scope(sms):
                alone[sms] = timed(lambda: compiled(x, conv_weights), 10)
        report["decoder_alone_ms"] = {str(k): v * 1e3 for k, v in alone.items()}
        print("decoder alone, ms:", report["decoder_alone_ms"], flush=True)

        # 3. the engine's chain alone, beside the decoder on a plain stream, beside it on N SMs
        h = torch.randn(256, 2048, device=device, dtype=torch.bfloat16)
        layers = [torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(64)]
        engine = lambda: engine_step(h, layers)  # noqa: E731
        engine_alone = timed(engine, 50)
        beside = {}

        def run_beside(make_scope, label):
            stop = threading.Event()
            launched = [0]

            def decoder_loop():
                with torch.inference_mode(), make_scope():
                    while not stop.is_set():
                        compiled(x, conv_weights)
                        launched[0] += 1
                        torch.cuda.current_stream().synchronize()  # like the writer: one batch at a time
            thread = threading.Thread(target=decoder_loop, daemon=True)
            thread.start()
            time.sleep(0.5)
            before = launched[0]
            t = timed(engine, 100)
            after = launched[0]
            stop.set()
            thread.join()
            beside[label] = {"engine_ms": t * 1e3, "slowdown": t / engine_alone - 1,
                             "decoder_batches_during": after - before}

        run_beside(lambda: torch.cuda.stream(torch.cuda.Stream(device)), "plain stream")
        for sms in sizes:
            if "error" not in checks[sms]:
                run_beside(lambda sms=sms: green_scope(sms), f"green {sms} SMs")
        report["engine_alone_ms"] = engine_alone * 1e3
        report["engine_beside_decoder"] = beside
        print(f"engine chain alone: {engine_alone * 1e3:.3f} ms", flush=True)
        for label, row in beside.items():
            print(f"  beside the decoder on a {label}: {row['engine_ms']:.3f} ms ({row['slowdown']:+.1%}), "
                  f"{row['decoder_batches_during']} decoder batches meanwhile", flush=True)
    if args.out:
        atomic_write_json(args.out, report)  # never over an existing file


if __name__ == "__main__":
    main()
