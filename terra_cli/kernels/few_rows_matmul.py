"""A few rows against a tall weight: (M, K) @ (N, K).T for M <= 32, reading the weight once.

What it is for: a Jacobi step's logits (K + 1 = 9 rows) over Terra's lm_head (262,144 x 2,048 bf16,
1.07 GB). On the H100 cuBLAS runs 2-16 rows of it as an sm75 CUTLASS kernel at about 1 ms, 2.5x its
one-row GEMV (0.39 ms, 2.7 TB/s), and padding the rows to 16 picked the same kernel
(benchmarks/README.md, issue 41). The work is memory-bound: 9 rows are 9.7 GFLOP against 1.07 GB, so
a kernel that streams the weight once at the card's bandwidth is the floor for any row count up to
16. Here each program owns `BLOCK_N` vocabulary rows and walks K with the hidden rows (a few KB,
from L2) as the left operand of one tensor-core tile of 16 rows (32 for 17-32), accumulating in float32.

It computes the single-stream decoder's logits on CUDA by default (one row, or a Jacobi step's K + 1;
`backends/static_kv.py`): 3.5-4.7% off a plain step, 25% off a K=8 Jacobi step on H200s
(benchmarks/README.md, 2026-11-27 and 2026-11-29); `TERRA_SINGLE_STREAM_LOGITS=linear` keeps cuBLAS's.

The layers' projections are short by comparison (Terra's: 2,560 to 11,264 outputs over 2,048 or
5,632 inputs), so `BLOCK_N` columns a program would give 16 to 88 programs, too few to keep an H100's
132 SMs streaming; cuBLAS's small-M tiles read them at ~2.1 TB/s (62% of the card). Split-K: each
program also takes one of `splits` slices of K, writing float32 partial sums that one reduction over
the slices adds in a fixed order (the same sum on every call: no atomics). `splits_for` picks the
fewest slices that give every SM a few programs. `TERRA_SINGLE_STREAM_LAYERS=few-rows` runs the
decode step's projections through it (`backends/layer_ops.py`): on an H100 (2026-11-28) it read the
step's 3.0 GB in the same 1.30 ms as cuBLAS, so it stays a lab switch; one tile shape for every
projection is what it lacks (benchmarks/README.md).

fp8 weights (`quantize_rows_fp8`: float8_e4m3fn with one float32 scale per output row) halve the bytes a
step reads, and reading the weights is what a one-row step's GEMMs are bound by. The kernel widens each
fp8 tile to the hidden rows' dtype in registers and multiplies each output column by its row's scale.
It approximates the weights (to about 2^-4 of each value), so it runs only when asked: `--quantization
fp8` on the single-stream backend (0.83 against 1.05 s a frame on an H200, 2026-11-29), or the lab
switches `TERRA_SINGLE_STREAM_LAYERS=few-rows-fp8` and `TERRA_SINGLE_STREAM_LOGITS=few-rows-fp8`. One row
of fp8 weights runs as a plain GEMV on the CUDA cores (`tile_for`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from terra_cli.runtime import choice_switch

# A call's rows sit in one tensor-core tile of 16 (up to 16 rows: a Jacobi step's K + 1, the rows of
# small batches) or of 32 (a row batch of 17-32 sessions' steps with fp8 weights); the rows past M masked off.
TILE_ROWS = (16, 32)
MAX_ROWS = TILE_ROWS[-1]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
PROGRAMS_PER_SM = 4  # split-K's aim: enough programs in flight per SM to hide the weight's latency


@dataclass(frozen=True)
class Tile:
    """A launch's shape: output columns and depth a program takes per loop, warps, pipeline stages, and
    whether one row runs as a plain GEMV on the CUDA cores instead of a tensor-core tile of 16 rows, 15
    of them masked."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    one_row_gemv: bool = False


# Measured on an H200 (benchmarks/README.md, 2026-11-29: gpu_fp8_rows.py's sweep of 32 tiles over a
# Terra-size step's weight reads, one row, CUDA graphs). bf16 weights: this tile, as measured in the
# decoder (lm_head at 4.4 TB/s). fp8 weights at one row: the GEMV with 8 warps read the step in 0.95 ms
# against 1.29 ms for the tensor-core tile; the tensor core's masked rows cost more than the widening.
TENSOR_CORE_TILE = Tile(block_n=128, block_k=128, warps=4, stages=4)
FP8_ONE_ROW_TILE = Tile(block_n=64, block_k=128, warps=8, stages=3, one_row_gemv=True)
# fp8 weights at 17-32 rows (a row batch of many sessions): the same sweep at 32 rows on an H100 (2026-12-07c)
# read a step's layers and lm_head, partials summed, in 1.395 ms with this tile against 1.591 with
# TENSOR_CORE_TILE: half the columns a program gives twice the programs, so fewer split-K slices (and
# float32 partials) fill the SMs. In a 32-row step's profile: 0.91 against 1.06 ms (two H100 hosts).
FP8_ROW_BATCH_TILE = Tile(block_n=64, block_k=128, warps=4, stages=3)
tile_override: Tile | None = None  # a lab probe's one tile for every call (gpu_fp8_rows.py's sweep)


def tile_rows(rows: int) -> int:
    """The tensor-core tile's rows for a call of `rows`: the smallest of `TILE_ROWS` that holds them."""
    return next(size for size in TILE_ROWS if rows <= size)


def tile_for(rows: int, fp8: bool) -> Tile:
    if tile_override is not None:
        return tile_override
    if fp8 and rows == 1:
        return FP8_ONE_ROW_TILE
    return FP8_ROW_BATCH_TILE if fp8 and rows > TILE_ROWS[0] else TENSOR_CORE_TILE


# The kernel is launched as a programmatic dependent launch (Hopper and later; `launch_pdl`; TERRA_FEW_ROWS_PDL=0:
# a plain launch, to compare), so in the decode step's CUDA graph it may start while the kernel before it ends,
# and wait (`gdc_wait`) only before it reads the hidden rows, that kernel's output: the weights, no
# kernel's output, stream in meanwhile (at one row the GEMV's first tile is loaded before the wait). At one
# row of fp8 weights the step's 89 projections read 4-23 MB each at a quarter of the card's bandwidth, so
# each kernel's start and end are much of its time (benchmarks/README.md, 2026-11-29). The same products in
# the same order. Read at each launch (outside any trace: the operators are opaque to torch.compile).
# Measured on H100s with Inductor's kernels launched so too (backends/step_compile.py, where they go together:
# alone it was 7% slower at one row): the same codes, 32 sessions +3.3% and +3.9%, one rollout +1.1% (fp8
# weights) and +0.6% (bf16). =wait launches it so with the wait at its start and no early read (a lab probe).
PDL_ENV = "TERRA_FEW_ROWS_PDL"
PDL_MODES = ("0", "1", "wait")


def pdl_mode(environ=None) -> str:
    """PDL_ENV: `1` (unset: a programmatic dependent launch; the one-row GEMV reads its first weight tile before
    it waits), `0` (a plain launch), `wait` (the same launch, every kernel waiting first: to tell the launch's
    effect from the early read's)."""
    return choice_switch(PDL_ENV, PDL_MODES, "1, wait or 0", environ) or "1"


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def few_rows_kernel(h_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, k_per_split, stride_hm, stride_wn, stride_os,
                        stride_om, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, SCALED: tl.constexpr, ONE_ROW: tl.constexpr, PEEL: tl.constexpr,
                        GDC: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        k_from = split * k_per_split
        k_to = tl.minimum(K, k_from + k_per_split)
        if ONE_ROW:  # a plain GEMV: products and a row sum on the CUDA cores, no tile of 15 masked rows
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if PEEL:  # the first weight tile asked for before the wait (PDL_ENV)
                ks = k_from + tl.arange(0, BLOCK_K)
                w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                            mask=(cols[:, None] < N) & (ks[None, :] < k_to), other=0.0)
                if GDC:  # the hidden row is the kernel before's output; the weights are no kernel's
                    tl.extra.cuda.gdc_wait()
                for start in range(k_from, k_to, BLOCK_K):
                    ks = start + tl.arange(0, BLOCK_K)
                    h = tl.load(h_ptr + ks, mask=ks < k_to, other=0.0).to(tl.float32)
                    total += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
                    ks = ks + BLOCK_K  # the next tile (past k_to: masked, nothing read)
                    w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                                mask=(cols[:, None] < N) & (ks[None, :] < k_to), other=0.0)
            else:
                if GDC:
                    tl.extra.cuda.gdc_wait()
                for start in range(k_from, k_to, BLOCK_K):
                    ks = start + tl.arange(0, BLOCK_K)
                    h = tl.load(h_ptr + ks, mask=ks < k_to, other=0.0).to(tl.float32)
                    w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                                mask=(cols[:, None] < N) & (ks[None, :] < k_to), other=0.0)
                    total += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
            if GDC:
                tl.extra.cuda.gdc_launch_dependents()
            if SCALED:
                total *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
            tl.store(out_ptr + split * stride_os + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)
        else:
            rows = tl.arange(0, ROWS)
            acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            if GDC:
                tl.extra.cuda.gdc_wait()
            for start in range(k_from, k_to, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                h = tl.load(h_ptr + rows[:, None] * stride_hm + ks[None, :],
                            mask=(rows[:, None] < M) & (ks[None, :] < k_to), other=0.0)
                w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                            mask=(cols[:, None] < N) & (ks[None, :] < k_to), other=0.0)
                if UPCAST:  # Triton's interpreter (the CPU tests) gets bf16 dots wrong; tf32 holds bf16 exactly
                    acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)))
                elif SCALED:  # fp8 weights, widened exactly (every e4m3 value is a bf16 value)
                    acc += tl.dot(h, tl.trans(w.to(h.dtype)))
                else:
                    acc += tl.dot(h, tl.trans(w))
            if GDC:
                tl.extra.cuda.gdc_launch_dependents()
            if SCALED:  # the product is linear in each output row's weights: scaling a partial sum is exact
                acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
            tl.store(out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    return few_rows_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# TERRA_FEW_ROWS_SPLITS=bytes (a lab switch; unset: "programs") also caps the slices so that the float32
# partials a call writes stay within PARTIALS_SHARE of its weight's bytes. The partials grow with the rows
# and the slices: at 32 rows of fp8 weights the default slices of Terra's projections write about as many
# bytes as the weights hold (qkv: 16 slices x 32 rows x 2,560 x 4 B = 5.2 MB against 5.2 MB of weight), which
# may be why fp8 weights made 32 sessions no faster (benchmarks/README.md, 2026-12-07); unmeasured, so opt-in.
SPLITS_ENV = "TERRA_FEW_ROWS_SPLITS"
PARTIALS_SHARE = 0.25


def splits_mode(environ=None) -> str:
    """SPLITS_ENV: `programs` (unset) or `bytes`."""
    return choice_switch(SPLITS_ENV, ("programs", "bytes"), "programs (the default) or bytes", environ) or "programs"


def splits_for(outputs: int, depth: int, programs_wanted: int, tile: Tile = TENSOR_CORE_TILE, rows: int = 1,
               element_bytes: int = 2, mode: str = "programs") -> int:
    """How many slices of K a product of `outputs` columns over `depth` is cut into: the fewest that
    give `programs_wanted` programs, each slice at least one block of the tile's depth, none empty. 1
    for a tall weight (Terra's lm_head has 2,048 column blocks already). With `mode` `bytes`
    (`splits_mode`), at most as many as keep the partials of `rows` rows within PARTIALS_SHARE of the
    weight's bytes."""
    columns, k_blocks = _cdiv(outputs, tile.block_n), _cdiv(depth, tile.block_k)
    wanted = max(1, min(k_blocks, _cdiv(programs_wanted, columns)))
    if mode == "bytes":
        # partials: slices x rows x outputs x 4 B; the weight: outputs x depth x element_bytes
        wanted = max(1, min(wanted, int(PARTIALS_SHARE * depth * element_bytes / (4 * rows))))
    return _cdiv(k_blocks, _cdiv(k_blocks, wanted))  # equal slices of whole blocks: no empty last one


def runs_on(device: torch.device, environ=None) -> bool:
    """Where the kernel runs: CUDA, or anywhere under Triton's interpreter (the CPU tests)."""
    environ = os.environ if environ is None else environ
    return device.type == "cuda" or environ.get("TRITON_INTERPRET") == "1"


def programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # Triton's interpreter (the CPU tests): split only when asked


def default_splits(hidden: torch.Tensor, weight: torch.Tensor, programs: int | None = None,
                   mode: str | None = None) -> int:
    """`splits_for` this call's rows and weight; `programs` (None: `programs_wanted` for hidden's device)
    and `mode` (None: SPLITS_ENV) as `few_rows_linear` is bound to them."""
    rows, depth = hidden.shape
    wanted = programs_wanted(hidden.device) if programs is None else programs
    return splits_for(weight.shape[0], depth, wanted, tile_for(rows, weight.dtype == FP8), rows, weight.element_size(),
                      splits_mode() if mode is None else mode)


def quantize_rows_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) as float8_e4m3fn values and one float32 scale per row (N,): each row's largest
    magnitude maps to e4m3's largest, 448. weight ~ values * scale[:, None], to within 2^-4 of each
    value (e4m3's 3 bits of mantissa), or for values far below their row's largest within e4m3's
    subnormal step (2^-9 of the scale); an all-zero row stays zero."""
    wide = weight.detach().to(torch.float32)
    scale = (wide.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (wide / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.contiguous(), scale.contiguous()


def _checked_slices(hidden: torch.Tensor, weight: torch.Tensor, splits: int | None,
                    scale: torch.Tensor | None = None) -> tuple[int, int, Tile]:
    """(slices, depth of each, the tile): `splits` (None: `splits_for` this device) made slices of
    whole blocks, none empty."""
    rows, depth = hidden.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"few_rows_matmul takes 1 to {MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != depth or hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"shapes/strides do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if (weight.dtype == FP8) != (scale is not None):
        raise ValueError("few_rows_matmul: fp8 weights take a scale per row (quantize_rows_fp8), others none")
    if scale is not None and (scale.shape != (weight.shape[0],) or scale.dtype != torch.float32):
        raise ValueError(f"few_rows_matmul: a float32 scale per weight row, got {scale.dtype} {tuple(scale.shape)}")
    tile = tile_for(rows, weight.dtype == FP8)
    if splits is None:
        splits = default_splits(hidden, weight)
    k_blocks = _cdiv(depth, tile.block_k)
    if not 1 <= splits <= k_blocks:
        raise ValueError(f"few_rows_matmul: {splits} slices of a depth of {depth} (1 to {k_blocks})")
    k_per_split = _cdiv(k_blocks, splits) * tile.block_k
    return _cdiv(depth, k_per_split), k_per_split, tile


def _launch(hidden: torch.Tensor, weight: torch.Tensor, slices: tuple[int, int, Tile], out: torch.Tensor,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    depth, outputs = hidden.shape[1], weight.shape[0]
    splits, k_per_split, tile = slices
    mode = pdl_mode()
    peel = mode == "1"
    gdc = mode != "0" and hidden.is_cuda and torch.cuda.get_device_capability(hidden.device)[0] >= 9
    _kernel[(_cdiv(outputs, tile.block_n), splits)](
        hidden, weight, weight if scale is None else scale, out, hidden.shape[0], outputs, depth, k_per_split,
        hidden.stride(0), weight.stride(0), out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        ROWS=tile_rows(hidden.shape[0]), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        SCALED=scale is not None, ONE_ROW=tile.one_row_gemv and hidden.shape[0] == 1, PEEL=peel, GDC=gdc,
        num_warps=tile.warps, num_stages=tile.stages, **({"launch_pdl": True} if gdc else {}))
    return out


def few_rows_partials(hidden: torch.Tensor, weight: torch.Tensor, splits: int | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (M, K) @ weight (N, K).T as float32 partial sums over slices of K, (slices, M, N): their
    sum over the first dimension is the product. Left to the caller so that a compiled function adds
    them inside the elementwise kernel that follows, not in kernels of their own. fp8 weights come
    with their rows' `scale` (`quantize_rows_fp8`)."""
    return _partials(hidden, weight, _checked_slices(hidden, weight, splits, scale), scale)


def _partials(hidden: torch.Tensor, weight: torch.Tensor, slices: tuple[int, int, Tile],
              scale: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty((slices[0], hidden.shape[0], weight.shape[0]), dtype=torch.float32, device=hidden.device)
    return _launch(hidden, weight, slices, out, scale)


def few_rows_matmul(hidden: torch.Tensor, weight: torch.Tensor, splits: int | None = None,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (M, K) @ weight (N, K).T -> (M, N) in hidden's dtype, for 1 <= M <= 32. Both contiguous
    in K; on CUDA (or under Triton's interpreter, which the tests use). `splits`: slices of K (None:
    `splits_for` this device; one slice writes the result directly). fp8 weights come with their
    rows' `scale` (`quantize_rows_fp8`)."""
    slices = _checked_slices(hidden, weight, splits, scale)
    if slices[0] > 1:  # float32 partials, added in one fixed order
        return _partials(hidden, weight, slices, scale).sum(0).to(hidden.dtype)
    out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    return _launch(hidden, weight, slices, out, scale)


# The slices are an argument of the operators, not chosen inside them: so they stand in the traced graph, and
# Inductor's cache (keyed by the graph's code, not by its shapes) tells graphs of other slices apart. Chosen
# inside, a graph compiled for one TERRA_FEW_ROWS_SPLITS was reused for the other from the cache, failed its
# size check and left the layers eager (an H100, 2026-12-07).
@torch.library.custom_op("terra::few_rows_partials", mutates_args=())
def few_rows_partials_op(hidden: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`few_rows_partials` as an operator torch.compile keeps whole; the decode step's compiled layer
    functions fuse the slices' sum into their next kernel."""
    return few_rows_partials(hidden, weight, splits)


@few_rows_partials_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    slices, _, _ = _checked_slices(hidden, weight, splits)
    return hidden.new_empty((slices, hidden.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("terra::few_rows_partials_fp8", mutates_args=())
def few_rows_partials_fp8_op(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             splits: int) -> torch.Tensor:
    """`few_rows_partials_op` for fp8 weights and their rows' scale."""
    return few_rows_partials(hidden, weight, splits, scale=scale)


@few_rows_partials_fp8_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, splits: int) -> torch.Tensor:
    slices, _, _ = _checked_slices(hidden, weight, splits, scale)
    return hidden.new_empty((slices, hidden.shape[0], weight.shape[0]), dtype=torch.float32)


def few_rows_linear(x: torch.Tensor, weight, bias: torch.Tensor | None, *, programs: int | None = None,
                    splits_mode: str | None = None) -> torch.Tensor:
    """F.linear for a decode step's few rows (x (..., K), at most 32 rows in all) by the kernel: the
    slices' sum and the bias in float32, then x's dtype (F.linear rounds once too, at its output).
    `weight`: a tensor, or the pair `quantize_rows_fp8` makes (fp8 values, their rows' scale).
    `programs`, `splits_mode`: as `linear_for` binds them, so a compiled step traces no device query or
    environment read (None: read here)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    values, scale = weight if isinstance(weight, tuple) else (weight, None)
    splits = default_splits(rows, values, programs, splits_mode)
    if scale is None:
        out = few_rows_partials_op(rows, values, splits).sum(0)
    else:
        out = few_rows_partials_fp8_op(rows, values, scale, splits).sum(0)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], values.shape[0])


def linear_for(device: torch.device):
    """`few_rows_linear` with this device's wanted programs and SPLITS_ENV read now, where the weights are
    bound, not inside a compiled step's trace."""
    return functools.partial(few_rows_linear, programs=programs_wanted(device), splits_mode=splits_mode())
