"""Faults a scenario run can be told to inject, from the environment, for tests and lab probes:
a slow engine, a scenario that fails on every engine, a writer the engine may not run ahead of,
videos held back. Unset, they inject nothing. They live here, not among the runners' functions, so
that nothing of the product looks like a test."""

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


def injected_single_engine_frame_delay() -> float:
    """TERRA_TEST_FRAME_DELAY=0.5: seconds a one-engine `--scenarios` run (not Ray's engines:
    TERRA_RAY_TEST_FRAME_DELAY) sleeps after each frame, so that a test's Ctrl-C lands mid-run."""
    return float(os.environ.get("TERRA_TEST_FRAME_DELAY") or 0.0)


def injected_writer_backlog() -> int | None:
    """TERRA_TEST_WRITER_BACKLOG=2: a one-engine run takes no new scenario while this many finished
    ones wait to be written (the product's bound is far larger). A test that acts on the first
    results line then knows the engine has not run ahead to the end behind a slow-starting writer."""
    value = os.environ.get("TERRA_TEST_WRITER_BACKLOG")
    return int(value) if value else None
