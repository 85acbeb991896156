"""Where the refiner's VAE decoding goes, and three ways to shorten it (issue 40 lab probe).

The product decodes each refined latent frame as its own one-frame clip (Terra's
`en_and_decode_n_samples_a_time: 1`), in float32, compiled, 4 frames a call: 21.6-23.6 ms a frame on
H200s (2026-11-29), 2.85 TFLOP a frame, so about 12% of the card's bf16 peak; 47 frames are ~1.1 s of a
refined video's ~4 s. This times the product's decoder beside variants that keep its math:

- `product`: `compile_vae_decoder` on `one_frame_clips` of diffusers' decoder as built, NCHW, `--chunk`
  frames a call (the product before 2026-11-29's lease: `VideoRefiner` now runs `both` below);
- `center-taps`: the decoder's 29 temporal [3, 1, 1] convolutions as 1x1 ones of their centre taps
  (`autoencoder.use_center_taps`). In a one-frame clip the other taps only ever meet zero padding, so
  this is the same sum with 11.6% fewer FLOPs (2.52 TFLOP a frame, counted on the meta device), and 2D
  kernels instead of 3D ones;
- `channels-last`: the decoder's convolution weights (`refiner.unet.use_channels_last`, as the UNet's) and
  its input channels-last;
- `both` (what `VideoRefiner` runs on a GPU since 2026-11-29); `product` at twice the chunk; and
  `both-bf16`, `both` with the decoder in bf16: not Terra's float32 math, so its PSNR against the
  product says what an opt-in would cost in pixels.

Each variant is built from the same random weights (Terra's VAE shapes), compiled as the product
compiles its decoder, timed over `--repeats` calls of `--frames` frames (the best call), and compared with
the product's pixels (max difference, PSNR of the uint8 frames). Then the product's decoder is profiled (kernels grouped as `gpu_refiner_profile.py`
groups the UNet's) so the ms a frame can be read against its FLOPs:

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/scripts/gpu_vae_decode.py --out $OUT/vae_decode.json
    PYTHONPATH=$PWD python3 benchmarks/scripts/gpu_vae_decode.py --device cpu --tiny --out /tmp/v.json  # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_refiner_profile import busy_seconds, group_of  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny refiner config (a CPU dry run)")
    parser.add_argument("--chunk", type=int, default=4, help="frames a decoder call (the product's vae_chunk)")
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="product,center-taps,channels-last,both,product-2x,both-bf16")
    args = parser.parse_args()
    if args.out.exists():  # a file this run did not make stays
        parser.error(f"{args.out} exists; remove it or name another --out")

    from terra_cli.refiner.autoencoder import build_vae, decode_latents, one_frame_clips, use_center_taps
    from terra_cli.refiner.compiled import compile_vae_decoder
    from terra_cli.refiner.config import TERRA_REFINER, tiny_refiner_config
    from terra_cli.refiner.refiner import pixels_to_uint8
    from terra_cli.refiner.unet import use_channels_last  # the UNet's: Conv2d and the time Conv3d weights

    on_gpu = args.device.startswith("cuda")
    config = tiny_refiner_config() if args.tiny else TERRA_REFINER
    h, w = config.latent_hw
    gen = torch.Generator().manual_seed(0)
    latents = (torch.randn(args.frames, config.latent_channels, h, w, generator=gen) * config.scale_factor).to(args.device)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
              "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "frames": args.frames, "variants": {}}
    reference = None
    for name in args.variants.split(","):
        torch.manual_seed(0)  # the same random weights for every variant
        vae = build_vae(config, args.device, torch.float32)
        chunk = args.chunk * (2 if name == "product-2x" else 1)
        row = {"chunk": chunk}
        # both-cudnn-benchmark: the product's decoder with cuDNN timing its algorithms for each shape
        torch.backends.cudnn.benchmark = name == "both-cudnn-benchmark"
        if name in ("center-taps", "both", "both-bf16", "both-cudnn-benchmark"):
            row["center_tap_convs"] = use_center_taps(vae.decoder)
        if name in ("channels-last", "both", "both-bf16", "both-cudnn-benchmark"):
            row["channels_last_convs"] = use_channels_last(vae.decoder)
        if name == "both-bf16":  # not Terra's math: the pixels' PSNR says how far it moves them
            vae.decoder.to(torch.bfloat16)
        compiled = compile_vae_decoder(vae) if on_gpu else one_frame_clips(vae)
        memory_format = torch.channels_last if "channels_last_convs" in row else torch.contiguous_format

        def decode(vae=vae, compiled=compiled, chunk=chunk, memory_format=memory_format):
            return decode_latents(vae, latents, config, chunk, decoder=compiled if on_gpu else None,
                                  memory_format=memory_format)

        started = time.perf_counter()
        with torch.inference_mode():
            pixels = decode()
        sync()
        row["first_call_s"] = round(time.perf_counter() - started, 2)
        times = []
        with torch.inference_mode():
            for _ in range(args.repeats):
                started = time.perf_counter()
                decode()
                sync()
                times.append(time.perf_counter() - started)
        row["ms_per_frame"] = round(1e3 * min(times) / args.frames, 3)
        if reference is None:
            reference = pixels
        else:
            from tokenizer_decoder.tokenizer import psnr

            agreement = psnr(pixels_to_uint8(reference), pixels_to_uint8(pixels))
            row["max_abs_diff_vs_product"] = float((pixels - reference).abs().max())
            row["psnr_db_vs_product"] = None if agreement == float("inf") else round(agreement, 2)
        result["variants"][name] = row
        print(json.dumps({name: row}), flush=True)
        if name == "product" and on_gpu:  # where the product's time goes, kernels grouped
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof, torch.inference_mode():
                decode()
                sync()
            with tempfile.TemporaryDirectory() as folder:  # never a file beside --out that the run did not make
                trace = Path(folder) / "trace.json"
                prof.export_chrome_trace(str(trace))
                events = [e for e in json.loads(trace.read_text())["traceEvents"]
                          if e.get("ph") == "X" and e.get("cat") == "kernel"]
            groups, names = defaultdict(float), defaultdict(float)
            for e in events:
                groups[group_of(e.get("name", ""))] += e["dur"] / 1e3 / args.frames
                names[e.get("name", "")[:100]] += e["dur"] / 1e3 / args.frames
            busy = busy_seconds([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events])
            result["product_profile_ms_per_frame"] = {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
            result["product_top_kernels_ms_per_frame"] = [[k, round(v, 3)] for k, v in
                                                          sorted(names.items(), key=lambda kv: -kv[1])[:15]]
            result["product_profile_busy_ms_per_frame"] = round(1e3 * busy / args.frames, 3)
            print(json.dumps({"profile": result["product_profile_ms_per_frame"]}), flush=True)
        del vae, compiled
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
