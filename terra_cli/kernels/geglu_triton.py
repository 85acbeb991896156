"""The Triton kernels of `geglu_matmul` (why and how: that module's docstring). Apart because importing
this imports Triton, which `geglu_matmul` does only where a kernel runs."""

import triton
import triton.language as tl


@triton.jit
def _tile_origin(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (row block, column block). Grouped ordering: GROUP_M row blocks walk the
    column blocks together, reusing them from L2."""
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _dot_pair(x, w_h, w_g, acc_h, acc_g, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One depth step of both halves' products, from the one x tile."""
    if UPCAST:  # Triton's interpreter (the CPU tests) gets bf16 dots wrong; float32 holds bf16 exactly
        x = x.to(tl.float32)
        acc_h = tl.dot(x, w_h.to(tl.float32), acc_h)
        acc_g = tl.dot(x, w_g.to(tl.float32), acc_g)
    elif IEEE:  # float32 inputs: full-precision products, as F.linear's (TF32 is off by default)
        acc_h = tl.dot(x, w_h, acc_h, input_precision="ieee")
        acc_g = tl.dot(x, w_g, acc_g, input_precision="ieee")
    else:
        acc_h = tl.dot(x, w_h, acc_h)
        acc_g = tl.dot(x, w_g, acc_g)
    return acc_h, acc_g


@triton.jit
def _gated(acc_h, acc_g):
    """hidden * gelu(gate), F.gelu's exact (erf) form, in float32."""
    return acc_h * (0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476)))


@triton.jit
def geglu_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Loads wrap rows and columns past the edges back into range (no masks in the loop); the store
    # drops them. 64-bit offsets: 400,000 rows of 5,120 outputs pass 2^31 elements.
    load_rows = (rows % M).to(tl.int64)
    load_cols = (cols % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + load_rows[:, None] * stride_xm + ks[None, :]
    h_ptrs = w_ptr + load_cols[None, :] * stride_wn + ks[:, None]  # W[n].T: (BLOCK_K, BLOCK_N)
    g_ptrs = w_ptr + (load_cols + N)[None, :] * stride_wn + ks[:, None]  # W[N + n].T

    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w_h = tl.load(h_ptrs)
            w_g = tl.load(g_ptrs)
        else:
            k_ok = (start + ks) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w_h = tl.load(h_ptrs, mask=k_ok[:, None], other=0.0)
            w_g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        acc_h, acc_g = _dot_pair(x, w_h, w_g, acc_h, acc_g, UPCAST, IEEE)
        x_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
        g_ptrs += BLOCK_K

    if HAS_BIAS:
        acc_h += tl.load(b_ptr + load_cols).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + N + load_cols).to(tl.float32)[None, :]
    out = _gated(acc_h, acc_g).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def geglu_tma_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    # Out-of-range rows and depths load as zeros. A last column block's hidden rows may run into the gate
    # half (rows N and up): those columns are past N and the store drops them.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    o_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K):
        acc_h, acc_g = _dot_pair(x_desc.load([m0, k]), w_desc.load([n0, k]).T, w_desc.load([N + n0, k]).T,
                                 acc_h, acc_g, UPCAST, IEEE)
    if HAS_BIAS:
        cols = n0 + tl.arange(0, BLOCK_N)
        acc_h += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    o_desc.store([m0, n0], _gated(acc_h, acc_g).to(out_ptr.dtype.element_ty))
