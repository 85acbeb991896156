"""Lab probe (issue 28): where a scenario writer's time goes for one ACT-Bench video.

A writer process (terra_cli/scenarios/writers.py) turns 47 frames of tokens into an mp4: tokens to
codes, the tokenizer's decoder, pixels to uint8, H.264 through ffmpeg, then the read-back check that
counts the written frames. On an H100 (benchmarks/README.md) one took 0.91 s with its process at
260-420% CPU and the GPU 17-22% busy. This times each part separately, in one process, on
Terra's tokenizer config with random weights (the work per frame is the real one's), so the next
change to the writer can aim at the largest part.

    python3 benchmarks/scripts/writer_parts.py --device cuda --out $OUT/writer_parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from terra_cli.media.frames import _video_frame_count, write_video  # noqa: E402
from tokenizer_decoder import TERRA_TOKENIZER_CONFIG, ImageTokenizer  # noqa: E402

FRAMES = 47  # an ACT-Bench sample: 3 context + 44 generated


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up, and the last result."""
    result = fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--frames", type=int, default=FRAMES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    tokenizer = ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=0, device=device)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TERRA_TOKENIZER_CONFIG.codebook_size, size=(args.frames, tokenizer.tokens_per_frame))
    parts: dict[str, float] = {}

    parts["tokens_to_codes"], codes = timed(lambda: tokenizer.tokens_to_codes(tokens).to(device), device, args.repeats)

    def decode():
        with torch.inference_mode(), tokenizer._autocast():
            return [tokenizer.model.decode(chunk) for chunk in codes.split(tokenizer.batch_size)]

    parts["decoder"], pixels = timed(decode, device, args.repeats)
    parts["to_uint8"], frames = timed(lambda: np.concatenate([tokenizer.postprocess(p) for p in pixels]), device,
                                      args.repeats)
    parts["decode_tokens_whole"], _ = timed(lambda: tokenizer.decode_tokens(tokens), device, args.repeats)
    with tempfile.TemporaryDirectory(prefix="terra-writer-parts-") as tmp:
        path = Path(tmp) / "video.mp4"
        parts["write_video_with_check"], _ = timed(lambda: write_video(path, list(frames), fps=10, overwrite=True), device,
                                                   args.repeats)
        parts["read_back_check"], counted = timed(lambda: _video_frame_count(path), device, args.repeats)
        size = path.stat().st_size
    assert counted == args.frames, counted
    parts["h264_without_check"] = parts["write_video_with_check"] - parts["read_back_check"]
    # Issue 37: the decoder per frame at other batch sizes, and in channels-last memory (cuDNN's NHWC
    # convolutions), to size a writer process's decode-ahead batches.
    per_frame: dict[str, float] = {}
    for layout in ("contiguous", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        tokenizer.model.to(memory_format=fmt)
        for batch in (8, 16, 32):
            chunk = codes[:1].expand(batch, -1, -1, -1).contiguous(memory_format=fmt)

            def decode_batch():
                with torch.inference_mode(), tokenizer._autocast():
                    return tokenizer.model.decode(chunk)

            per_frame[f"{layout}_batch{batch}"], _ = timed(decode_batch, device, args.repeats)
            per_frame[f"{layout}_batch{batch}"] /= batch
    tokenizer.model.to(memory_format=torch.contiguous_format)
    # The compiled decoder (what decode-ahead runs on CUDA: ImageTokenizer.compile_decoder), its
    # first-call compile time per batch size, and its frames' agreement with the eager decoder's.
    compiled: dict[str, float] = {}
    if device.type == "cuda" and tokenizer.compile_decoder():
        from terra_cli.refiner.compiled import use_inductor_cache
        from tokenizer_decoder import psnr

        use_inductor_cache()
        for batch in (8, 16):
            chunk = codes[:batch] if codes.shape[0] >= batch else codes[:1].expand(batch, -1, -1, -1).contiguous()

            def decode_compiled():
                with torch.inference_mode(), tokenizer._autocast():
                    return tokenizer._compiled_decode(chunk)

            started = time.perf_counter()
            decode_compiled()
            torch.cuda.synchronize(device)
            compiled[f"compile_s_batch{batch}"] = time.perf_counter() - started
            compiled[f"compiled_batch{batch}"], out = timed(decode_compiled, device, args.repeats)
            compiled[f"compiled_batch{batch}"] /= batch
            if batch == tokenizer.batch_size:
                with torch.inference_mode(), tokenizer._autocast():
                    reference = tokenizer.model.decode(chunk)
                compiled["psnr_db_compiled_vs_eager"] = psnr(tokenizer.postprocess(reference), tokenizer.postprocess(out))
        compiled["error"] = tokenizer.decoder_compile_error
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "frames": args.frames, "batch_size": tokenizer.batch_size, "torch_threads": torch.get_num_threads(),
              "mp4_bytes": size, "seconds": {k: round(v, 4) for k, v in parts.items()},
              "decoder_seconds_per_frame": {k: round(v, 5) for k, v in per_frame.items()},
              "compiled_decoder": {k: (round(v, 5) if isinstance(v, float) else v) for k, v in compiled.items()},
              "seconds_per_video_parts_sum": round(parts["decode_tokens_whole"] + parts["write_video_with_check"], 4)}
    for name, seconds in report["seconds"].items():
        print(f"{name:>24}: {seconds:.3f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
