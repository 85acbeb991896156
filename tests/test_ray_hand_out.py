"""How the Ray driver hands out scenarios when the work left is less than the engines can hold
(scenarios/ray_runner.fair_share, may_queue): no engine holds more than its share of it, and an
engine with a full batch takes a call to hold queued only while the other engines' free places
would still find work. Plain data; the last tests stand in for Ray's `ray.get` to check how an engine
lost to its refiner is named (refiner stage failures, scenarios/ray_actor.py)."""

import time

import pytest

from terra_cli.scenarios.ray_runner import EngineState, fair_share, may_queue


def engine(index, status="alive", in_flight=256, open_calls=0):
    e = EngineState(index, actor=None, status=status, in_flight=in_flight)
    e.open = {object(): None for _ in range(open_calls)}
    return e


def test_first_engine_ready_leaves_the_second_its_batch():
    """512 scenarios, 256 in flight each: the engine ready first fills its batch and queues
    nothing more while the other is still starting, so each ends up with 256, not 288 and 224."""
    first, second = engine(0, open_calls=256), engine(1, status="starting", in_flight=1)
    assert not may_queue(first, [first, second], pending=256)
    assert may_queue(first, [first, second], pending=257)


def test_a_single_engine_always_queues():
    alone = engine(0, open_calls=256)
    assert may_queue(alone, [alone], pending=1)


def test_free_places_of_live_engines_count_and_dead_ones_do_not():
    busy, idle, dead = engine(0, open_calls=256), engine(1, open_calls=250), engine(2, status="dead", open_calls=0)
    engines = [busy, idle, dead]
    assert not may_queue(busy, engines, pending=6)  # engine 1 has 6 free places for them
    assert may_queue(busy, engines, pending=7)
    restarting = engine(1, status="restarting", in_flight=256)
    assert not may_queue(busy, [busy, restarting], pending=200)  # it comes back with a batch of its own
    assert may_queue(busy, [busy, restarting], pending=300)


def test_reference_engines_one_scenario_each():
    """In-flight 1 (the reference backend): the queued second call waits for another engine's
    free place to be taken first."""
    a, b = engine(0, in_flight=1, open_calls=1), engine(1, in_flight=1, open_calls=0)
    assert not may_queue(a, [a, b], pending=1)
    b.open = {object(): None}
    assert may_queue(a, [a, b], pending=1)


def test_a_run_smaller_than_the_batches_is_split_between_the_engines():
    """256 samples, two engines of 256 rollouts (measured on two H100s: the engine ready first took
    all 256 and the other stood idle): each may hold 128, an engine still starting included."""
    first, second = engine(0), engine(1, status="starting", in_flight=1)
    assert fair_share([first, second], pending=256) == 128
    first.open = {object(): None for _ in range(128)}
    assert fair_share([first, second], pending=128) == 128  # full: the rest waits for engine 1
    assert fair_share([first, engine(1, status="dead")], pending=128) == 256  # unless it is dead
    assert fair_share([first], pending=1) == 129  # one engine: never binds
    assert fair_share([engine(0), engine(1), engine(2)], pending=7) == 3  # rounded up


def test_after_a_kill_the_survivor_keeps_its_batch_and_the_restarted_engine_gets_the_rest():
    """Two engines of 256; engine 1 died with 256 open, which are pending again: the survivor's
    share is the 256 it holds, so the requeued ones wait for engine 1 to come back."""
    survivor, restarting = engine(0, open_calls=256), engine(1, status="restarting")
    assert fair_share([survivor, restarting], pending=256) == 256
    rejoined = engine(1)
    assert fair_share([survivor, rejoined], pending=256) == 256 and len(rejoined.open) < 256


def test_work_is_kept_for_a_starting_engine_only_as_long_as_the_others_took_to_start():
    """An engine that takes far longer to start than the others did (a node downloading the
    model) stops holding work back: after 2 x the slowest start + 10 s its share goes to the
    engines that are up; a restarting engine is waited for the same way."""
    from terra_cli.scenarios.ray_runner import counted

    up = engine(0)
    up.startup_s = 20.0
    late = engine(1, status="starting")
    now = late.since + 45.0  # within 2 x 20 + 10 s
    assert counted(late, [up, late], now) and fair_share([up, late], pending=256, now=now) == 128
    up.open = {object(): None for _ in range(256)}
    assert not may_queue(up, [up, late], pending=200, now=now)  # engine 1's 256 places are still kept
    up.open = {}
    now = late.since + 51.0
    assert not counted(late, [up, late], now) and fair_share([up, late], pending=256, now=now) == 256
    assert may_queue(up, [up, late], pending=1, now=now)
    # before any engine is up there is nothing to compare with: every starting engine counts
    assert counted(late, [engine(0, status="starting"), late], late.since + 1000.0)


def test_the_progress_count_stays_within_the_open_scenarios_and_the_total():
    """Issue 38: an engine's frame count of its open scenarios comes with its stats, a tick after a
    scenario was handed back and counted as written: the bar showed 8852/5632 frames. Each engine's
    count is capped by what its open scenarios hold, the whole by the run's total."""
    from types import SimpleNamespace

    from terra_cli.scenarios.ray_runner import RayRun

    scenario = SimpleNamespace(frames=25, context_frames=3)  # 22 generated frames
    one = engine(0)
    one.open = {object(): scenario, object(): scenario}  # 44 frames to come
    one.written_frames, one.pending_frames = 22 * 10, 22 * 12  # stale: still counts 10 written ones
    run = RayRun(total=256, total_frames=22 * 256, engines=[one])
    assert run.progress_frames == 22 * 10 + 44
    one.pending_frames = 30
    assert run.progress_frames == 22 * 10 + 30
    one.written_frames = 22 * 256
    assert run.progress_frames == 22 * 256  # never past the total
    one.status = "restarting"
    assert run.progress_frames == 22 * 256


def test_an_engine_lost_after_its_refiner_stopped_is_named_with_that_cause(monkeypatch):
    """4 x H200, 2026-11-27: four Ray engines refining their own videos all ended their processes at
    the first refinement, and the run said only "engine N lost (The actor is unavailable ...)". An
    actor whose writer or refiner stops fails the call waiting for that video, then exits: the line
    for its loss now names that call's error too (and only one just before it, not an old one)."""
    import collections

    import ray
    from ray.exceptions import RayTaskError

    from terra_cli.refiner.stage import RefinerStopped
    from terra_cli.scenarios import ray_runner
    from terra_cli.scenarios.ray_runner import RayDriver, RayRun

    class Actor:
        class ready:
            @staticmethod
            def remote():
                return "a readiness probe"

    class Scenario:
        id, frames, context_frames, seed, line = "s1", 47, 3, 0, 1

    events = []
    driver = RayDriver.__new__(RayDriver)
    driver.state, driver.attempts, driver.avoid, driver.works = RayRun(), {}, {}, {}
    driver.pending = collections.deque()
    driver.on_event = lambda kind, engine, payload: events.append((kind, payload))
    stopped = RayTaskError("video", "Traceback (most recent call last): ...",
                           RefinerStopped("the refiner stopped: OutOfMemoryError: CUDA out of memory"))

    def failing_get(ref):
        raise stopped

    monkeypatch.setattr(ray, "get", failing_get)
    lost = EngineState(1, actor=Actor())
    lost.videos = {"ref": (Scenario(), None)}
    assert driver._settle_call(lost, lost.videos, "ref", Scenario()) == []
    assert list(driver.pending) and driver.attempts["s1"] == [
        "engine 1: RefinerStopped: the refiner stopped: OutOfMemoryError: CUDA out of memory"]
    driver.lost(lost, "The actor is unavailable")
    assert events[-1] == ("lost", "The actor is unavailable; just before, a call failed with RefinerStopped: "
                                  "the refiner stopped: OutOfMemoryError: CUDA out of memory")
    assert lost.last_error is None and lost.status == "restarting"

    # A failure long before the loss is not named as its cause.
    old = EngineState(2, actor=Actor(), status="alive")
    old.last_error = (0.0, "VideoFailed: one bad video")
    monkeypatch.setattr(ray_runner.time, "perf_counter", lambda: ray_runner.CAUSE_WINDOW_S + 1.0)
    driver.lost(old, "The actor is unavailable")
    assert events[-1] == ("lost", "The actor is unavailable")


def test_an_actor_whose_refiner_stopped_says_so_at_the_next_tick_and_ends(monkeypatch):
    """A refiner stage that stops on its own (its compile failed at start, say) ends the actor at the
    driver's next stats tick with that error, not at its first video minutes of tokens later; the
    driver keeps that error to name the loss."""
    import ray
    from ray.exceptions import RayTaskError

    from terra_cli.refiner.stage import RefinerStopped
    from terra_cli.scenarios.ray_actor import ScenarioEngine
    from terra_cli.scenarios.ray_runner import RayDriver

    stopped = RefinerStopped("the refiner stopped: RuntimeError: compile failed")

    class StoppedStage:
        def check(self):
            raise stopped

    died = []
    actor = ScenarioEngine.__new__(ScenarioEngine)
    actor.pool = StoppedStage()
    monkeypatch.setattr(actor, "_die", lambda exc: died.append(exc))
    with pytest.raises(RefinerStopped):
        actor.stats()
    for _ in range(100):  # _die runs in a thread of its own (it sleeps before ending the process)
        if died:
            break
        time.sleep(0.01)
    assert died == [stopped]

    def failing_get(ref):
        raise RayTaskError("stats", "Traceback (most recent call last): ...", stopped)

    monkeypatch.setattr(ray, "get", failing_get)
    driver = RayDriver.__new__(RayDriver)
    engine = EngineState(0, actor=None, status="alive")
    driver._settle_stats(engine, "a stats call")
    assert engine.last_error[1] == "RefinerStopped: the refiner stopped: RuntimeError: compile failed"


def _waves_per_engine(share, in_flight=286, engines=4, total=2286, stagger_s=3.0, wave_s=430.0):
    """The Ray driver's hand-out (`may_hand_out`, asked before each call as `RayDriver.hand_out` does)
    over a whole run of equal-length rollouts: each engine runs what it holds open up to its batch as
    one wave, and its wave's rollouts end one by one, the driver refilling it after each; the engines'
    waves end `stagger_s` apart. Returns the waves each engine ran and the scenarios each was handed."""
    from terra_cli.scenarios.ray_hand_out import may_hand_out

    states = [engine(i, in_flight=in_flight) for i in range(engines)]
    pending = [total]

    def refill(e):
        while may_hand_out(e, states, pending[0], share, now=0.0):
            e.open[object()] = None
            e.handed += 1
            pending[0] -= 1

    for e in states:
        refill(e)
    waves = [0] * engines
    wave_end = [wave_s + i * stagger_s for i in range(engines)]
    while any(e.open for e in states):
        e = states[min((i for i in range(engines) if states[i].open), key=lambda i: wave_end[i])]
        waves[e.index] += 1
        for call in list(e.open)[: e.in_flight]:  # the batch's rollouts end; each is refilled after it
            del e.open[call]
            refill(e)
        wave_end[e.index] += wave_s
    handed = [e.handed for e in states]
    assert pending[0] == 0 and sum(handed) == total
    return waves, handed


def test_even_waves_hold_when_the_engines_end_their_waves_apart():
    """--max-rollouts even, 2,286 samples on four engines of 286 (H200s): two waves each. Without the
    share rule the engine that ends its first wave first queues beyond its second wave (its window
    holds an eighth more), which leaves the last engine short and three engines a third wave of a few
    dozen rollouts: about as long as a full wave of steps."""
    waves, handed = _waves_per_engine(share=572)
    assert waves == [2, 2, 2, 2] and max(handed) <= 572
    unshared, _ = _waves_per_engine(share=None)
    assert max(unshared) == 3  # the control: the rule is what keeps the waves even
    # Auto at 256 (no share rule) runs its inevitable third wave on every engine
    assert _waves_per_engine(share=None, in_flight=256)[0] == [3, 3, 3, 3]
