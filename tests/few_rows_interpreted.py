"""Runs terra's few-rows kernel (kernels/few_rows_matmul.py) under Triton's interpreter, on the logits
and on the layers' projections (split-K), and prints what it computed as JSON, for
tests/test_few_rows_matmul.py. A process of its own: the
interpreter must be chosen before Triton is imported, and the test process may have imported it.

    python tests/few_rows_interpreted.py CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import os
import sys


def main(checkpoint: str) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TERRA_SINGLE_STREAM_LOGITS"] = "few-rows"
    os.environ["TERRA_SINGLE_STREAM_LAYERS"] = "few-rows"
    import numpy as np
    import torch

    from terra_cli.backends.base import Sampling
    from terra_cli.backends.hf import HfBackend
    from terra_cli.backends.single_stream import SingleStreamBackend, SingleStreamDecoder
    from terra_cli.kernels import few_rows_matmul as kernel
    from terra_cli.models.modeling_hf import load_model

    errors = {}
    gen = torch.Generator().manual_seed(0)
    # Rows 1..32 (tiles of 16 and of 32); a vocabulary and a depth that are not multiples of the kernel's blocks.
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 9, 16, 17, 32):
            hidden = torch.randn(rows, 200, generator=gen).to(dtype)
            weight = torch.randn(300, 200, generator=gen).to(dtype)
            out = kernel.few_rows_matmul(hidden, weight)
            exact = hidden.double() @ weight.double().t()
            errors[f"{dtype}-{rows}"] = {"shape": list(out.shape), "dtype": str(out.dtype),
                                         "error": float((out.double() - exact).abs().max() / exact.abs().max())}
    # Split-K: a depth of 700 is 6 blocks of 128 (the last one short); 1, 2, 4 and 6 slices (4 gives 3
    # slices of 2 blocks: none may be empty), against float64, and each the same on a second call.
    hidden = torch.randn(5, 700, generator=gen)
    weight = torch.randn(300, 700, generator=gen)
    exact = hidden.double() @ weight.double().t()
    split_errors, split_repeatable, slices = {}, {}, {}
    for splits in (1, 2, 4, 6):
        out = kernel.few_rows_matmul(hidden, weight, splits)
        split_errors[splits] = float((out.double() - exact).abs().max() / exact.abs().max())
        split_repeatable[splits] = bool(torch.equal(out, kernel.few_rows_matmul(hidden, weight, splits)))
        slices[splits] = kernel.few_rows_partials(hidden, weight, splits).shape[0]
    refused = []
    for bad in (torch.zeros(33, 200), torch.zeros(2, 199)):
        try:
            kernel.few_rows_matmul(bad, torch.zeros(300, 200))
        except ValueError as exc:
            refused.append(str(exc))
    for splits in (0, 7):
        try:
            kernel.few_rows_matmul(hidden, weight, splits)
        except ValueError as exc:
            refused.append(str(exc))

    # A greedy Jacobi rollout whose every decode step's logits come from the kernel: the reference's codes.
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)
    layout = model.layout
    rng = np.random.default_rng(6)
    context = rng.integers(0, layout.image_vocab_size, size=(2, layout.image_tokens))
    actions = rng.normal(scale=2.0, size=(layout.max_frames - 1, 6, 3)).astype(np.float32)
    calls, layer_calls = [], []
    original, original_partials = kernel.few_rows_matmul, kernel.few_rows_partials
    kernel.few_rows_matmul = lambda h, w: calls.append(h.shape[0]) or original(h, w)
    kernel.few_rows_partials = lambda h, w, splits: layer_calls.append(h.shape[0]) or original_partials(h, w, splits)
    decoder = SingleStreamDecoder(model, draft_tokens=3)
    codes = decoder.rollout(context, actions, layout.max_frames, Sampling(temperature=0), 0)
    reference = HfBackend(model=model, device="cpu").generate(context, actions, layout.max_frames,
                                                             Sampling(temperature=0))[0]
    kernel.few_rows_matmul, kernel.few_rows_partials = original, original_partials
    fp8 = fp8_checks(kernel, model, context, actions, layout, gen)
    return {"fp8": fp8, "traced_slices": traced_slices(kernel, gen), "errors": errors, "tile_rows": [kernel.tile_rows(rows) for rows in (1, 16, 17, 32)],
            "refused": refused, "layout": decoder.core.logits_layout,
            "split_errors": split_errors, "split_repeatable": split_repeatable, "slices": slices,
            "layers": decoder.core.ops.projections, "layer_calls": len(layer_calls),
            "layer_rows": sorted(set(layer_calls)), "logits_calls": len(calls), "model_layers": len(model.model.layers),
            "kernel_rows": sorted(set(calls)), "codes_equal": bool(np.array_equal(codes, reference))}


def fp8_checks(kernel, model, context, actions, layout, gen) -> dict:
    """fp8 weights (`quantize_rows_fp8`): the kernel against the product with the weights its values and
    scales stand for, the rounding against the original weights, the refusals, and a greedy rollout with
    every decode step's projections and logits from fp8 copies against the reference on the weights those
    copies stand for (the model's weights first rounded to them, so prompts and steps share one model)."""
    import numpy as np
    import torch

    from terra_cli.backends.base import Sampling
    from terra_cli.backends.hf import HfBackend
    from terra_cli.backends.single_stream import SingleStreamBackend, SingleStreamDecoder

    out = {"errors": {}, "refused": []}
    weight = torch.randn(300, 700, generator=gen)
    weight[7] = 0.0  # an all-zero row stays zero
    values, scale = kernel.quantize_rows_fp8(weight)
    restored = values.double() * scale.double()[:, None]
    bound = weight.double().abs() * 2.0 ** -4 + scale.double()[:, None] * 2.0 ** -10
    out["rounding_within_bound"] = bool(((restored - weight.double()).abs() <= bound).all())
    out["rounding_error"] = float((restored - weight.double()).abs().max() / weight.abs().max())
    out["zero_row"] = bool((restored[7] == 0).all())
    out["dtypes"] = [str(values.dtype), str(scale.dtype)]
    for rows in (1, 9, 32):
        hidden = torch.randn(rows, 700, generator=gen)
        exact = hidden.double() @ restored.t()
        for splits in (1, 2, 6):
            got = kernel.few_rows_matmul(hidden, values, splits, scale=scale)
            out["errors"][f"{rows}-{splits}"] = float((got.double() - exact).abs().max() / exact.abs().max())
    # One row of fp8 weights runs as a plain GEMV (the errors above for rows=1); any weights can, through
    # a lab probe's tile: bf16, float32 and fp8 weights, with split-K
    out["fp8_one_row_tile"] = kernel.tile_for(1, fp8=True).one_row_gemv
    out["other_tiles"] = [kernel.tile_for(1, fp8=False).one_row_gemv, kernel.tile_for(9, fp8=True).one_row_gemv]
    # 17-32 rows of fp8 weights (the errors above for rows=32) take the row batch's narrower tile
    out["block_n_by_rows"] = {f"{rows}-{'fp8' if fp8 else 'bf16'}": kernel.tile_for(rows, fp8=fp8).block_n
                              for rows in (9, 16, 17, 32) for fp8 in (True, False)}
    kernel.tile_override = kernel.Tile(block_n=64, block_k=128, warps=8, stages=3, one_row_gemv=True)
    one = torch.randn(1, 700, generator=gen)
    for name, w, s, reference in (("fp32", weight, None, weight.double()), ("bf16", weight.bfloat16(), None,
                                  weight.bfloat16().double()), ("fp8", values, scale, restored)):
        exact = one.to(w.dtype if s is None else torch.float32).double() @ reference.t()
        for splits in (1, 3):
            os.environ[kernel.PDL_ENV] = "0"  # the plain loop
            got = kernel.few_rows_matmul(one.to(w.dtype if s is None else torch.float32), w, splits, scale=s)
            out["errors"][f"gemv-{name}-{splits}"] = float((got.double() - exact).abs().max() / exact.abs().max())
            # TERRA_FEW_ROWS_PDL=1 (the default): the GEMV's first weight tile loaded ahead (the wait itself is
            # CUDA's), the same products in the same order, so the same bits
            del os.environ[kernel.PDL_ENV]
            peeled = kernel.few_rows_matmul(one.to(w.dtype if s is None else torch.float32), w, splits, scale=s)
            out.setdefault("peeled_equal", {})[f"{name}-{splits}"] = bool(torch.equal(peeled, got))
    kernel.tile_override = None
    for call in (lambda: kernel.few_rows_matmul(torch.zeros(2, 700), values),
                 lambda: kernel.few_rows_matmul(torch.zeros(2, 700), weight, scale=scale),
                 lambda: kernel.few_rows_matmul(torch.zeros(2, 700), values, scale=scale[:10])):
        try:
            call()
        except ValueError as exc:
            out["refused"].append(str(exc))

    with torch.no_grad():  # the model's projections and lm_head rounded to what their fp8 copies hold
        layers = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and (name.startswith("model.layers.") or name == "lm_head")]
        for linear in layers:
            values, scale = kernel.quantize_rows_fp8(linear.weight)
            linear.weight.copy_(values.to(torch.float32) * scale[:, None])
    # the product's option (`--quantization fp8` on single-stream), not the lab switches
    del os.environ["TERRA_SINGLE_STREAM_LOGITS"], os.environ["TERRA_SINGLE_STREAM_LAYERS"]
    scaled_calls, logits_calls = [], []
    original, original_matmul = kernel.few_rows_partials, kernel.few_rows_matmul
    kernel.few_rows_partials = lambda h, w, splits=None, scale=None: (
        scaled_calls.append((str(w.dtype), scale is not None)) or original(h, w, splits, scale))
    kernel.few_rows_matmul = lambda h, w, splits=None, scale=None: (
        logits_calls.append((str(w.dtype), scale is not None)) or original_matmul(h, w, splits, scale))
    backend = SingleStreamBackend(model=model, device="cpu", quantization="fp8")
    out["row_batch_limit"] = backend.driver(128).batch_limit()  # the kernel's larger tile: 32 rows
    decoder = SingleStreamBackend(model=model, device="cpu", draft_tokens=3, quantization="fp8").decoder
    codes = decoder.rollout(context, actions, layout.max_frames, Sampling(temperature=0), 0)
    kernel.few_rows_partials, kernel.few_rows_matmul = original, original_matmul
    # a 20-row step's logits (a row batch of 17-32 sessions): the kernel's tile of 32 over the fp8 copy
    hidden = torch.randn(20, model.config.hidden_size, generator=gen)
    rows_seen = []
    kernel.few_rows_matmul = lambda h, w, splits=None, scale=None: (
        rows_seen.append((h.shape[0], str(w.dtype))) or original_matmul(h, w, splits, scale))
    with torch.no_grad():
        exact = model.lm_head(hidden).double()
        got = decoder.core.logits(hidden).double()
        out["logits_20_rows_error"] = float((got - exact).abs().max() / exact.abs().max())
    kernel.few_rows_matmul = original_matmul
    out["logits_20_rows_calls"] = rows_seen
    reference = HfBackend(model=model, device="cpu").generate(context, actions, layout.max_frames,
                                                             Sampling(temperature=0))[0]
    out.update(layers=decoder.core.ops.projections, logits=decoder.core.logits_layout,
               head_fp8=decoder.core.head_fp8 is not None, scaled_calls=sorted(set(scaled_calls)),
               layer_calls=len(scaled_calls), logits_calls=len(logits_calls),
               scaled_logits=sorted(set(logits_calls)), codes_equal=bool(np.array_equal(codes, reference)))
    return out


def traced_slices(kernel, gen) -> dict:
    """The slices stand in the graph torch.compile traces, so Inductor's cache, keyed by the graph's code,
    tells a TERRA_FEW_ROWS_SPLITS=bytes layer from a default one (it did not when the operator chose them
    inside: on a GPU the cached graph's size check failed and the layers went eager). 32 rows of fp8
    weights, Terra's qkv shape, an H100's 528 programs; the projection bound as `linear_for` binds it."""
    import functools

    import torch

    graphs = []

    def keep_code(graph, inputs):
        graphs.append(graph.code)
        return graph.forward

    values, scale = kernel.quantize_rows_fp8(torch.randn(2560, 2048, generator=gen))
    hidden = torch.randn(32, 2048, generator=gen)
    out = {}
    for mode in ("programs", "bytes"):
        linear = functools.partial(kernel.few_rows_linear, programs=528, splits_mode=mode)
        got = torch.compile(lambda x: linear(x, (values, scale), None), backend=keep_code, dynamic=False,
                            fullgraph=True)(hidden)
        out[mode] = {"slices": kernel.default_splits(hidden, values, 528, mode),
                     "error": float((got - linear(hidden, (values, scale), None)).abs().max())}
    counts = (out["programs"]["slices"], out["bytes"]["slices"])
    out["slice_args"] = [[str(n) for n in counts if f", {n})" in code] for code in graphs]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
