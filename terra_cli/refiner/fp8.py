"""`--refiner-dtype fp8`: the refiner UNet's attention and feed-forward Linear layers in float8.

Opt-in and never chosen for you: `auto` (the default) keeps the whole refiner in the run's dtype
(bf16 on a GPU, float32 on a CPU). With `fp8`, every nn.Linear inside the UNet's spatial and
temporal transformer blocks (attention projections `to_q/to_k/to_v/to_out`, the feed-forwards
`ff`, `ff_in`) becomes an `Fp8Linear`:

- weights float8_e4m3fn with one float32 scale per output channel (amax / 448), made once at load;
- activations quantized per token (one scale per row, amax / 448) at each call;
- the matmul is `torch._scaled_mm` with those row-wise scales, output in bf16 on CUDA (row-wise
  scaling there takes bf16 only) and in the input's dtype on the CPU, then cast back to the input's
  dtype; the bias is added by `_scaled_mm`.

Convolutions, norms, the time/ADM embeddings, the transformers' `proj_in`/`proj_out`, the attention
itself (QK^T, softmax, AV) and the VAE stay in the run's dtype. `_scaled_mm` runs on the CPU in the
torch terra installs (2.13), so the CPU runs the same code as the GPU (slower than float32 there:
it is for tests, not speed). On CUDA it needs compute capability 8.9 or newer (Ada, Hopper).
On an H100 (2026-11-27, Terra's shapes, random weights): slower than bf16 (1.33 vs 1.20 s a window,
compiled), 58 dB PSNR from bf16: the per-token activation quantizing costs more than it saves; again
on 2026-12-07 (1.280 against 1.164 s, and 1.177 with TERRA_REFINER_FP8_LAYERS=compute-bound): the quantizing
is a reduction pass of its own that reads the activations twice (amax, then the cast).
"""

from __future__ import annotations

import torch
from torch import nn

from terra_cli.errors import InputError

REFINER_DTYPES = ("auto", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_CUDA_CAPABILITY = (8, 9)
# Linear layers of these blocks are quantized (attention projections, feed-forwards).
QUANTIZED_BLOCKS = (".transformer_blocks.", ".temporal_transformer_blocks.")
# An H100's bf16 ridge: 989 TFLOP/s over 3.35 TB/s. A Linear of K inputs and N outputs does 2KN FLOPs a token
# for 2(K + N) bytes of bf16 activations in and out, so below KN / (K + N) = 295 its bf16 GEMM is already
# bound by memory, and fp8 (which adds a pass to quantize the activations) cannot make it faster. Terra's
# 320-channel level (K, N of 320 and 2,560 or 1,280) sits at 160-284; the 640 and 1,280 levels at 320-1,138.
COMPUTE_BOUND_FLOP_PER_BYTE = 295.0


def check_refiner_dtype(value: str) -> str:
    value = str(value).strip().lower()
    if value not in REFINER_DTYPES:
        raise InputError(f"--refiner-dtype must be auto or fp8, got {value!r}")
    return value


def check_fp8_device(device: str) -> None:
    """Refuse fp8 where `torch._scaled_mm` cannot run: CUDA below compute capability 8.9, or a
    torch whose CPU build lacks it."""
    if str(device).startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        if (major, minor) < MIN_CUDA_CAPABILITY:
            raise InputError(f"--refiner-dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(torch.device(device))} is {major}.{minor}: use "
                             f"--refiner-dtype auto")
        return
    try:
        one = torch.ones(16, 16, dtype=FP8)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        raise InputError(f"--refiner-dtype fp8: this torch ({torch.__version__}) has no fp8 matmul on the CPU "
                         f"({type(exc).__name__}); use --refiner-dtype auto") from None


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> float8 (M, K) and float32 scales (M, 1) with rows ~= q * scale (one scale per row)."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """An nn.Linear with float8 weights (per-output-channel scales) and per-token activation scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("qweight", weight)  # (out, in) float8
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, out) float32
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_scale = quantize_rows(x.reshape(-1, self.in_features))
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(rows, self.qweight.t(), scale_a=row_scale, scale_b=self.weight_scale,
                               bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"


def flop_per_byte(linear: nn.Linear) -> float:
    """A token's FLOPs over its activations' bytes (in and out, 2 bytes each): KN / (K + N)."""
    k, n = linear.in_features, linear.out_features
    return k * n / (k + n)


def quantize_unet_linears(unet: nn.Module, min_flop_per_byte: float = 0.0) -> int:
    """Replace the Linear layers of the UNet's transformer blocks by `Fp8Linear`, in place; returns
    how many. `_scaled_mm` takes dimensions that are multiples of 16 (all of Terra's and the tiny
    configs'); a layer of other sizes stays as it is, and so does one whose `flop_per_byte` is below
    `min_flop_per_byte` (`COMPUTE_BOUND_FLOP_PER_BYTE`: only the layers whose bf16 GEMM is compute-bound)."""
    chosen = [(name, module) for name, module in unet.named_modules()
              if isinstance(module, nn.Linear) and any(block in f".{name}" for block in QUANTIZED_BLOCKS)
              and module.in_features % 16 == 0 and module.out_features % 16 == 0
              and flop_per_byte(module) >= min_flop_per_byte]
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        setattr(unet.get_submodule(parent_name), child, Fp8Linear(module))
    return len(chosen)
