"""A decoder layer's work outside attention, as plain functions over its weights.

The same ops, in the same order, as transformers' LlamaRMSNorm, rotary embedding and LlamaMLP
(so on a CPU the codes are bit for bit those of the modules), but written as functions of tensors:
`torch.compile` can then fuse the elementwise work (RMSNorm's float32 upcast and reductions,
rotary, the residual adds, SiLU times up) into a few kernels around the GEMMs, and one compiled
function serves all layers (a function over tensors is guarded on shapes, a module on its
identity: 22 layers would be 22 compilations, past dynamo's recompile limit).

Only decode steps (a few rows: one code, or a draft window) take the compiled functions; prompts
run them eagerly, so no prompt length is ever compiled. The compiled functions also take each
layer's projections concatenated (q, k and v as one weight; gate and up as one): at one row a GEMM
reads its weight once whatever its width, so three GEMMs and two become one each, 66 fewer kernels
a step at Terra's 22 layers. The concatenated weights are copies made once (about 1.2 GB at
Terra's size); prompts keep the modules' own.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from terra_cli.backends.step_compile import (COMPILE_ENV, COMPILE_MODE_ENV, RECOMPILE_LIMIT, SPLIT_SUM_UNROLL,  # noqa: F401
                                             UNROLL_ENV, compile_mode, compile_options, compile_wanted)
from terra_cli.errors import error_summary
from terra_cli.runtime import choice_switch

# TERRA_SINGLE_STREAM_LAYERS=few-rows runs the decode step's four projections a layer through terra's
# split-K kernel for a few rows (kernels/few_rows_matmul.py) instead of cuBLAS, on CUDA (or under
# Triton's interpreter: the CPU tests). Measured on an H100: no faster than cuBLAS (benchmarks/README.md,
# 2026-11-28), so a lab switch. Unset: `linear`. =few-rows-fp8: the same kernel over fp8 copies of the
# decode step's weights (one scale per row: half the bytes a step reads), an approximation of the
# weights: what `--quantization fp8` asks for on this backend (`LayerOps(projections=...)`), never a
# default; prompts keep the modules' own weights.
LAYERS_ENV = "TERRA_SINGLE_STREAM_LAYERS"
LAYER_PROJECTIONS = ("linear", "few-rows", "few-rows-fp8")
# On FlashAttention's cache layout a decode step's k and v go into the cache inside the compiled
# function that makes them (`attention_inputs_written`), not by two `index_copy_` kernels a layer
# (1.7 us each). With one FlashAttention plan a step beside it, 4% off a step on an H200, the same
# bf16 codes (2026-11-29, lease 6). TERRA_SINGLE_STREAM_CACHE_WRITE=separate keeps the copies (to compare).
CACHE_WRITE_ENV = "TERRA_SINGLE_STREAM_CACHE_WRITE"


def cache_write(environ=None) -> str:
    return choice_switch(CACHE_WRITE_ENV, ("fused", "separate"), "fused (the default) or separate", environ) or "fused"


def layer_projections(device: torch.device, environ=None, asked: str | None = None) -> str:
    """How the decode step's projections are computed: `linear` (cuBLAS), or `few-rows` where the
    kernel can run (CUDA, or Triton's interpreter); elsewhere the switch is ignored, as the logits' is.
    `asked`: the decoder's own choice (few-rows-fp8 for fp8 weights), unless the switch names one."""
    from terra_cli.kernels.few_rows_matmul import runs_on

    choice = choice_switch(LAYERS_ENV, LAYER_PROJECTIONS, ", ".join(LAYER_PROJECTIONS), environ) or asked or "linear"
    return choice if runs_on(device, environ) else "linear"


def projection(name: str, device: torch.device):
    """The F.linear-like function `layer_projections` names, for weights on `device`."""
    if name in ("few-rows", "few-rows-fp8"):  # fp8: its weights are (values, scale) pairs, `fp8_weights`
        from terra_cli.kernels.few_rows_matmul import linear_for

        return linear_for(device)
    return F.linear


FP8_KV = torch.float8_e4m3fn  # `StaticKVDecoder(fp8_cache=True)`'s: FlashAttention-3's fp8, as vLLM's fp8 cache
FP8_KV_MAX = 448.0  # its largest finite value


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype. Into fp8 with a scale of 1 (vLLM's fp8 cache default): values past its
    largest finite value saturate (a plain cast would make them NaN)."""
    if x.dtype == dtype:
        return x
    return x.clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def write_cache(cache: torch.Tensor, dim: int, positions: torch.Tensor, x: torch.Tensor) -> None:
    """cache[..., positions, ...] = x along `dim`, converted to the cache's dtype. Eagerly an fp8 cache is
    written through its bytes (the CPU's index_copy_ has no fp8 kernel); compiled, the conversion and the
    store join the kernel that makes x (Inductor writes fp8 itself)."""
    if cache.dtype == x.dtype or torch.compiler.is_compiling():
        cache.index_copy_(dim, positions, to_cache(x, cache.dtype))
    else:
        cache.view(torch.uint8).index_copy_(dim, positions, to_cache(x, cache.dtype).view(torch.uint8))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(x, cos, sin, norm_weight, eps: float, wq, bq, wk, bk, wv, bv, heads: int, kv_heads: int,
                     head_dim: int):
    """x (1, n, H) -> q (1, n, heads, d), k and v (1, n, kv_heads, d), rotary applied to q and k."""
    n = x.shape[1]
    h = rms_norm(x, norm_weight, eps)
    q = F.linear(h, wq, bq).view(1, n, heads, head_dim)
    k = F.linear(h, wk, bk).view(1, n, kv_heads, head_dim)
    v = F.linear(h, wv, bv).view(1, n, kv_heads, head_dim)
    return (*rotated(q, k, cos, sin), v)


def rotated(q, k, cos, sin):
    """Rotary applied to q (1, n, heads, d) and k (1, n, kv_heads, d) with cos/sin (1, n, d)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (1, n, 1, d): one angle per row, every head
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def attention_output_and_mlp(x, attended, wo, bo, norm_weight, eps: float, wg, bg, wu, bu, wd, bd):
    """The residual after attention, then the MLP's: x (1, n, H), attended (1, n, heads * d)."""
    x = x + F.linear(attended, wo, bo)
    h = rms_norm(x, norm_weight, eps)
    return x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


def attention_inputs_fused(x, cos, sin, norm_weight, eps: float, wqkv, bqkv, heads: int, kv_heads: int, head_dim: int,
                           linear=F.linear):
    """`attention_inputs` with q, k and v projected by one GEMM (their weights stacked in that order)."""
    n = x.shape[1]
    h = rms_norm(x, norm_weight, eps)
    q, k, v = linear(h, wqkv, bqkv).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.reshape(1, n, heads, head_dim), k.reshape(1, n, kv_heads, head_dim), v.reshape(1, n, kv_heads, head_dim)
    return (*rotated(q, k, cos, sin), v)


def attention_inputs_written(x, cos, sin, keys, values, positions, *weights, linear=F.linear):
    """`attention_inputs_fused` that also writes k and v into the cache (1, positions, KV, d) at
    `positions` and returns q alone: compiled, the writes join the kernel that makes k and v instead of
    two `index_copy_` kernels of their own a layer (`CACHE_WRITE_ENV`). On an fp8 cache q comes back in
    fp8 as well, as FlashAttention-3 reads it beside one: the rounding in that kernel too, not ~8 small
    kernels a layer of their own (2026-12-06, lease 7: those cost more than the halved key reads saved)."""
    q, k, v = attention_inputs_fused(x, cos, sin, *weights, linear=linear)
    write_cache(keys, 1, positions, k)
    write_cache(values, 1, positions, v)
    return to_cache(q, keys.dtype)


def attention_output_and_mlp_fused(x, attended, wo, bo, norm_weight, eps: float, wgu, bgu, wd, bd, linear=F.linear):
    """`attention_output_and_mlp` with gate and up projected by one GEMM (gate's rows first)."""
    x = x + linear(attended, wo, bo)
    h = rms_norm(x, norm_weight, eps)
    gate, up = linear(h, wgu, bgu).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, wd, bd)


def stacked(*tensors):
    """Rows stacked into one tensor (biases: None when the projections have none)."""
    if all(t is None for t in tensors):
        return None
    return torch.cat([t.detach() for t in tensors]).contiguous()


class EagerOps:
    attention_inputs = staticmethod(attention_inputs)
    attention_output_and_mlp = staticmethod(attention_output_and_mlp)


class FusedOps:
    """The fused-projection functions run eagerly (what CompiledOps compiles), their projections by
    `linear`."""
    error = None

    def __init__(self, linear=F.linear):
        self.attention_inputs = functools.partial(attention_inputs_fused, linear=linear)
        self.attention_inputs_written = functools.partial(attention_inputs_written, linear=linear)
        self.attention_output_and_mlp = functools.partial(attention_output_and_mlp_fused, linear=linear)


LOG = logging.getLogger("terra.single_stream")


class EagerFallback:
    """Calls compiled functions until one fails (no Triton, no compiler: on a warm-up call, before any CUDA
    graph capture); from then on their eager twins, and `error` says why, also as one warning line: eager
    steps are slower, and a run that fell back silently once passed for a measurement (2026-12-07)."""

    def __init__(self):
        self.error: str | None = None

    def call(self, compiled, eager, *args):
        if compiled is not None and self.error is None:
            try:
                return compiled(*args)
            except Exception as error:  # noqa: BLE001 - no Triton or no compiler: eager is correct too
                self.error = error_summary(error)
                LOG.warning(f"the decode step's {type(self).__name__} could not run compiled ({self.error}); "
                            f"it runs eager from now on, slower ({COMPILE_ENV}=0 skips the compile)")
        return eager(*args)


class CompiledOps(EagerFallback):
    """The functions through torch.compile (static shapes: one compiled graph a row count). If
    compiling fails on the first call (a warm-up step, before any CUDA graph capture), the eager
    functions take over and `error` says why."""

    def __init__(self, mode: str | None = None, linear=F.linear, options: dict | None = None):
        super().__init__()
        self._eager = FusedOps(linear)
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        # The module's functions themselves where they can be: partials all run through one wrapper of
        # dynamo's, whose one code object would hold every function's shapes under one limit.
        plain = linear is F.linear
        compile = functools.partial(torch.compile, dynamic=False, fullgraph=True, mode=mode, options=options)
        self._inputs = compile(attention_inputs_fused if plain else self._eager.attention_inputs)
        self._written = compile(attention_inputs_written if plain else self._eager.attention_inputs_written)
        self._output = compile(attention_output_and_mlp_fused if plain else self._eager.attention_output_and_mlp)

    def attention_inputs(self, *args):
        return self.call(self._inputs, self._eager.attention_inputs, *args)

    def attention_inputs_written(self, *args):
        return self.call(self._written, self._eager.attention_inputs_written, *args)

    def attention_output_and_mlp(self, *args):
        return self.call(self._output, self._eager.attention_output_and_mlp, *args)


class LayerOps:
    """The functions a `StaticKVDecoder` runs per layer, with each layer's weights bound:
    `for_rows(decode)` gives the decode steps' (compiled, fused projections) or the prompts' (eager,
    the modules' own weights); both are called as `attention_inputs(layer_index, x, cos, sin)` and
    `attention_output_and_mlp(layer_index, x, attended)`."""

    def __init__(self, model, *, compile_layers: bool, fuse_projections: bool | None = None,
                 projections: str | None = None):
        config = model.config
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the single-stream decoder runs SiLU MLPs (Llama's); this model's activation is {act!r}")
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        layers = model.model.layers
        self.eager = BoundOps(EagerOps(), [self.attention_weights(layer) for layer in layers],
                              [self.output_weights(layer) for layer in layers])
        compiled = compile_wanted(compile_layers)
        device = next(model.parameters()).device
        self.projections = layer_projections(device, asked=projections)
        linear = projection(self.projections, device)
        # Fusing is what the compiled path runs; `fuse_projections` alone (eager) lets a CPU check it,
        # and so does the few-rows kernel under Triton's interpreter.
        if compiled or fuse_projections or self.projections != "linear":
            if compiled:
                functions = CompiledOps(compile_mode(), linear, compile_options(projections=self.projections))
            else:
                functions = FusedOps(linear)
            attention = [self.fused_attention_weights(layer) for layer in layers]
            output = [self.fused_output_weights(layer) for layer in layers]
            if self.projections == "few-rows-fp8":
                attention = [fp8_weights(weights, ATTENTION_PROJECTIONS) for weights in attention]
                output = [fp8_weights(weights, OUTPUT_PROJECTIONS) for weights in output]
            self.decode = BoundOps(functions, attention, output)
        else:
            self.decode = self.eager

    @property
    def compiled(self) -> bool:
        return isinstance(self.decode.functions, CompiledOps) and self.decode.functions.error is None

    @property
    def compile_error(self) -> str | None:
        return getattr(self.decode.functions, "error", None)

    def for_rows(self, decode: bool) -> "BoundOps":
        return self.decode if decode else self.eager

    def attention_weights(self, layer) -> tuple:
        attention, norm = layer.self_attn, layer.input_layernorm
        return (norm.weight, norm.variance_epsilon, attention.q_proj.weight, attention.q_proj.bias,
                attention.k_proj.weight, attention.k_proj.bias, attention.v_proj.weight, attention.v_proj.bias,
                self.heads, self.kv_heads, self.head_dim)

    def output_weights(self, layer) -> tuple:
        attention, norm, mlp = layer.self_attn, layer.post_attention_layernorm, layer.mlp
        return (attention.o_proj.weight, attention.o_proj.bias, norm.weight, norm.variance_epsilon,
                mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
                mlp.down_proj.weight, mlp.down_proj.bias)

    def fused_attention_weights(self, layer) -> tuple:
        attention, norm = layer.self_attn, layer.input_layernorm
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        return (norm.weight, norm.variance_epsilon, stacked(*(p.weight for p in projections)),
                stacked(*(p.bias for p in projections)), self.heads, self.kv_heads, self.head_dim)

    def fused_output_weights(self, layer) -> tuple:
        attention, norm, mlp = layer.self_attn, layer.post_attention_layernorm, layer.mlp
        return (attention.o_proj.weight, attention.o_proj.bias, norm.weight, norm.variance_epsilon,
                stacked(mlp.gate_proj.weight, mlp.up_proj.weight), stacked(mlp.gate_proj.bias, mlp.up_proj.bias),
                mlp.down_proj.weight, mlp.down_proj.bias)


# Where the projection weights sit in `fused_attention_weights` (q, k and v) and `fused_output_weights`
# (o; gate and up; down).
ATTENTION_PROJECTIONS = (2,)
OUTPUT_PROJECTIONS = (0, 4, 6)


def fp8_weights(weights: tuple, positions: tuple) -> tuple:
    """`weights` with the projections at `positions` as (fp8 values, row scales) pairs, what
    `few_rows_linear` reads for `few-rows-fp8`."""
    from terra_cli.kernels.few_rows_matmul import quantize_rows_fp8

    return tuple(quantize_rows_fp8(w) if i in positions else w for i, w in enumerate(weights))


class BoundOps:
    """A pair of layer functions and every layer's arguments for them."""

    def __init__(self, functions, attention_weights: list, output_weights: list):
        self.functions = functions
        self.attention = attention_weights
        self.output = output_weights

    def attention_inputs(self, index: int, x, cos, sin):
        return self.functions.attention_inputs(x, cos, sin, *self.attention[index])

    def attention_inputs_written(self, index: int, x, cos, sin, keys, values, positions):
        return self.functions.attention_inputs_written(x, cos, sin, keys, values, positions, *self.attention[index])

    @property
    def writes_cache(self) -> bool:
        return hasattr(self.functions, "attention_inputs_written")

    def attention_output_and_mlp(self, index: int, x, attended):
        return self.functions.attention_output_and_mlp(x, attended, *self.output[index])
