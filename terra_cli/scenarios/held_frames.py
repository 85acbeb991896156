"""How many decoded frames a video writer keeps for videos still being generated (`frame_store.FrameStore`'s
limit): a frame past it waits for its video's end and is decoded then, beside the engine's steps."""

from __future__ import annotations

from terra_cli.runtime import available_memory_bytes

# At least this many: 12,288 frames of 288x512 are 5.4 GB of host memory, 256 ACT-Bench rollouts.
HELD_FRAMES = 12_288
# Beyond it, at most this share of the host's available memory: four engines on one host (Ray,
# --data-parallel) each hold theirs and leave it over a quarter of what it had.
HELD_MEMORY_SHARE = 0.25


def held_frames_for(in_flight: int, frames: int, image_size: tuple[int, int], available: int | None = None) -> int:
    """The frames a writer keeps decoded ahead for `in_flight` rollouts of up to `frames` frames: all of them,
    as far as HELD_MEMORY_SHARE of the host's `available` memory (bytes; read when None) holds, at least
    HELD_FRAMES. At 286 rollouts an engine (four H200s, 2026-11-28) the fixed 12,288 left ~1,000 frames a wave
    to be decoded at their videos' ends, and a 33 s drain after the last frame."""
    needed = max(0, in_flight) * max(0, frames)
    if needed <= HELD_FRAMES:
        return HELD_FRAMES
    if available is None:
        available = available_memory_bytes()
    if available is None:
        return HELD_FRAMES
    height, width = image_size
    affordable = int(available * HELD_MEMORY_SHARE) // (height * width * 3)
    return max(HELD_FRAMES, min(needed, affordable))
