"""Issue 41 lab probe: one decode step's weight reads at one row (or `--rows N`), bf16 against fp8 weights.

A one-row step of the single-stream decoder at Terra's size reads every projection of its 22 layers
(q, k and v as one 2,560 x 2,048 weight; o 2,048 x 2,048; gate and up as one 11,264 x 2,048; down
2,048 x 5,632) and lm_head (262,144 x 2,048): 3.0 GB in bf16. This times exactly those products for one
row, each layer with weights of its own (no layer's weights fit in L2), captured as one CUDA graph per
variant and replayed, so launches cost nothing and what is timed is the kernels:

- `cublas`: F.linear on the bf16 weights (the single-stream decoder's default);
- `few-rows`: terra's few-rows kernel on the same bf16 weights (`kernels/few_rows_matmul.py`);
- `few-rows-fp8`: the kernel on fp8 copies with a scale a row (`quantize_rows_fp8`), half the bytes.

For each: ms a step, the layers' share and lm_head's apart, and the bytes read per second; the fp8 rows'
largest error against the bf16 product of the same row. Then (`--sweep`, on by default) the kernel's tile
(a `Tile` of `kernels/few_rows_matmul.py`: BLOCK_N, BLOCK_K, warps, stages, and one row as a plain GEMV
or not, set for every projection through `tile_override`) over a small grid, for bf16 and fp8, each point a
step's layers and lm_head again: which tile reads fastest, and whether one tile serves both. The
variants above run the kernel's own choice (`tile_for`). Needs only torch and Triton (no vLLM):

    PYTHONPATH=$PWD python3 benchmarks/scripts/gpu_fp8_rows.py --out $OUT/fp8_rows.json
    PYTHONPATH=$PWD python3 benchmarks/scripts/gpu_fp8_rows.py --rows 32 --out $OUT/fp8_rows32.json   # a 32-row batch
    PYTHONPATH=$PWD python3 benchmarks/scripts/gpu_fp8_rows.py --dry-run --out /tmp/f.json   # CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from terra_cli.kernels import few_rows_matmul as kernel  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 2048, 5632, 22, 262144
DRY_RUN_SIZES = (256, 512, 2, 1024)  # --dry-run: the same products at toy sizes, on a CPU under Triton's interpreter


def layer_shapes(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    return [(hidden + hidden // 4, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]


def timed_graph(calls, replays: int) -> float:
    """ms per replay of one CUDA graph of `calls`, after a warm-up outside the graph (Triton compiles).
    On a CPU (the dry run): ms per plain pass."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        for call in calls:
            call()
        return 1e3 * (time.perf_counter() - started)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--rows", type=int, default=1, help="rows a product (1: one rollout; 32: a row batch of "
                        "32 sessions, split-K's partials summed after each product as the eager path sums them)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on a CPU under Triton's interpreter "
                        "(checks the script, not a speed)")
    args = parser.parse_args()
    if args.out.exists():  # a file this run did not make stays
        parser.error(f"{args.out} exists; remove it or name another --out")
    hidden_size, intermediate, layer_count, vocab = DRY_RUN_SIZES if args.dry_run else (HIDDEN, INTERMEDIATE, LAYERS, VOCAB)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is first built, and per call
        args.replays = 1
    device = torch.device("cpu" if args.dry_run else "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.perf_counter()
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # the interpreter's dots want float32
    layers = [[torch.randn(n, k, device=device, generator=gen).to(dtype) * 0.02
               for n, k in layer_shapes(hidden_size, intermediate)] for _ in range(layer_count)]
    head = torch.randn(vocab, hidden_size, device=device, generator=gen).to(dtype) * 0.02
    layers8 = [[kernel.quantize_rows_fp8(w) for w in weights] for weights in layers]
    head8 = kernel.quantize_rows_fp8(head)
    rows = {k: torch.randn(args.rows, k, device=device, generator=gen).to(dtype) for k in (hidden_size, intermediate)}
    layer_bytes = {"bf16": sum(w.numel() * 2 for ws in layers for w in ws), "fp8": sum(w.numel() for ws in layers for w in ws)}
    head_bytes = {"bf16": head.numel() * 2, "fp8": head.numel()}

    def products(variant: str, part: str):
        calls = []
        if part == "layers":
            for weights, weights8 in zip(layers, layers8):
                for w, (w8, scale) in zip(weights, weights8):
                    x = rows[w.shape[1]]
                    if variant == "cublas":
                        calls.append(lambda x=x, w=w: F.linear(x, w))
                    elif variant == "few-rows":
                        calls.append(lambda x=x, w=w: kernel.few_rows_matmul(x, w))
                    else:
                        calls.append(lambda x=x, w=w8, s=scale: kernel.few_rows_matmul(x, w, scale=s))
        else:
            x = rows[hidden_size]
            calls.append({"cublas": lambda: F.linear(x, head), "few-rows": lambda: kernel.few_rows_matmul(x, head),
                          "few-rows-fp8": lambda: kernel.few_rows_matmul(x, head8[0], scale=head8[1])}[variant])
        return calls

    result = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
              "replays": args.replays, "variants": {}, "sizes": [hidden_size, intermediate, layer_count, vocab],
              "rows": args.rows, "splits": kernel.splits_mode()}
    for variant in ("cublas", "few-rows", "few-rows-fp8"):
        dtype = "fp8" if variant.endswith("fp8") else "bf16"
        layers_ms = timed_graph(products(variant, "layers"), args.replays)
        head_ms = timed_graph(products(variant, "head"), args.replays)
        row = {"step_ms": round(layers_ms + head_ms, 4), "layers_ms": round(layers_ms, 4), "lm_head_ms": round(head_ms, 4),
               "layers_tb_per_s": round(layer_bytes[dtype] / layers_ms / 1e9, 3),
               "lm_head_tb_per_s": round(head_bytes[dtype] / head_ms / 1e9, 3)}
        result["variants"][variant] = row
        print(json.dumps({variant: row}), flush=True)
    if not args.no_sweep:
        result["sweep"] = []
        gemvs = (False, True) if args.rows == 1 else (False,)  # the plain GEMV serves one row only
        widths = (32, 64, 128) if args.rows > 1 else (64, 128)
        grid = [(n, k, warps, stages, gemv) for gemv in gemvs for n in widths for k in (128, 256)
                for warps in (4, 8) for stages in (3, 4)]
        for block_n, block_k, warps, stages, gemv in grid:
            kernel.tile_override = kernel.Tile(block_n, block_k, warps, stages, one_row_gemv=gemv)
            point = {"block_n": block_n, "block_k": block_k, "warps": warps, "stages": stages, "one_row_gemv": gemv}
            for variant in ("few-rows", "few-rows-fp8"):
                try:
                    point[variant] = round(timed_graph(products(variant, "layers"), args.replays)
                                           + timed_graph(products(variant, "head"), args.replays), 4)
                except Exception as error:  # noqa: BLE001 - a tile the card cannot run: say so, go on
                    point[variant] = f"{type(error).__name__}: {str(error)[:120]}"
            result["sweep"].append(point)
            print(json.dumps(point), flush=True)
        kernel.tile_override = None
    # fp8 against bf16 for one row: the approximation's size (random weights, 0.02 scale)
    x = rows[hidden_size][:1]
    exact = F.linear(x.float(), head.float())
    got = kernel.few_rows_matmul(x, head8[0], scale=head8[1]).float()
    result["lm_head_fp8_max_error_relative"] = round(float((got - exact).abs().max() / exact.abs().max()), 5)
    result["lm_head_fp8_argmax_equal"] = bool(int(got.argmax()) == int(exact.argmax()))
    result["total_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
