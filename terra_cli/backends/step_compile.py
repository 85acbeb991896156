"""How a decode step's functions go through torch.compile: whether, in which mode, with which Inductor options.

Every compiled part of the step (the layer functions, `layer_ops.py`; the sampler, `device_sampling.py`; the
step's inputs and final norm, `step_prologue.py`) takes its settings from here, so one switch reaches all of them.
"""

from __future__ import annotations

import torch

from terra_cli.errors import InputError
from terra_cli.runtime import choice_switch, switched_off, whole_number_switch

# TERRA_SINGLE_STREAM_COMPILE=0 keeps the eager functions on CUDA too (to compare, or where
# Inductor cannot build).
COMPILE_ENV = "TERRA_SINGLE_STREAM_COMPILE"
# TERRA_SINGLE_STREAM_COMPILE_MODE=max-autotune-no-cudagraphs lets Inductor time its GEMM choices for
# the step's few rows against cuBLAS (whose small-M tiles read the layers' weights at about 2.1 TB/s
# on the H100, 62% of the card: benchmarks/README.md, issue 41). Unset: torch.compile's default, the
# measured one. The step is captured in a CUDA graph by single_stream.StepGraphs either way.
COMPILE_MODE_ENV = "TERRA_SINGLE_STREAM_COMPILE_MODE"
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
# Inductor turns reductions of at most N terms into sums written out (N=8 by its default), which fuse into
# the kernel that reads them. The few-rows kernel's split-K sums add up to 22 slices: at 32 rows of fp8
# weights on an H100 the 16- and 22-slice ones ran as kernels of their own, 0.38 ms of a 3.65 ms step
# (2026-12-07); with N=32 the o and down projections' sums join the next kernel: that 32-row step's kernels
# 3.69 -> 3.48 ms, one session alone 0.878 -> 0.838 s a frame (2026-12-07c). So the few-rows projections
# compile with SPLIT_SUM_UNROLL; TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=N (a lab switch) sets N for any
# projections (8: Inductor's own).
UNROLL_ENV = "TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS"
SPLIT_SUM_UNROLL = 32
# Inductor's kernels in the step are launched as programmatic dependent launches (Hopper and later; Inductor
# generates none elsewhere), as terra's few-rows kernel is (`few_rows_matmul.PDL_ENV`): each may start while the
# kernel before it ends. With both, on H100s, the same codes every time: 32 sessions in the driver +3.3% and
# +3.9% (two leases), one rollout +1.1% (fp8 weights) and +0.6% (bf16), each against the plain launches in the
# same call (2026-12-07d, e). Either alone was slower at one rollout (Inductor's 1.6%, the kernel's 7%), so
# they go together. Inductor's own TORCHINDUCTOR_ENABLE_PDL, where set, decides for the step's kernels too
# (=0: plain launches, to compare); unset, they are on here and nowhere else in terra.
INDUCTOR_PDL_ENV = "TORCHINDUCTOR_ENABLE_PDL"
# Dynamo keeps at most `recompile_limit` (8) compiled shapes a code object, then runs new shapes
# eagerly without a word but a log line. A decoder asks for one row count a step kind (1, a draft
# window's K) and row batches for five more (2-32): `terra serve` with row batches ran past 8 on an H200
# (2026-11-29, lease 8) and its batched steps went eager.
RECOMPILE_LIMIT = 32


def compile_wanted(requested: bool) -> bool:
    if switched_off(COMPILE_ENV):
        return False
    return requested and hasattr(torch, "compile")


def compile_mode(environ=None) -> str | None:
    """The torch.compile mode of the decode step's layer functions (None: the default)."""
    mode = choice_switch(COMPILE_MODE_ENV, COMPILE_MODES, ", ".join(COMPILE_MODES), environ)
    return None if mode == "default" else mode


def launch_options(environ=None) -> dict:
    """The Inductor options every compiled part of a step takes: programmatic launches (INDUCTOR_PDL_ENV)
    where this torch's Inductor knows them."""
    from torch._inductor import config

    wanted = (choice_switch(INDUCTOR_PDL_ENV, ("0", "1"), "1 or 0", environ) or "1") == "1"
    return {"triton.enable_pdl": True} if wanted and hasattr(config.triton, "enable_pdl") else {}


def compile_options(environ=None, projections: str = "linear") -> dict | None:
    """Inductor options for the decode step's layer functions: `launch_options`, and
    `unroll_reductions_threshold` from UNROLL_ENV, else SPLIT_SUM_UNROLL for the few-rows `projections`
    (None under a compile mode, which torch.compile takes instead of options, not beside them)."""
    threshold = whole_number_switch(UNROLL_ENV, 64, "a whole number of terms from 1 to 64", environ)
    if compile_mode(environ) is not None:
        if threshold is not None:
            raise InputError(f"{UNROLL_ENV} and {COMPILE_MODE_ENV} cannot both be set (torch.compile takes one of "
                             "options and a mode): leave one unset")
        return None
    if threshold is None and projections != "linear":
        threshold = SPLIT_SUM_UNROLL
    options = launch_options(environ)
    if threshold is not None:
        options["unroll_reductions_threshold"] = threshold
    return options or None
