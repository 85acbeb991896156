"""Faults a Ray scenario run can be told to inject, from the environment, for tests and lab probes:
a slow engine, a scenario that fails on every engine, videos held back. Unset, they inject nothing. They live here,
not among the runner's functions, so that nothing of the product looks like a test."""

from __future__ import annotations

import os


def injected_frame_delays() -> dict[int, float]:
    """TERRA_RAY_TEST_FRAME_DELAY="1=0.3,2=0.1": engine index -> seconds slept after each frame
    (tests make one engine deliberately slow)."""
    delays = {}
    for part in filter(None, os.environ.get("TERRA_RAY_TEST_FRAME_DELAY", "").split(",")):
        index, _, seconds = part.partition("=")
        delays[int(index)] = float(seconds)
    return delays


def injected_failures() -> frozenset[str]:
    """TERRA_RAY_TEST_FAIL="a,b": scenarios every engine fails (tests: a scenario that passes
    validation and still fails on every engine)."""
    return frozenset(filter(None, os.environ.get("TERRA_RAY_TEST_FAIL", "").split(",")))


def injected_video_hold() -> int:
    """TERRA_RAY_TEST_HOLD_VIDEOS=N: every engine returns no video until it has generated N frames
    (tests: an engine must take new work while its finished rollouts' videos are still being made)."""
    return int(os.environ.get("TERRA_RAY_TEST_HOLD_VIDEOS", "0") or 0)
