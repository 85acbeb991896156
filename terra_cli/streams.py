"""Which CUDA stream each stage's kernels run on, beside the engine's steps: the engine's own (its
priority), the scenario writer's decode-ahead (its stream, its share of the SMs) and `terra serve`'s
pictures. Lab switches read from the environment, each checked in one line (runtime.choice_switch), with
what was measured when it was tried.
"""

from __future__ import annotations

from terra_cli.runtime import choice_switch, whole_number_switch

ENGINE_STREAM_ENV = "TERRA_ENGINE_STREAM_PRIORITY"


def engine_stream_priority(on_gpu: bool, environ=None) -> str:
    """Lab switch (issue 37; off by default, not measured on vLLM): TERRA_ENGINE_STREAM_PRIORITY=high runs
    the engine on a CUDA stream of the card's highest priority. Call it in the thread that builds vLLM,
    before it does: vLLM's model runner keeps the current stream as its main one, and its steps return
    to it. The writer's decode-ahead (a stream of its own, default priority, `local_writer`) then only
    fills the SMs the engine's kernels leave; at one priority the engine's steps ran 17% slower beside
    it (15.99 vs 13.62 ms, 4 x H200, 2026-11-27), while the decoder alone needs ~7% of the card.
    Returns the engine stream's priority: "high" or "default". The single-stream decoder's driver on such
    a stream (tried, then removed) was slower at `terra serve`'s 32 sessions on an H100, with pictures 0.526
    frames/s each against 0.544 and tokens only 0.597 against 0.611 (2026-12-07f, benchmarks/README.md)."""
    if choice_switch(ENGINE_STREAM_ENV, ("default", "high"), "high", environ) in (None, "default"):
        return "default"
    if not on_gpu:
        return "default"
    import torch

    # A priority past the card's range is clamped to its highest (torch.cuda.Stream's rule).
    torch.cuda.set_stream(torch.cuda.Stream(priority=-(1 << 16)))
    return "high"


DECODE_STREAM_ENV = "TERRA_DECODE_STREAM"


def decode_stream_asked(environ=None) -> str:
    """Where the in-process writer's decode-ahead runs its kernels: "own" (a stream of its own, the
    default) or "engine" (TERRA_DECODE_STREAM=engine, a lab switch: the device's default stream, in line
    behind the engine's kernels; `local_writer.InProcessWriter`)."""
    return choice_switch(DECODE_STREAM_ENV, ("own", "engine"), "own or engine", environ) or "own"


DECODE_SMS_ENV = "TERRA_DECODE_SMS"


def decode_sms_asked(environ=None) -> int | None:
    """How many of the card's SMs the in-process writer's decode-ahead may use, from TERRA_DECODE_SMS
    (a lab switch: its kernels on a CUDA green context of that many SMs, `local_writer.InProcessWriter`);
    None: all of them, as any stream. Why: beside the decoder the engine's steps ran 13-15% slower, and
    larger decoder calls slowed them more (benchmarks/README.md, 2026-11-27 night), so what costs the
    engine is how much of the card the decoder holds at once; a bounded share leaves the rest to it."""
    return whole_number_switch(DECODE_SMS_ENV, 1024, "a whole number of SMs (e.g. 16 of an H100's 132)", environ)


# TERRA_PICTURE_STREAM (a lab switch): where `terra serve` decodes session pictures on CUDA. `normal` (unset): a
# stream of its own, of normal priority, its kernels beside the engine's steps; `high`: of high priority, so a
# picture's kernels go ahead of the engine's queued steps; `shared`: the engine's own (default) stream, after the
# steps queued before it (at most two advances, ~85 ms) and never beside them. 32 sessions through the server on
# an H100, one call (2026-12-07e): normal 0.548 frames/s each, high 0.521, shared 0.527, tokens only 0.603; high
# made the steps slower (3.09 against 2.98 ms) and a session waits on the steps as much as on its picture.
PICTURE_STREAM_ENV = "TERRA_PICTURE_STREAM"
PICTURE_STREAMS = ("high", "normal", "shared")


def picture_stream_asked(environ=None) -> str:
    return choice_switch(PICTURE_STREAM_ENV, PICTURE_STREAMS, ", ".join(PICTURE_STREAMS), environ) or "normal"
