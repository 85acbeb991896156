"""The driver interface on the reference backend (backends/driver.py, hf.ReferenceDriver): batches of
compatible jobs equal jobs run alone, cancellation, a bad job failing alone, urgent jobs first, and
idle time counted apart from taking in jobs."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from terra_cli.backends.base import Sampling
from terra_cli.backends.driver import JobFeed, RolloutJob
from terra_cli.backends.hf import HfBackend
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

TOKENS = 16


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("driver"), tiny_config(image_tokens=TOKENS, max_frames=5))
    return HfBackend(checkpoint, device="cpu", dtype="float32")


def job(key: str, seed: int, frames: int = 6, context_frames: int = 2, temperature: float = 0.9) -> RolloutJob:
    rng = np.random.default_rng(seed)
    return RolloutJob(key, rng.integers(0, 512, size=(context_frames, TOKENS)),
                      rng.normal(size=(frames, 6, 3)).astype(np.float32), frames,
                      Sampling(temperature=temperature, seed=seed))


def run(backend, jobs, max_in_flight=1, **callbacks) -> dict[str, np.ndarray]:
    done = {}
    backend.driver(max_in_flight).run(jobs, on_done=lambda j, t: done.__setitem__(j.key, t.copy()), **callbacks)
    return done


def test_a_batch_of_compatible_jobs_draws_what_each_job_draws_alone(backend):
    jobs = [job("a", 1), job("b", 2), job("c", 3, frames=4), job("d", 4, context_frames=3)]
    together = run(backend, jobs, max_in_flight=4)
    for j in jobs:
        np.testing.assert_array_equal(together[j.key], run(backend, [j])[j.key])
    assert together["a"].shape == (6, TOKENS) and (together["a"][2:] != together["b"][2:]).mean() > 0.5


def test_a_continued_job_draws_as_the_whole_video_does(backend):
    """A job that continues a video from a round boundary (a session's step) with frame_offset draws
    the frames the whole video's job drew there: rounds do not restart the random streams."""
    whole = run(backend, [job("whole", 7, frames=8)])["whole"]
    # Round 2 of an 8-frame video with 5-frame rounds starts at frame 2 with 3 context frames.
    tail = replace(job("whole", 7, frames=8), key="tail", context=whole[2:5], actions=job("w", 7, 8).actions[2:],
                   total_frames=5, frame_offset=2)
    np.testing.assert_array_equal(run(backend, [tail])["tail"], whole[2:7])


def test_cancelled_and_failing_jobs_leave_the_others_running(backend):
    feed, errors, cancelled, frames = JobFeed(), [], [], []
    bad = replace(job("bad", 5), actions=np.full((6, 6, 3), np.nan, dtype=np.float32))
    for j in (job("keep", 8), bad, job("drop", 9)):
        feed.put(j)
    feed.close()

    def on_frame(j, index, tokens):
        frames.append((j.key, index))
        if j.key == "keep" and index == 3:
            feed.cancel("drop")  # "drop" waits in the feed: it is reported and never run

    done = run(backend, feed, on_frame=on_frame, on_error=lambda j, exc: errors.append((j.key, str(exc))),
               on_cancelled=lambda j: cancelled.append(j.key))
    assert set(done) == {"keep"} and cancelled == ["drop"]
    assert errors and errors[0][0] == "bad" and "NaN" in errors[0][1]
    assert {key for key, _ in frames} == {"keep"}


def test_a_job_cancelled_mid_run_stops_and_urgent_jobs_go_first(backend):
    feed, order, cancelled = JobFeed(), [], []
    feed.put(job("slow", 10, frames=30))
    feed.put(job("later", 11))
    feed.put(job("first", 12), urgent=True)

    def on_frame(j, index, tokens):
        if j.key not in order:
            order.append(j.key)
        if j.key == "slow" and index == 4:
            feed.cancel("slow")
            feed.close()

    done = run(backend, feed, on_frame=on_frame, on_cancelled=lambda j: cancelled.append(j.key))
    assert order == ["first", "slow", "later"] and cancelled == ["slow"] and set(done) == {"first", "later"}


def test_waiting_on_a_feed_with_nothing_in_flight_is_idle_not_taking_in_jobs(backend):
    feed = JobFeed()
    driver = backend.driver(1)
    thread = threading.Thread(target=driver.run, args=(feed,), kwargs={"idle_wait": 0.05})
    thread.start()
    time.sleep(0.6)
    feed.put(job("x", 13, frames=3))
    feed.close()
    thread.join(60)
    loop = driver.loop.as_dict()
    # the 0.6 s of waiting is idle, not intake (no wall-clock bound: a busy CI machine stretches both)
    assert loop["idle_s"] >= 0.5 and loop["admitting_jobs_s"] < loop["idle_s"] / 2
    parts = sum(loop[k] for k in ("in_engine_step_s", "admitting_jobs_s", "handling_frames_s", "idle_s", "other_s"))
    assert abs(parts - loop["seconds"]) < 0.01


def test_a_held_feed_counts_only_the_time_it_kept_a_waiting_job_from_a_free_slot(monkeypatch):
    """The job feed's hold (a writer behind) costs the engine slots only while a job waits: the
    seconds it kept one back are counted (a bench's engine line says them), a hold with nothing
    queued is not."""
    from terra_cli.backends import driver

    clock, holding = [100.0], [True]
    monkeypatch.setattr(driver.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(driver.time, "sleep", lambda seconds: None)
    feed = driver.JobFeed(hold=lambda: holding[0])
    assert feed.get(0) is None
    clock[0] = 101.0
    assert feed.get(0) is None and feed.held_seconds() == 0.0  # held, but no job waited
    feed.put(job("a", 1))
    assert feed.get(0) is None  # from now on a job is kept back
    clock[0] = 103.5
    assert feed.get(0) is None and feed.held_seconds() == 2.5  # the hold in progress counts
    holding[0] = False
    clock[0] = 104.0
    assert feed.get(0).key == "a" and feed.held_seconds() == 3.0
    clock[0] = 110.0
    assert feed.get(0) is None and feed.held_seconds() == 3.0  # nothing waits: no more is counted
    assert driver.JobFeed().held_seconds() == 0.0  # a feed without a hold
