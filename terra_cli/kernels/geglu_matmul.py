"""diffusers' GEGLU feed-forward input projection as one kernel: (x @ W[:N].T + b[:N]) * gelu(x @ W[N:].T + b[N:]).

What it is for: the refiner UNet's feed-forwards (`FeedForward(activation_fn="geglu")` in every spatial
and temporal transformer block). diffusers' GEGLU runs `proj` (an nn.Linear of 2N outputs) as a cuBLAS
GEMM that writes the (M, 2N) product, then `chunk` + `F.gelu` + `*`, which torch.compile fuses into one
elementwise kernel (`triton_poi_fused_gelu_mul_split`) that reads the (M, 2N) product back and writes the
(M, N) result. At the UNet's first level M is the video's tokens (up to ~400,000 rows) and 2N = 2,560 bf16
columns: 2 GB written by the GEMM and read back, for a 1 GB result. Issue 40: those elementwise passes cost
84 ms of a 1.15 s window on an H200, beside the projection GEMMs themselves.

Here one program computes a BLOCK_M x BLOCK_N tile of the result: two float32 accumulators, one for the
hidden half's columns n and one for the gate half's columns N + n, fed by the same x tile (loaded once per
step of K, used by both tensor-core dots). The epilogue adds the bias and applies the exact (erf) gelu in
float32 and rounds once, to x's dtype, so the (M, 2N) product never reaches memory. diffusers rounds three
times (the GEMM's output, gelu's, the product's), so the two agree to the dtype's rounding, not bit for
bit. Programs are ordered in groups of GROUP_M row blocks so that a group's x rows and the weight's column
blocks stay in L2 (the ordering of Triton's matmul tutorial).

Deterministic by construction: one program owns each output element and walks K in one fixed order, and
the tile is a fixed function of the shape (`tile_for`; never triton.autotune), so a seed gives the same
bits on every run. `PROBE_TILES` are the candidates a GPU probe sweeps through `tile=`
(benchmarks/scripts/gpu_refiner_ops.py).

Measured on an H200 (2026-12-06, benchmarks/README.md): slower than what it replaces. Over the UNet's 48
GEGLUs a call, 290 ms a window with its best tile against 250 for cuBLAS's GEMM and Inductor's gelu x mul
(309 against ~270 in the compiled window): its GEMM runs at ~350 TFLOP/s where cuBLAS's reach ~750 on
these short-K shapes. So `TERRA_REFINER_GEGLU=fused` stays a lab switch, off; it would take a GEMM at
cuBLAS's pace (TMA loads, a persistent warp-specialised kernel) for the fusion to pay. A first step is in
`PROBE_TILES`: tiles with `tma=True` run a second kernel whose x and weight tiles come through device-side
tensor descriptors (Hopper's tensor memory accelerator) and whose result is stored the same way; checked
against float64 under the interpreter, not yet timed on a card (`gpu_refiner_ops.py --only geglu`).

`use_fused_geglu(unet)` swaps every GEGLU of a module tree for `FusedGEGLU`, which keeps the same `proj`
Linear (the state_dict is unchanged) and runs the kernel on CUDA, diffusers' math elsewhere. On CPU the
kernel runs only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HAS_TRITON = importlib.util.find_spec("triton") is not None  # (finding it does not import it)


@dataclass(frozen=True)
class Tile:
    """A launch's shape: the output tile a program computes (BLOCK_M rows by BLOCK_N columns of the
    result, so 2 * BLOCK_N columns of the projection), the depth it takes per loop, warps, pipeline
    stages, and how many row blocks a group of programs shares (L2 reuse of the weight's columns)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8
    tma: bool = False  # the tiles loaded and the result stored by the tensor memory accelerator (Hopper's TMA)

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.block_k, self.warps, self.stages, self.group_m, int(self.tma)]


# Two 128 x 128 float32 accumulators are one 128 x 256 tile's worth (128 registers a thread over 8 warps).
# Of PROBE_TILES on an H200 (2026-12-06), depth 32 in 4 stages was the fastest or within 1% of it on each of
# the UNet's four GEGLU shapes (290.5 ms a window summed, against 307.0 for depth 64 in 3 stages).
LARGE_TILE = Tile(block_m=128, block_n=128, block_k=32, warps=8, stages=4, group_m=8)
NARROW_TILE = Tile(block_m=128, block_n=64, block_k=64, warps=4, stages=4, group_m=8)  # N <= 64
FEW_ROWS_TILE = Tile(block_m=64, block_n=128, block_k=64, warps=4, stages=4, group_m=8)  # M <= 64

# Hopper candidates for a GPU probe's sweep (geglu_matmul(..., tile=t) for each). 128 x 128 x 32 runs
# with 8 warps: with 4, its two accumulators alone would take 256 registers a thread.
PROBE_TILES = (
    LARGE_TILE,
    Tile(block_m=128, block_n=128, block_k=64, warps=8, stages=3, group_m=8),
    Tile(block_m=128, block_n=128, block_k=64, warps=8, stages=4, group_m=8),
    NARROW_TILE,
    FEW_ROWS_TILE,
    Tile(block_m=256, block_n=64, block_k=64, warps=8, stages=3, group_m=8),
    # TMA loads (not yet measured): the pointer kernel's GEMM ran at ~350 TFLOP/s against cuBLAS's ~750
    Tile(block_m=128, block_n=128, block_k=64, warps=8, stages=3, group_m=8, tma=True),
    Tile(block_m=128, block_n=128, block_k=32, warps=8, stages=4, group_m=8, tma=True),
    Tile(block_m=128, block_n=64, block_k=64, warps=4, stages=4, group_m=8, tma=True),
)


def tile_for(M: int, N: int, K: int) -> Tile:
    """The launch shape for M rows, N outputs (each of the two halves), depth K: a fixed table, the same
    tile for the same shape on every call."""
    if M <= 64:
        return FEW_ROWS_TILE
    if N <= 64:
        return NARROW_TILE
    return LARGE_TILE


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def runs_on(device: torch.device, environ=None) -> bool:
    """Where the kernel runs: CUDA, or anywhere under Triton's interpreter (the CPU tests)."""
    environ = os.environ if environ is None else environ
    return device.type == "cuda" or environ.get("TRITON_INTERPRET") == "1"


def reference_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """diffusers' GEGLU.forward, unfused: the projection, its two halves, hidden * gelu(gate)."""
    hidden, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
    return hidden * F.gelu(gate)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError (one line) where the shapes do not make a GEGLU projection."""
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"geglu_matmul: x (..., K) and weight (2N, K), got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if weight.shape[0] % 2 or weight.shape[0] == 0:
        raise ValueError(f"geglu_matmul: the weight's rows are the hidden half and the gate half, so an even "
                         f"number, got {weight.shape[0]}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"geglu_matmul: x's last dimension {x.shape[-1]} is not the weight's depth "
                         f"{weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"geglu_matmul: bias of {weight.shape[0]} values, got {tuple(bias.shape)}")


def _check_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile | None) -> None:
    """ValueError (one line) where the kernel cannot take these tensors or a probe's tile (the table's are
    valid)."""
    if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"geglu_matmul: x, weight and bias in one of float16, bfloat16, float32, got "
                         f"{x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"geglu_matmul: x, weight and bias on one device, got {x.device}, {weight.device}, "
                         f"{None if bias is None else bias.device}")
    if tile is None:
        return
    blocks = (tile.block_m, tile.block_n, tile.block_k)
    if any(b < 16 or b & (b - 1) for b in blocks) or tile.warps < 1 or tile.stages < 1 or tile.group_m < 1:
        raise ValueError(f"geglu_matmul: blocks are powers of two of at least 16, warps, stages and group_m at "
                         f"least 1, got {tile}")
    if tile.tma and (x.stride(0) * x.element_size() % 16 or x.shape[1] * x.element_size() % 16
                     or weight.shape[0] // 2 * x.element_size() % 16 or any(
                         t.data_ptr() % 16 for t in (x, weight))):
        raise ValueError(f"geglu_matmul: a TMA tile needs rows, depth and outputs in multiples of 16 bytes and "
                         f"16-byte aligned tensors, got x {tuple(x.shape)} (row stride {x.stride(0)}), weight "
                         f"{tuple(weight.shape)}")


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Where a kernel writes the TMA descriptors it makes (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    from terra_cli.kernels import geglu_triton  # imports Triton: only where a kernel runs

    M, K = rows.shape
    N = weight.shape[0] // 2
    out = torch.empty((M, N), dtype=rows.dtype, device=rows.device)
    if M == 0:
        return out
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (_cdiv(M, tile.block_m) * _cdiv(N, tile.block_n),)
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  GROUP_M=tile.group_m, UPCAST=interpreted, IEEE=rows.dtype == torch.float32, num_warps=tile.warps,
                  num_stages=tile.stages)
    with torch.cuda.device(rows.device) if rows.device.type == "cuda" else contextlib.nullcontext():
        if tile.tma:
            if rows.device.type == "cuda":
                import triton

                triton.set_allocator(_tma_scratch)
            geglu_triton.geglu_tma_kernel[grid](rows, weight, weight if bias is None else bias, out, M, N, K,
                                                rows.stride(0), **common)
        else:
            geglu_triton.geglu_kernel[grid](rows, weight, weight if bias is None else bias, out, M, N, K,
                                            rows.stride(0), weight.stride(0), out.stride(0),
                                            EVEN_K=K % tile.block_k == 0, **common)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (M, K) rows contiguous in K: a view where `reshape` gives one, a copy otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@torch.library.custom_op("terra::geglu_matmul", mutates_args=())
def geglu_matmul_op(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    tile: list[int] | None) -> torch.Tensor:
    """The kernel on (M, K) rows as an operator torch.compile keeps whole (one opaque call, not a GEMM and
    an elementwise kernel). `tile`: `Tile.as_list()`, or None for `tile_for` this shape."""
    if tile is None:
        chosen = tile_for(rows.shape[0], weight.shape[0] // 2, rows.shape[1])
    else:  # `as_list()`'s seven entries, the last TMA as 0 or 1
        chosen = Tile(*tile[:6], tma=bool(tile[6]))
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return _launch(rows, weight, bias if bias is None else bias.contiguous(), chosen)


@geglu_matmul_op.register_fake
def _(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: list[int] | None) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], weight.shape[0] // 2))


def geglu_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile: Tile | None = None) -> torch.Tensor:
    """(x @ weight[:N].T + bias[:N]) * gelu(x @ weight[N:].T + bias[N:]) -> (..., N) in x's dtype, for x
    (..., K), weight (2N, K) as nn.Linear stores it and bias (2N,) or None. The kernel on CUDA (or under
    Triton's interpreter); `reference_geglu` where it cannot run (CPU, no Triton). `tile`: a launch shape
    of a probe's (None: `tile_for` the shape). ValueError for shapes that are not a GEGLU projection."""
    _check(x, weight, bias)
    if not (runs_on(x.device) and HAS_TRITON):
        return reference_geglu(x, weight, bias)
    rows = _rows(x)
    _check_kernel(rows, weight, bias, tile)
    out = geglu_matmul_op(rows, weight, bias, None if tile is None else tile.as_list())
    return out.reshape(*x.shape[:-1], weight.shape[0] // 2)


class FusedGEGLU(torch.nn.Module):
    """diffusers' GEGLU with its projection and gating in one kernel (`geglu_matmul`). Holds the GEGLU's
    own `proj` Linear, so the state_dict keys (`proj.weight`, `proj.bias`) and the parameters are the
    same objects. On CUDA tensors of float16, bfloat16 or float32 the kernel; otherwise (CPU, other dtypes,
    a `proj` that another pass replaced with something other than an nn.Linear, anything autograd must
    see: the operator has no backward) diffusers' math."""

    def __init__(self, geglu: torch.nn.Module):
        super().__init__()
        self.proj = geglu.proj

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # (*args, **kwargs: diffusers' deprecated `scale`, ignored as GEGLU ignores it)
        proj = self.proj
        if type(proj) is not torch.nn.Linear:
            hidden, gate = proj(hidden_states).chunk(2, dim=-1)
            return hidden * F.gelu(gate)
        needs_grad = torch.is_grad_enabled() and (hidden_states.requires_grad or proj.weight.requires_grad)
        if (hidden_states.device.type == "cuda" and hidden_states.dtype in KERNEL_DTYPES and not needs_grad
                and proj.weight.dtype == hidden_states.dtype and HAS_TRITON):
            return geglu_matmul(hidden_states, proj.weight, proj.bias)
        return reference_geglu(hidden_states, proj.weight, proj.bias)


def use_fused_geglu(module: torch.nn.Module) -> int:
    """Replace every diffusers GEGLU below `module` with a `FusedGEGLU` holding its `proj`, in place;
    returns how many places were replaced (a GEGLU shared by several parents stays one module)."""
    from diffusers.models.activations import GEGLU

    fused: dict[int, FusedGEGLU] = {}
    places = []
    for name, child in module.named_modules(remove_duplicate=False):
        if name and isinstance(child, GEGLU):
            places.append(name)
    for name in places:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        geglu = getattr(parent, child_name)
        if id(geglu) not in fused:
            fused[id(geglu)] = FusedGEGLU(geglu)
        setattr(parent, child_name, fused[id(geglu)])
    return len(places)
