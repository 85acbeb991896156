"""A decoder layer's work outside attention, as plain functions over its weights.

The same ops, in the same order, as transformers' LlamaRMSNorm, rotary embedding and LlamaMLP
(so on a CPU the codes are bit for bit those of the modules), but written as functions of tensors:
`torch.compile` can then fuse the elementwise work (RMSNorm's float32 upcast and reductions,
rotary, the residual adds, SiLU times up) into a few kernels around the GEMMs, and one compiled
function serves all layers (a function over tensors is guarded on shapes, a module on its
identity: 22 layers would be 22 compilations, past dynamo's recompile limit).

Only decode steps (a few rows: one code, or a draft window) take the compiled functions; prompts
run them eagerly, so no prompt length is ever compiled.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# TERRA_SINGLE_STREAM_COMPILE=0 keeps the eager functions on CUDA too (to compare, or where
# Inductor cannot build).
COMPILE_ENV = "TERRA_SINGLE_STREAM_COMPILE"


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
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (1, n, 1, d): one angle per row, every head
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def attention_output_and_mlp(x, attended, wo, bo, norm_weight, eps: float, wg, bg, wu, bu, wd, bd):
    """The residual after attention, then the MLP's: x (1, n, H), attended (1, n, heads * d)."""
    x = x + F.linear(attended, wo, bo)
    h = rms_norm(x, norm_weight, eps)
    return x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


class EagerOps:
    attention_inputs = staticmethod(attention_inputs)
    attention_output_and_mlp = staticmethod(attention_output_and_mlp)


class CompiledOps:
    """The two functions through torch.compile (static shapes: a decoder's decode steps have one
    row count). If compiling fails on the first call (a warm-up step, before any CUDA graph
    capture), the eager functions take over and `error` says why."""

    def __init__(self):
        self.error: str | None = None
        self._inputs = torch.compile(attention_inputs, dynamic=False, fullgraph=True)
        self._output = torch.compile(attention_output_and_mlp, dynamic=False, fullgraph=True)

    def _call(self, compiled, eager, *args):
        if self.error is None:
            try:
                return compiled(*args)
            except Exception as error:  # noqa: BLE001 - no Triton or no compiler: eager is correct too
                self.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return eager(*args)

    def attention_inputs(self, *args):
        return self._call(self._inputs, attention_inputs, *args)

    def attention_output_and_mlp(self, *args):
        return self._call(self._output, attention_output_and_mlp, *args)


def compile_wanted(requested: bool) -> bool:
    if os.environ.get(COMPILE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return requested and hasattr(torch, "compile")


class LayerOps:
    """The functions a `StaticKVDecoder` runs per layer, and each layer's weights as their arguments."""

    def __init__(self, model, *, compile_layers: bool):
        config = model.config
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the single-stream decoder runs SiLU MLPs (Llama's); this model's activation is {act!r}")
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eager = EagerOps()
        self.decode = CompiledOps() if compile_wanted(compile_layers) else self.eager

    @property
    def compiled(self) -> bool:
        return self.decode is not self.eager and self.decode.error is None

    def for_rows(self, decode: bool):
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
