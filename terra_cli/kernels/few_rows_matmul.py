"""A few rows against a tall weight: (M, K) @ (N, K).T for M <= 16, reading the weight once.

What it is for: a Jacobi step's logits (K + 1 = 9 rows) over Terra's lm_head (262,144 x 2,048 bf16,
1.07 GB). On the H100 cuBLAS runs 2-16 rows of it as an sm75 CUTLASS kernel at about 1 ms, 2.5x its
one-row GEMV (0.39 ms, 2.7 TB/s), and padding the rows to 16 picked the same kernel
(benchmarks/README.md, issue 41). The work is memory-bound: 9 rows are 9.7 GFLOP against 1.07 GB, so
a kernel that streams the weight once at the card's bandwidth is the floor for any row count up to
16. Here each program owns `BLOCK_N` vocabulary rows and walks K with the hidden rows (a few KB,
from L2) as the left operand of one tensor-core tile of 16 rows, accumulating in float32.

`TERRA_SINGLE_STREAM_LOGITS=few-rows` puts it on the single-stream decoder's decode steps (one row,
or a Jacobi step's K + 1; `backends/static_kv.py`); not measured yet, so not the default.
"""

from __future__ import annotations

import os

import torch

MAX_ROWS = 16  # a tensor-core tile's rows: every call computes 16, the rows past M masked off
BLOCK_N = 128
BLOCK_K = 128

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def few_rows_kernel(h_ptr, w_ptr, out_ptr, M, N, K, stride_hm, stride_wn, stride_om,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + rows[:, None] * stride_hm + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            if UPCAST:  # Triton's interpreter (the CPU tests) gets bf16 dots wrong; tf32 holds bf16 exactly
                acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(h, tl.trans(w))
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    return few_rows_kernel


def few_rows_matmul(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden (M, K) @ weight (N, K).T -> (M, N) in hidden's dtype, for 1 <= M <= 16. Both contiguous
    in K; on CUDA (or under Triton's interpreter, which the tests use)."""
    global _kernel
    import triton

    rows, depth = hidden.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"few_rows_matmul takes 1 to {MAX_ROWS} rows, got {rows}")
    if weight.shape[1] != depth or hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"shapes/strides do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if _kernel is None:
        _kernel = _build()
    out = torch.empty((rows, weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    grid = (triton.cdiv(weight.shape[0], BLOCK_N),)
    _kernel[grid](hidden, weight, out, rows, weight.shape[0], depth, hidden.stride(0), weight.stride(0), out.stride(0),
                  ROWS=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
                  num_warps=4, num_stages=4)
    return out
