"""Lab probe (issue 37): the tokenizer decoder's compile child (`scenarios.decoder_compile_apart`, the
product's) on an idle card and beside another process that keeps the card busy, each on a cold Inductor
and Triton cache of its own.

Why: until 2026-12-06 (seventh) the engine line read the child's seconds at the parent's first wait, so
`--videos-at-end` runs reported their engine phases (223-344 s) as the child's. How long the child takes
beside an engine's CUDA graphs is what this stands in for: the busy process replays a CUDA graph of bf16
matmuls back to back (vLLM's steps hold the card the same way; the card time-slices between processes).

    python3 benchmarks/scripts/gpu_child_beside.py --beside-limit 100 --out $OUT/child.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BUSY = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    for _ in range(3):
        c = a @ b
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for _ in range(4):
        c = a @ b
print("busy", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    graph.replay()
    torch.cuda.synchronize()
"""


def run_child(request: str, cache: Path, limit: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "terra_cli.scenarios.decoder_compile_apart", request],
                              capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "note": f"not done in {limit:g} s"}
    seconds = round(time.perf_counter() - began, 2)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        return {"seconds": seconds, "note": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    line = json.loads(lines[-1])
    return {"seconds": seconds, "compiled": line["compiled"], "first_decode_s": line["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beside-limit", type=float, default=100.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from tokenizer_decoder import TERRA_TOKENIZER_CONFIG, ImageTokenizer

    work = Path(tempfile.mkdtemp(prefix="child-beside-"))
    tokenizer = ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=0, device="cuda")
    tokenizer.save_pretrained(work / "tokenizer")
    request = json.dumps({"source": str(work / "tokenizer"), "device": "cuda:0", "batch_size": tokenizer.batch_size,
                          "image_size": list(tokenizer.image_size)})
    del tokenizer
    torch.cuda.empty_cache()
    report = {"gpu": torch.cuda.get_device_name(0), "runs": []}

    def record(name: str, result: dict) -> None:
        report["runs"].append({"run": name, **result})
        print(json.dumps(report["runs"][-1]), flush=True)

    record("idle card, cold cache", run_child(request, work / "cache-idle", 300))
    record("idle card, that cache warm", run_child(request, work / "cache-idle", 120))
    busy = subprocess.Popen([sys.executable, "-c", BUSY, str(args.beside_limit + 30)], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline().strip() == "busy"
        record("beside a busy process, cold cache", run_child(request, work / "cache-busy", args.beside_limit))
    finally:
        busy.kill()
        busy.wait()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
