"""`--backend single-stream` behind the one driver interface (backends/single_stream_driver.py):
the reference driver's tokens for the same jobs (rounds, frame offsets, seeds), cancellation and
a failing job on their own, Jacobi drafts through `load_backend`, and its options checked once."""

import threading

import numpy as np
import pytest

from conftest import invoke_terra
from terra_cli.backends import load_backend
from terra_cli.pipeline.engine_request import check_backend_options, engine_options
from terra_cli.backends.base import Sampling
from terra_cli.backends.driver import JobFeed, RolloutJob
from terra_cli.backends.hf import HfBackend
from terra_cli.errors import InputError
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

CODES, VOCAB, ROUND = 40, 64, 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=ROUND)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("single_stream_driver"), config, seed=2)


@pytest.fixture(scope="module")
def backends(checkpoint):
    single = load_backend("single-stream", checkpoint, device="cpu", dtype="float32")
    reference = HfBackend(checkpoint, device="cpu", dtype="float32")
    yield single, reference
    single.close()


def job(key, seed, total=6, offset=0, temperature=0.9):
    rng = np.random.default_rng(seed % 1000)
    return RolloutJob(key, rng.integers(0, VOCAB, size=(2, CODES)), rng.normal(scale=2.0, size=(total, 6, 3)).astype(np.float32),
                      total, Sampling(temperature=temperature, top_k=20, seed=seed), frame_offset=offset)


def closed_feed(jobs):
    """A feed holding `jobs`, closed: a driver returns once they are done."""
    feed = JobFeed()
    for j in jobs:
        feed.put(j)
    feed.close()
    return feed


def run(driver, jobs, **callbacks):
    done, frames = {}, []
    driver.run(jobs, on_frame=lambda j, i, t: frames.append((j.key, i)),
               on_done=lambda j, tokens: done.__setitem__(j.key, tokens.copy()), **callbacks)
    return done, frames


def test_jobs_draw_the_reference_drivers_tokens_over_rounds_and_frame_offsets(backends):
    single, reference = backends
    jobs = [job("a", 7, total=6), job("b", 2**40 + 5, total=5, offset=3)]  # 6 frames: two rounds of at most 4
    expected, _ = run(reference.driver(1), jobs)
    feed = closed_feed(jobs)
    driver = single.driver(4)
    got, frames = run(driver, feed)
    assert sorted(got) == ["a", "b"]
    for key in got:
        np.testing.assert_array_equal(got[key], expected[key])
    assert frames == [("a", i) for i in range(2, 6)] + [("b", i) for i in range(2, 5)]  # one job after the other
    assert driver.loop.steps == 7 * (CODES - 1)


def test_a_cancelled_job_stops_and_a_bad_job_fails_alone(backends):
    single, _ = backends
    bad = RolloutJob("bad", np.full((2, CODES), VOCAB + 5), np.zeros((5, 6, 3), np.float32), 5, Sampling())
    feed = closed_feed([job("first", 1), bad, job("last", 3, total=4)])
    cancelled, errors = [], []

    def on_frame(j, index, tokens):
        if j.key == "first":
            feed.cancel("first")

    done = {}
    single.driver(1).run(feed, on_frame=on_frame, on_done=lambda j, t: done.__setitem__(j.key, t),
                         on_cancelled=lambda j: cancelled.append(j.key), on_error=lambda j, e: errors.append((j.key, e)))
    assert cancelled == ["first"]
    assert [key for key, _ in errors] == ["bad"] and isinstance(errors[0][1], InputError)
    assert list(done) == ["last"] and done["last"].shape == (4, CODES)


def test_one_round_jobs_waiting_together_run_as_one_row_batch_with_the_reference_drivers_tokens(backends):
    """With `max_in_flight` above 1, jobs that fit one round and sample alike run as one row batch
    (row_batch.py): one decode step for all, frames reported as each comes, each job the reference's tokens."""
    single, reference = backends
    jobs = [job("a", 21, total=4), job("b", 22, total=3, offset=5), job("c", 2**33 + 23, total=4, offset=2)]
    expected, _ = run(reference.driver(1), jobs)
    feed = closed_feed(jobs)
    driver = single.driver(8)
    got, frames = run(driver, feed)
    assert sorted(got) == ["a", "b", "c"]
    for key in got:
        np.testing.assert_array_equal(got[key], expected[key])
    assert frames == [("a", 2), ("b", 2), ("c", 2), ("a", 3), ("c", 3)]  # frame by frame, together
    assert driver.loop.steps == 2 * (CODES - 1) and single.rows.rows == 8


def test_a_job_cancelled_in_a_row_batch_stops_and_the_others_go_on(backends):
    single, reference = backends
    jobs = [job("x", 31, total=4), job("y", 32, total=4)]
    expected, _ = run(reference.driver(1), jobs[1:])
    feed = closed_feed(jobs)
    cancelled, seen, done = [], [], {}

    def on_frame(j, index, tokens):
        seen.append((j.key, index))
        if j.key == "x":
            feed.cancel("x")

    single.driver(2).run(feed, on_frame=on_frame, on_done=lambda j, t: done.__setitem__(j.key, t),
                         on_cancelled=lambda j: cancelled.append(j.key))
    assert cancelled == ["x"] and list(done) == ["y"]
    assert seen == [("x", 2), ("y", 2), ("y", 3)]  # x's second frame was not reported
    np.testing.assert_array_equal(done["y"], expected["y"])


def test_a_row_batch_waits_briefly_for_a_job_of_every_recent_session(backends, monkeypatch):
    """Sessions ask for their next frames a little apart: a batch waits for one job of every session
    (affinity) that ran lately (up to GATHER_S, here made generous) instead of starting with the first
    alone, so sessions that began out of step run together from then on; with no other session, no wait."""
    from dataclasses import replace

    from terra_cli.backends import single_stream_driver

    monkeypatch.setattr(single_stream_driver, "GATHER_S", 5.0)
    monkeypatch.setattr(single_stream_driver, "GATHER_MAX_S", 5.0)
    single, _ = backends
    feed = JobFeed()
    a1, a2 = replace(job("a1", 41, total=3), affinity="A"), replace(job("a2", 43, total=3), affinity="A")
    b1, b2 = replace(job("b1", 42, total=3), affinity="B"), replace(job("b2", 44, total=3), affinity="B")
    feed.put(a1)
    frames, ended = [], []
    driver = single.driver(4)
    assert driver.gather() == (0.0, 0, 0.0)  # no session ran yet: no wait

    def on_done(j, tokens):
        ended.append(j.key)
        if j.key == "a1":  # b1 comes while a1 runs: it runs alone after it, out of step
            feed.put(b1)
        if j.key == "b1":  # then A asks again at once and B 0.3 s later: the batch waits for B
            feed.put(a2)
            threading.Timer(0.3, feed.put, args=(b2,)).start()
        if len(ended) == 4:
            feed.close()

    driver.run(feed, on_frame=lambda j, i, t: frames.append(j.key), on_done=on_done)
    assert frames == ["a1", "b1", "a2", "b2"] and driver.loop.steps == 3 * (CODES - 1)  # a1, b1, then a2+b2 together
    assert driver.gather() == (5.0, 2, 5.0)


def test_a_batch_waits_on_while_sessions_keep_asking(backends, monkeypatch):
    """Four sessions' next frames come 0.3 s apart (a server answering them in turn): each within the
    0.5 s gap of the one before, so the batch waits through all of them, 0.9 s in all, and runs them as one."""
    from dataclasses import replace

    from terra_cli.backends import single_stream_driver

    monkeypatch.setattr(single_stream_driver, "GATHER_S", 0.5)
    monkeypatch.setattr(single_stream_driver, "GATHER_MAX_S", 5.0)
    single, _ = backends
    feed = JobFeed()
    first = [replace(job(f"{s}1", 50 + i, total=3), affinity=s) for i, s in enumerate("ABCD")]
    second = [replace(job(f"{s}2", 60 + i, total=3), affinity=s) for i, s in enumerate("ABCD")]
    for j in first:  # all there at once: one batch without waiting
        feed.put(j)
    ended = []

    def on_done(j, tokens):
        ended.append(j.key)
        if len(ended) == 4:
            for i, later in enumerate(second):
                threading.Timer(0.3 * i, feed.put, args=(later,)).start()
        if len(ended) == 8:
            feed.close()

    driver = single.driver(4)
    driver.run(feed, on_done=on_done)
    assert sorted(ended[4:]) == ["A2", "B2", "C2", "D2"]
    assert driver.loop.steps == 2 * (CODES - 1)  # two row batches of four, one frame each


def test_jobs_of_several_rounds_or_other_sampling_do_not_join_a_row_batch(backends):
    single, _ = backends
    driver = single.driver(8)
    one, other_seed = job("p", 1, total=4), job("q", 2, total=3, offset=9)
    assert driver.compatible(one, other_seed)
    assert not driver.compatible(one, job("r", 3, total=5))  # two rounds of at most 4 frames
    assert not driver.compatible(one, job("s", 4, total=4, temperature=0.5))
    assert single.driver(1).batch_limit() == 1 and driver.batch_limit() == 8


def test_jacobi_drafts_through_load_backend_keep_greedy_codes(checkpoint, backends):
    single, _ = backends
    options = engine_options(draft="jacobi", draft_tokens=4)
    assert dict(options) == {"draft": "jacobi", "draft_tokens": 4}
    jacobi = load_backend("single-stream", checkpoint, device="cpu", dtype="float32", **options)
    assert (jacobi.decoder.draft, jacobi.decoder.draft_tokens) == ("jacobi", 4)
    greedy = [job("g", 11, total=6, temperature=0)]
    plain, _ = run(single.driver(1), greedy)
    drafted, _ = run(jacobi.driver(1), greedy)
    np.testing.assert_array_equal(drafted["g"], plain["g"])
    assert jacobi.decoder.stats["codes_per_step"] > 1  # the last round's steps kept drafts
    sampled = [job("s", 12, total=5)]
    first, _ = run(jacobi.driver(1), sampled)
    again, _ = run(jacobi.driver(1), sampled)
    np.testing.assert_array_equal(first["s"], again["s"])  # a seed repeats its video


def test_options_are_checked_for_the_backend_that_runs_them():
    jacobi = engine_options(draft="jacobi", draft_tokens=4)
    for other in ("hf", "vllm"):
        with pytest.raises(InputError, match="--draft jacobi runs on --backend single-stream"):
            check_backend_options(other, jacobi)
    check_backend_options("single-stream", jacobi)
    check_backend_options("single-stream", engine_options(draft="previous-frame", draft_tokens=2))
    with pytest.raises(InputError, match="--kv-cache-dtype.*not for the single-stream backend"):
        check_backend_options("single-stream", engine_options(kv_cache_dtype="fp8"))
    with pytest.raises(InputError, match="--draft must be none, previous-frame or jacobi"):
        engine_options(draft="lookahead")


def test_load_backend_asserts_its_options_in_field_names_without_cli_flags(tmp_path):
    """A library caller that skips the request layer still gets the backend's own check, before
    anything loads (the folder holds no checkpoint), in the options' names, not the CLI's flags."""
    missing = tmp_path / "no-checkpoint"
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: vLLM engine option\(s\), not for the hf backend$"):
        load_backend("hf", missing, device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"^torch_compile: vLLM engine option\(s\), not for the single-stream backend$"):
        load_backend("single-stream", missing, device="cpu", torch_compile=False)
    with pytest.raises(ValueError, match=r"^draft='jacobi': the single-stream backend's draft, not for the hf backend$"):
        load_backend("hf", missing, device="cpu", **engine_options(draft="jacobi"))
    with pytest.raises(ValueError, match=r"^backend: auto, hf, vllm, single-stream; got 'nope'$"):
        load_backend("nope", missing, device="cpu")


def test_generate_refuses_jacobi_on_another_backend_before_loading(checkpoint, tmp_path):
    result = invoke_terra("generate", tmp_path / "out.mp4", "--model", checkpoint, "--actions", "straight",
                          "--frames", 4, "--draft", "jacobi", "--backend", "hf", "--device", "cpu")
    assert result.returncode == 2
    assert "error: --draft jacobi runs on --backend single-stream, not on hf" in result.stderr
    assert not (tmp_path / "out.mp4").exists()
