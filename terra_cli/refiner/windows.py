"""Which frames each refiner window covers, Terra's way (`video_refiner_decode` in generate.py).

Windows hold `window` (25) frames. The first starts at 0; each next one starts at
min(previous end - min_overlap, frames - window), so it overlaps the previous one by at least
`min_overlap` (3) frames and the last window ends exactly at the last frame. After sampling, the
frames a window shares with the previous one are dropped from it, and the remaining latents are
decoded together. Examples: 25 frames -> [(0, 25)]; 26 -> [(0, 25), (1, 26)];
47 -> [(0, 25), (22, 47)]; 50 -> [(0, 25), (22, 47), (25, 50)].

A video shorter than a window has no window Terra could refine (its loop would slice past the
end); we refuse it (`check_frames`).
"""

from __future__ import annotations

from terra_cli.errors import InputError


def start_end_indices(frames: int, window: int = 25, min_overlap: int = 3) -> list[tuple[int, int]]:
    check_frames(frames, window)
    spans = [(0, window)]
    while spans[-1][1] < frames:
        start = min(spans[-1][1] - min_overlap, frames - window)
        spans.append((start, start + window))
    return spans


def kept_frames(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For each window, the (from, to) slice of its own frames that survives overlap removal."""
    kept = [(0, spans[0][1] - spans[0][0])]
    for (_, prev_end), (start, end) in zip(spans, spans[1:]):
        kept.append((prev_end - start, end - start))
    return kept


def check_frames(frames: int, window: int = 25) -> None:
    if frames < window:
        raise InputError(f"the refiner needs at least {window} frames (one window), got {frames}; "
                         "shorter videos decode frame by frame (`terra generate`'s default, --decoder frames)")


def count_windows(frames: int, window: int = 25, min_overlap: int = 3) -> int:
    return len(start_end_indices(frames, window, min_overlap))
