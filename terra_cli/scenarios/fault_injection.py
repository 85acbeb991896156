"""Faults a scenario run can be told to inject, from the environment, for tests and lab probes:
a slow engine, a Ray engine held until a file appears, one that cannot start, a scenario that fails
on every engine, a writer the engine may not run ahead of, videos held back. Unset, they inject
nothing. They live here, not among the runners' functions, so that nothing of the product looks
like a test."""

from __future__ import annotations

import os
import time
from pathlib import Path


FRAME_DELAY_ENV = "TERRA_TEST_FRAME_DELAY"
FRAME_GATE_ENV = "TERRA_TEST_FRAME_GATE"
FRAME_GATE_LIMIT_S = 120.0  # a gate never opened lets the engine go on after this, so a broken test ends


def injected_frame_delay(engine: int = 0) -> float:
    """Seconds engine `engine` sleeps after each frame: TERRA_TEST_FRAME_DELAY="0.5" for every
    engine, or "1=0.3,2=0.1" per engine index (a one-engine run is engine 0). Tests make an engine
    deliberately slow, or a run long enough for a Ctrl-C to land mid-run."""
    delay = 0.0
    for part in filter(None, os.environ.get(FRAME_DELAY_ENV, "").split(",")):
        index, equals, seconds = part.partition("=")
        if not equals:
            delay = float(index)  # every engine's, unless one is named
        elif int(index) == engine:
            return float(seconds)
    return delay


def injected_frame_gate(engine: int) -> str:
    """A file Ray engine `engine` waits for after each frame: TERRA_TEST_FRAME_GATE="0=/tmp/open". A test
    holds an engine until something else has happened (another engine has rejoined and written),
    where a fixed delay would have to be long enough for the slowest machine."""
    for part in filter(None, os.environ.get(FRAME_GATE_ENV, "").split(",")):
        index, _, path = part.partition("=")
        if int(index) == engine:
            return path
    return ""


def wait_for_gate(path: str, limit_s: float = FRAME_GATE_LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def injected_start_failure(engine: int) -> bool:
    """TERRA_RAY_TEST_START_FAIL="1,2": these engines' actors raise in their constructor, as one does
    whose vLLM refuses to start (tests: the run says so and the others do the work)."""
    return str(engine) in os.environ.get("TERRA_RAY_TEST_START_FAIL", "").split(",")


def injected_failures() -> frozenset[str]:
    """TERRA_RAY_TEST_FAIL="a,b": scenarios every engine fails (tests: a scenario that passes
    validation and still fails on every engine)."""
    return frozenset(filter(None, os.environ.get("TERRA_RAY_TEST_FAIL", "").split(",")))


def injected_video_hold() -> int:
    """TERRA_RAY_TEST_HOLD_VIDEOS=N: every engine returns no video until it has generated N frames
    (tests: an engine must take new work while its finished rollouts' videos are still being made)."""
    return int(os.environ.get("TERRA_RAY_TEST_HOLD_VIDEOS", "0") or 0)


def injected_writer_backlog() -> int | None:
    """TERRA_TEST_WRITER_BACKLOG=2: a one-engine run takes no new scenario while this many finished
    ones wait to be written (the product's bound is far larger). A test that acts on the first
    results line then knows the engine has not run ahead to the end behind a slow-starting writer."""
    value = os.environ.get("TERRA_TEST_WRITER_BACKLOG")
    return int(value) if value else None
