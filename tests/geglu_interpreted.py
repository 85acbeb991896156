"""Runs terra's fused GEGLU kernel (kernels/geglu_matmul.py) under Triton's interpreter and prints what it
computed as JSON, for tests/test_geglu_matmul.py: its results against float64 math, repeat calls, its
refusals, and how torch.compile traces it. A process of its own: the interpreter must be chosen before
Triton is imported, and the test process may have imported it.

    python tests/geglu_interpreted.py
"""

from __future__ import annotations

import json
import os
import time


def exact_geglu(x, weight, bias):
    """GEGLU in float64, written out independently of the kernel and of diffusers."""
    import torch

    wide = x.double().reshape(-1, x.shape[-1])
    n = weight.shape[0] // 2
    hidden = wide @ weight[:n].double().t()
    gate = wide @ weight[n:].double().t()
    if bias is not None:
        hidden = hidden + bias[:n].double()
        gate = gate + bias[n:].double()
    out = hidden * 0.5 * gate * (1.0 + torch.erf(gate / 2.0 ** 0.5))
    return out.reshape(*x.shape[:-1], n)


def relative(got, exact) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


def main() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from terra_cli.kernels import geglu_matmul as kernel

    started = time.monotonic()
    gen = torch.Generator().manual_seed(0)

    def operands(shape, n, bias=True, dtype=torch.float32):
        depth = shape[-1]
        x = torch.randn(*shape, generator=gen)
        weight = torch.randn(2 * n, depth, generator=gen) / depth ** 0.5  # gates of about unit size
        b = torch.randn(2 * n, generator=gen) if bias else None
        return x.to(dtype), weight.to(dtype), None if b is None else b.to(dtype)

    small = kernel.Tile(block_m=32, block_n=32, block_k=32, warps=4, stages=1, group_m=4)
    cases = {}

    def check(name, x, weight, bias, tile=None):
        out = kernel.geglu_matmul(x, weight, bias, tile=tile)
        exact = exact_geglu(x, weight, bias)
        cases[name] = {"shape": list(out.shape), "want_shape": list(exact.shape), "dtype": str(out.dtype),
                       "want_dtype": str(x.dtype), "error": relative(out, exact)}
        return out

    # M=300, K=200, N=150: no dimension a multiple of any tile's blocks (K's last block short: the masked
    # loop). The small tile has 10 row blocks in groups of 4 (the last group short) and 5 column blocks.
    for tile_name, tile in (("table", None), ("small", small)):
        for bias in (True, False):
            x, weight, b = operands((300, 200), 150, bias)
            check(f"fp32-2d-{tile_name}-{'bias' if bias else 'nobias'}", x, weight, b, tile)
            x, weight, b = operands((2, 150, 200), 150, bias)
            check(f"fp32-3d-{tile_name}-{'bias' if bias else 'nobias'}", x, weight, b, tile)
    # bfloat16 (the interpreter's bf16 dots are upcast to float32, which holds bf16 exactly)
    for tile_name, tile in (("table", None), ("small", small)):
        x, weight, b = operands((2, 150, 200), 150, True, torch.bfloat16)
        check(f"bf16-3d-{tile_name}-bias", x, weight, b, tile)
    # The table's other tiles: 100 rows of 48 outputs (NARROW_TILE; K=128 a multiple of 64: the unmasked
    # loop), and 5 rows (FEW_ROWS_TILE)
    x, weight, b = operands((100, 128), 48)
    check("fp32-narrow-evenk", x, weight, b)
    x, weight, b = operands((5, 72), 40)
    check("fp32-few-rows", x, weight, b)
    # Rows with a stride past K: a view of wider rows (reshape stays a view), 2-D and 3-D; and a last
    # dimension with a stride of 2 (copied to contiguous rows)
    wide = torch.randn(2, 150, 256, generator=gen)
    _, weight, b = operands((1, 200), 150)
    check("fp32-strided-rows-3d", wide[..., :200], weight, b, small)
    check("fp32-strided-rows-2d", wide[0, :, 56:], weight, b)
    check("fp32-strided-last", torch.randn(2, 150, 400, generator=gen)[..., ::2], weight, b, small)
    # Every probe tile, on a small shape with ragged edges
    probe_errors = {}
    for tile in kernel.PROBE_TILES:
        x, weight, b = operands((70, 40), 20)
        probe_errors[str(tile)] = relative(kernel.geglu_matmul(x, weight, b, tile=tile), exact_geglu(x, weight, b))

    # A second call: the same bits
    x, weight, b = operands((300, 200), 150)
    repeatable = {}
    for tile_name, tile in (("table", None), ("small", small)):
        first = kernel.geglu_matmul(x, weight, b, tile=tile)
        repeatable[tile_name] = bool(torch.equal(first, kernel.geglu_matmul(x, weight, b, tile=tile)))
    # tanh's gelu against erf's on these operands: how far a wrong gelu would land (the test's tolerance
    # must sit below it to tell them apart)
    n = weight.shape[0] // 2
    projected = x.double() @ weight.double().t() + b.double()
    tanh_out = projected[:, :n] * torch.nn.functional.gelu(projected[:, n:], approximate="tanh")
    tanh_gap = relative(tanh_out, exact_geglu(x, weight, b))

    empty = kernel.geglu_matmul(torch.zeros(0, 200), weight, b)

    refused = {}
    bad_calls = {
        "odd_rows": lambda: kernel.geglu_matmul(torch.zeros(4, 200), torch.zeros(301, 200), None),
        "k_mismatch": lambda: kernel.geglu_matmul(torch.zeros(4, 199), torch.zeros(300, 200), None),
        "bias_size": lambda: kernel.geglu_matmul(torch.zeros(4, 200), torch.zeros(300, 200), torch.zeros(150)),
        "dtypes": lambda: kernel.geglu_matmul(torch.zeros(4, 200), torch.zeros(300, 200).bfloat16(), None),
        "tile": lambda: kernel.geglu_matmul(torch.zeros(4, 200), torch.zeros(300, 200), None,
                                            tile=kernel.Tile(48, 32, 32, 4, 1)),
    }
    for name, call in bad_calls.items():
        try:
            call()
            refused[name] = None
        except ValueError as exc:
            refused[name] = str(exc)

    # torch.compile: one opaque call of the operator, no projection or gelu of its own, and one graph for
    # two shapes (dynamic rows); its fake implementation's shapes (opcheck)
    graphs = []

    def record(gm, inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    compiled = torch.compile(lambda x, w, b: kernel.geglu_matmul(x, w, b), backend=record, fullgraph=True,
                             dynamic=True)
    x, weight, b = operands((2, 30, 40), 30)
    compiled_error = relative(compiled(x, weight, b), exact_geglu(x, weight, b))
    x2 = torch.randn(3, 20, 40, generator=gen)
    compiled_error = max(compiled_error, relative(compiled(x2, weight, b), exact_geglu(x2, weight, b)))
    opcheck = torch.library.opcheck(kernel.geglu_matmul_op, (x.reshape(-1, 40), weight, b, None))

    return {"cases": cases, "probe_errors": probe_errors, "repeatable": repeatable, "tanh_gap": tanh_gap,
            "empty_shape": list(empty.shape), "refused": refused, "graphs": graphs,
            "compiled_error": compiled_error, "opcheck": opcheck, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    print(json.dumps(main()))
