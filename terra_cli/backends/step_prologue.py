"""A decode step's inputs made by one compiled function, and its final norm by another.

Before the first layer a decode step turns its codes and positions into the layers' inputs: the code's
embedding, the position's spatial and temporal embeddings (a division, a remainder and a clamp to find
them), their sums, and the rotary rows at the position (clamped to the table). Eagerly that is about a dozen
kernels of a few microseconds each, with a launch gap after each even inside a CUDA graph: at one rollout, a
step of ~1.4 ms (fp8 weights, an H100) spent about a tenth of its time with the GPU idle between ~350 kernels
(benchmarks/README.md). Compiled, Inductor makes them one or two kernels.

The compiled function keeps eager's bits: gathers, integer arithmetic and two bf16 additions, compiled with
Inductor's `emulate_precision_casts` so that the first sum is rounded to the weights' dtype before the second,
as eager rounds it (Inductor otherwise adds the three in float32 and rounds once).

The final norm after the last layer (six eager kernels) is compiled as the layers' own norms are, and like them
it is not bit for bit eager's: Inductor sums the squares in another order, so a last bit of a hidden state, and
rarely a sampled code, can differ from the eager norm's. On an H100 at one rollout with fp8 weights (2026-12-07e,
one call, the same codes): the inputs compiled 0.806 -> 0.799 s a frame, the norm too 0.789.
TERRA_STEP_PROLOGUE=inputs keeps the norm eager; =eager keeps both eager (to compare).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from terra_cli.backends.layer_ops import EagerFallback, rms_norm
from terra_cli.backends.step_compile import launch_options
from terra_cli.runtime import choice_switch

PROLOGUE_ENV = "TERRA_STEP_PROLOGUE"
PROLOGUE_MODES = ("compiled", "inputs", "eager")


def code_step_inputs(codes: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, spatial: torch.Tensor,
                     temporal: torch.Tensor, rotary: tuple | None, last_position: int):
    """Codes (n,) at positions (n,) -> (embeds (1, n, H), rotary rows): `model.embed`'s sum for code rows
    (token + spatial[p % S] + temporal[min(p // S, T - 1)]), and, given rotary (cos, sin) tables
    (1, P, d), their rows at the positions clamped to `last_position` (None without tables)."""
    frame = torch.clamp(positions // spatial.shape[0], max=temporal.shape[0] - 1)
    position = F.embedding(positions % spatial.shape[0], spatial) + F.embedding(frame, temporal)
    embeds = F.embedding(codes, tokens)
    embeds = (embeds + position.to(embeds.dtype))[None]
    return embeds, None if rotary is None else rotary_rows(rotary, positions, last_position)


def rotary_rows(tables: tuple, positions: torch.Tensor, last_position: int) -> tuple:
    """The rows of rotary (cos, sin) tables (1, P, d) at positions (n,) clamped to `last_position` (draft rows
    past the last frame; `StaticKVDecoder.hidden` says why): (1, n, d) each."""
    at = positions.clamp(max=last_position)
    return tables[0].index_select(1, at), tables[1].index_select(1, at)


def prologue_mode(environ=None) -> str:
    return choice_switch(PROLOGUE_ENV, PROLOGUE_MODES, ", ".join(PROLOGUE_MODES) + " (compiled: the default)",
                         environ) or "compiled"


class StepPrologue(EagerFallback):
    """`code_step_inputs` over `model`'s embedding tables and the decoder's rotary tables, and `norm(x)`, the
    model's final norm, each compiled where `compiled` (the decoder's layer functions are) unless PROLOGUE_ENV
    keeps it eager. A failed compile (on a warm-up step, before any CUDA graph capture) leaves both eager;
    `error` says why."""

    def __init__(self, model, rotary: tuple | None, last_position: int, compiled: bool, environ=None):
        super().__init__()
        mode = prologue_mode(environ)
        embeddings = model.pos_embedding_spatio_temporal
        if rotary is not None and rotary[0].dtype != model.model.embed_tokens.weight.dtype:
            rotary = None  # `StaticKVDecoder.hidden` makes them itself then, as before
        self.tables = (model.model.embed_tokens.weight, embeddings.spatio_embeddings.weight,
                       embeddings.temporal_embeddings.weight, rotary, last_position)
        self.final_norm = model.model.norm
        compile = functools.partial(torch.compile, dynamic=False, fullgraph=True)
        launches = launch_options()
        self._inputs = (compile(code_step_inputs, options={"emulate_precision_casts": True, **launches})
                        if compiled and mode != "eager" else None)
        self._norm = compile(rms_norm, options=launches or None) if compiled and mode == "compiled" else None

    @property
    def compiled(self) -> bool:
        return self._inputs is not None and self.error is None

    def __call__(self, codes: torch.Tensor, positions: torch.Tensor):
        return self.call(self._inputs, code_step_inputs, codes, positions, *self.tables)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if self._norm is None:
            return self.final_norm(x)
        return self.call(self._norm, rms_norm, x, self.final_norm.weight, self.final_norm.variance_epsilon)
