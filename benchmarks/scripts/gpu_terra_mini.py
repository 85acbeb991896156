"""The embedded terra-mini default end to end on a GPU through vLLM: sample context -> tokenize
-> generate 25 frames (left turn) -> decode -> mp4 (or a PNG strip where the machine has no
ffmpeg). Writes terra_mini_gpu.{json,mp4|png} to $OUT."""

import json
import os
import time
from pathlib import Path

import numpy as np


def main():
    from terra_cli.actions import preset_actions
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.bench.hf_vs_vllm import timed_generate
    from terra_cli.models.default import default_tokenizer_dir, default_world_model_dir, sample_context_frames
    from terra_cli.media.frames import MediaError, write_video
    from terra_cli.backends.base import Sampling
    from tokenizer_decoder import ImageTokenizer

    out = Path(os.environ.get("OUT", "."))
    tokenizer = ImageTokenizer.from_pretrained(default_tokenizer_dir(), device="cuda")
    context = tokenizer.tokenize(list(sample_context_frames(3)))
    t0 = time.perf_counter()
    backend = VllmBackend(default_world_model_dir(), device="cuda", max_rollouts=4)
    startup = time.perf_counter() - t0
    tokens, times = timed_generate(backend, context, preset_actions("left", 25, 30.0), 25, Sampling(temperature=0.9, seed=0))
    tokens = tokens[0]
    backend.close()
    frames = tokenizer.decode_tokens(tokens)
    try:
        media = write_video(out / "terra_mini_gpu.mp4", frames, fps=10, overwrite=True).name
    except MediaError:  # no ffmpeg on the GPU machine: every 4th frame side by side instead
        from PIL import Image

        media = "terra_mini_gpu.png"
        Image.fromarray(np.concatenate(list(frames[::4]), axis=1)).resize((7 * 256, 144)).save(out / media)
    report = {"media": media, "startup_s": round(startup, 1), "s_per_frame_mean": round(float(np.mean(times)), 4),
              "frames": int(tokens.shape[0]), "max_code": int(tokens.max()), "frame_seconds": [round(t, 3) for t in times]}
    print(json.dumps(report), flush=True)
    (out / "terra_mini_gpu.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
