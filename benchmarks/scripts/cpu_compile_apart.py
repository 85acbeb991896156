"""Does a compile apart (terra_cli/compile_apart.py) leave the parent a warm cache?

Both children rest on one assumption: a process that compiles the same graphs (same weights, shapes
and options) fills Inductor's on-disk cache so that the engine process's own compile afterwards is
served from it. The unit tests stand the compiles in (a real one costs minutes on a CPU); this probe
runs them for real, on the CPU:

- `refiner`: a tiny refiner. The product's child (`refiner/compile_apart.py`) compiles into an empty
  cache; this process then loads the same file and compiles as the refiner stage's thread does
  (`prepare`, `prepare_vae_decoder`), counting Inductor's FX-graph cache hits and misses; another
  child compiles into a second empty cache (the cold time again).
- `decoder`: a small tokenizer of Terra's frame size (288x512, 576 codes). The product's child
  (`scenarios/decoder_compile_apart.py`) and then this process compile its decoder as the
  decode-ahead does and decode one full batch (real tokens here). On a CPU the decode-ahead does not
  compile (CUDA only), so both sides are told to (`torch.compile` of the same `model.decode`, as
  `ImageTokenizer.compile_decoder` does on a card); everything else is the product's code.

    python3 benchmarks/scripts/cpu_compile_apart.py --out /tmp/compile_apart.json [--parts refiner,decoder]

A GPU lease measures the same on Terra's shapes beside the engine (the engine line's `compiled apart
first in`); this says whether the mechanism holds at all, not what it saves there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# The decoder's child: the product's main, with the decode-ahead's compile allowed on a CPU
DECODER_CHILD = f"""
import sys
sys.path.insert(0, {str(REPO / 'benchmarks' / 'scripts')!r})
import cpu_compile_apart
cpu_compile_apart.compile_on_cpu()
from terra_cli.scenarios import decoder_compile_apart
sys.exit(decoder_compile_apart.main())
"""


def compile_on_cpu() -> None:
    """`frame_store.compile_decoder` as on a card (Inductor's cache in terra's folder, the decoder
    through `torch.compile`, static shapes), for a decoder on the CPU."""
    import torch

    from terra_cli.refiner.compiled import use_inductor_cache
    from terra_cli.scenarios import frame_store

    def compile_decoder(decoder) -> bool:
        use_inductor_cache()
        decoder._compiled_decode = torch.compile(decoder.model.decode, dynamic=False)
        return True

    frame_store.compile_decoder = compile_decoder


CHILD_ONLY_ENV: dict[str, str] = {}  # --child-env: variables the children have and this process has not


def run_child(request_json: str, command: list[str], cache: Path) -> dict:
    from terra_cli.compile_apart import CompileApart

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # the child takes this process's environment
    saved = {name: os.environ.get(name) for name in CHILD_ONLY_ENV}
    os.environ.update(CHILD_ONLY_ENV)
    began = time.perf_counter()
    try:
        child = CompileApart(request_json, command)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    result = child.wait()
    return {"seconds": round(time.perf_counter() - began, 2), "result": result, "error": child.error}


def fx_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}


def refiner_part(tmp: Path) -> dict:
    from torch._dynamo.utils import counters

    from terra_cli.refiner.compile_apart import CompileRequest
    from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner
    from terra_cli.refiner.testing import write_tiny_refiner

    weights = write_tiny_refiner(tmp / "refiner_model.pt")
    options = RefinerOptions(compile="default", batch_windows=1)
    request = CompileRequest(str(weights), "cpu", "float32", options).to_json()
    command = [sys.executable, "-m", "terra_cli.refiner.compile_apart"]
    report = {"child_cold": run_child(request, command, tmp / "inductor-refiner-a")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-refiner-a")  # the parent's compile, after the child
    refiner = VideoRefiner.from_checkpoint(str(weights), device="cpu", dtype="float32", options=options)
    counters.clear()
    began = time.perf_counter()
    unet_s = refiner.prepare()
    refiner.prepare_vae_decoder()
    report["parent_after_child"] = {"seconds": round(time.perf_counter() - began, 2), "unet_s": round(unet_s, 2),
                                    "vae_decoder_s": round(refiner.vae_decoder_compile_seconds, 2),
                                    "vae_decoder_error": refiner.vae_decoder_error,
                                    "compile_mode": refiner.compile_mode, **fx_counts()}
    report["child_cold_again"] = run_child(request, command, tmp / "inductor-refiner-b")
    return report


def decoder_part(tmp: Path) -> dict:
    import numpy as np
    from torch._dynamo.utils import counters

    from tokenizer_decoder import ImageTokenizer, small_config
    from terra_cli.scenarios import frame_store
    from terra_cli.scenarios.writer_process import DecoderSpec

    config = small_config(ch=32, z_channels=10, num_res_blocks=1, ch_mult=(1,) * 5)
    folder = ImageTokenizer.from_config(config, seed=0, device="cpu").save_pretrained(tmp / "tokenizer")
    decoder = ImageTokenizer.from_pretrained(folder, device="cpu", batch_size=4)
    spec = DecoderSpec.of(decoder)
    request = json.dumps({**spec, "image_size": list(spec["image_size"])})  # decoder_request's, for a card
    command = [sys.executable, "-c", DECODER_CHILD]
    report = {"child_cold": run_child(request, command, tmp / "inductor-decoder-a")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-decoder-a")
    compile_on_cpu()
    frame_store.compile_decoder(decoder)
    rows = np.random.default_rng(0).integers(0, 1024, size=(decoder.batch_size, decoder.tokens_per_frame))
    counters.clear()
    began = time.perf_counter()
    decoder.decode_tokens(rows, full_batches=True)
    report["parent_after_child"] = {"first_batch_s": round(time.perf_counter() - began, 2),
                                    "decoder_compile_error": decoder.decoder_compile_error, **fx_counts()}
    report["child_cold_again"] = run_child(request, command, tmp / "inductor-decoder-b")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="refiner,decoder", help="refiner, decoder or both (comma-separated)")
    parser.add_argument("--import-vllm", action="store_true",
                        help="import vLLM first, as the engine's process has (its import sets Inductor's options)")
    parser.add_argument("--child-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable the children get and this process has not (a difference to test)")
    args = parser.parse_args()
    CHILD_ONLY_ENV.update(item.split("=", 1) for item in args.child_env)
    if args.out.exists():  # a report of another run is never replaced
        parser.error(f"{args.out} exists: name another --out")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    report: dict = {"child_only_env": CHILD_ONLY_ENV}
    if args.import_vllm:
        import vllm  # noqa: F401

        report["vllm"] = {"version": vllm.__version__,
                          "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}
    with tempfile.TemporaryDirectory(prefix="terra-compile-apart-") as tmp:
        tmp = Path(tmp)
        os.environ["TERRA_CACHE"] = str(tmp / "terra-cache")
        for part in parts:
            report[part] = {"refiner": refiner_part, "decoder": decoder_part}[part](tmp)
    import torch

    report["host"] = {"cores": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__}
    from terra_cli.media.atomic import atomic_write_json

    atomic_write_json(args.out, report)  # (refuses a file that appeared meanwhile)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
