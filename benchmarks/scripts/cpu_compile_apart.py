"""Does the refiner's compile apart (terra_cli/refiner/compile_apart.py) leave the parent a warm cache?

The feature rests on one assumption: a child process that compiles the same weights file with the
same options fills Inductor's on-disk cache so that the parent's own compile afterwards is served
from it. The unit tests stand the compiles in (a real one costs minutes on a CPU); this probe runs
them for real, on the CPU, with a tiny refiner:

  1. a child (`CompileApart`, the product's class) compiles into an empty cache folder: a cold compile;
  2. this process then loads the same file and compiles (`prepare`, `prepare_vae_decoder`, as the
     stage's thread does), counting Inductor's FX-graph cache hits and misses;
  3. another child compiles into a second empty folder: the cold time again, for the comparison.

    python3 benchmarks/scripts/cpu_compile_apart.py --out /tmp/compile_apart.json

A GPU lease measures the same on Terra's shapes (the engine line's `refiner_compile_s` against
`compiled apart first in`); this says whether the mechanism holds at all, not what it saves there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def child_compile(request, cache: Path) -> dict:
    from terra_cli.refiner.compile_apart import CompileApart

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # the child takes this process's environment
    began = time.perf_counter()
    child = CompileApart(request)
    result = child.wait()
    return {"seconds": round(time.perf_counter() - began, 2), "result": result, "error": child.error}


def parent_compile(weights: Path, options) -> dict:
    from torch._dynamo.utils import counters

    from terra_cli.refiner.refiner import VideoRefiner

    refiner = VideoRefiner.from_checkpoint(str(weights), device="cpu", dtype="float32", options=options)
    counters.clear()
    began = time.perf_counter()
    unet_s = refiner.prepare()
    refiner.prepare_vae_decoder()
    return {"seconds": round(time.perf_counter() - began, 2), "unet_s": round(unet_s, 2),
            "vae_decoder_s": round(refiner.vae_decoder_compile_seconds, 2),
            "vae_decoder_error": refiner.vae_decoder_error, "compile_mode": refiner.compile_mode,
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="terra-compile-apart-") as tmp:
        tmp = Path(tmp)
        os.environ["TERRA_CACHE"] = str(tmp / "terra-cache")
        from terra_cli.refiner.compile_apart import CompileRequest
        from terra_cli.refiner.refiner import RefinerOptions
        from terra_cli.refiner.testing import write_tiny_refiner

        weights = write_tiny_refiner(tmp / "refiner_model.pt")
        options = RefinerOptions(compile="default", batch_windows=1)
        request = CompileRequest(str(weights), "cpu", "float32", options)
        report = {"child_cold": child_compile(request, tmp / "inductor-a")}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-a")  # the parent's compile, after the child
        report["parent_after_child"] = parent_compile(weights, options)
        report["child_cold_again"] = child_compile(request, tmp / "inductor-b")
    report["host"] = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    import torch

    report["host"]["torch"] = torch.__version__
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
