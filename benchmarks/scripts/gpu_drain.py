"""Lab probe (issue 37): the drain of `--videos-at-end` alone, without an engine.

N finished ACT-Bench-shaped videos (random tokens; Terra's tokenizer config with random weights, so the
work per frame is the real one's) go to the engine process's own writer (`local_writer.InProcessWriter`
with decode_after), then `engine_done`: the seconds until every mp4 is made, and the decoder's share.
On one H100 (benchmarks/README.md, 2026-12-06, fifth) the drain of 192 videos after a run took 37.5 s, its
decoder 3.85 ms a frame against 2.58 alone.

Variants, each run in this process one after the other (a warm-up drain of a few videos first, which
pays the decoder's compile):
  one       each batch waited for before the next is launched (the drain before the fifth session of
            2026-12-06: BATCHES_AHEAD=0)
  ahead     the product: a batch kept queued on the card while the host takes the previous one out
The fifth session's drain also decoded four finished videos a call; on one H100 (sixth session) that
measured no faster (192 videos: 24.7-26.0 s against 24.2-25.1 one at a time), and was taken out.

    python3 benchmarks/scripts/gpu_drain.py --videos 192 --variants one,ahead,one,ahead --out $OUT/drain.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from terra_cli.scenarios.local_writer import InProcessWriter  # noqa: E402
from tokenizer_decoder import TERRA_TOKENIZER_CONFIG, ImageTokenizer, host_copies  # noqa: E402

FRAMES = 47  # an ACT-Bench sample: 3 context + 44 generated
VARIANTS = {"one": 0, "ahead": host_copies.BATCHES_AHEAD}  # batches kept queued on the card


def drain(tokenizer: ImageTokenizer, videos: dict[str, np.ndarray]) -> dict:
    writer = InProcessWriter(tokenizer, fps=10, decode_after=True)
    try:
        futures = [writer.submit(key, tokens) for key, tokens in videos.items()]
        time.sleep(0.5)  # every finished video is with the writer's loop before the engine is done
        started = time.perf_counter()
        writer.engine_done()
        for future in futures:
            future.result(timeout=900)
        seconds = time.perf_counter() - started
        stats = writer.decode_stats()
    finally:
        writer.close()
    frames = stats["decode_late_frames"]
    return {"videos": len(videos), "seconds": round(seconds, 3), "decoded_frames": frames,
            "decoder_s": stats["decode_late_s"], "decoder_ms_per_frame": round(1e3 * stats["decode_late_s"] / frames, 3),
            "encoders": writer.tail_encoders}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", type=int, default=192)
    parser.add_argument("--frames", type=int, default=FRAMES)
    parser.add_argument("--variants", default="one,ahead")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=0, device=device)
    rng = np.random.default_rng(0)
    videos = {f"v{i}": rng.integers(0, tokenizer.codebook_size, size=(args.frames, tokenizer.tokens_per_frame))
              for i in range(args.videos)}
    report: dict = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "frames": args.frames, "batch_size": tokenizer.batch_size, "runs": []}
    report["warm_up"] = drain(tokenizer, dict(list(videos.items())[:8]))
    print(f"warm-up: {report['warm_up']}", flush=True)
    for variant in args.variants.split(","):
        host_copies.BATCHES_AHEAD = VARIANTS[variant]
        result = {"variant": variant, **drain(tokenizer, videos)}
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
