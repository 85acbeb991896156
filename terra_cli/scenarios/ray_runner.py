"""Scenario runs on Ray: engine actors across a cluster, scenarios handed out as they take them
(`RayDriver`; the hand-out rules live in `ray_hand_out`).

`--ray [ADDRESS]` and `--data-parallel N` (a local cluster of N engines) both come here. The
driver has validated every line (`prepare_job`) and reads `results.jsonl` for resume. It reads
each scenario's context itself and ships the decoded frames or tokens through the object store;
an actor (`ray_actor.ScenarioEngine`, one per GPU) returns tokens, then (a second call) the encoded
video, and the driver writes them with `results.save_finished`, as a single-engine run does. No shared
filesystem is needed, and the driver is the only writer: a scenario is written once.

Hand-out is dynamic: each engine holds at most `window` open calls (its continuous batch plus a
few queued while there is work to spare, `may_queue`), and never more than its `fair_share` of
the work left, topped up as rollouts finish (their videos are still being made: those count
apart, `video_backlog`), so a fast engine takes more and a slow one less.
A dead actor's open scenarios go back to the front of the queue for any engine, itself included;
Ray restarts it (max_restarts) and it rejoins once its engine is loaded again. A scenario that
fails MAX_ATTEMPTS times (errors of its own, each retried on another engine where there is one,
or engines dying under it) is recorded as failed with the reasons, and the run goes on.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from typing import Callable

from terra_cli.scenarios.encoding import ReadAhead
from terra_cli.scenarios.job import PreparedJob, rollouts_to_load
from terra_cli.scenarios.ray_cluster import EnginePlan, ray_cluster
from terra_cli.errors import OutputError
from terra_cli.scenarios.fault_injection import (injected_failures, injected_frame_delay, injected_frame_gate,
                                                 injected_start_failure, injected_video_hold)
from terra_cli.scenarios.outdir import RESULTS_NAME, make_out_dir, plan_outputs
from terra_cli.scenarios.results import NotRecorded, ResultsLog, log_skipped, save_finished
from terra_cli.scenarios.ray_hand_out import (EngineState, RayRun, counted, fair_share, may_hand_out,  # noqa: F401
                                              may_queue, video_backlog, window_for)
from terra_cli.scenarios.ray_actor import Finished
from terra_cli.scenarios.spec import Scenario

READ_AHEAD_MAX = 1024  # contexts the driver holds read ahead of the hand-out (ReadAhead)
MAX_ATTEMPTS = 3
ENGINE_RESTARTS = 3  # per actor; then it stays dead and the others finish the run
TICK_SECONDS = 0.5
FINAL_STATS_SECONDS = 5.0  # how long the end of a run waits for an engine's last loop times


Event = Callable[[str, "EngineState | None", object], None]  # (kind, engine, payload)


def run_on_ray(prepared: PreparedJob, address: str | None = None, engines: int | None = None, *,
               on_event: Event = lambda kind, engine, payload: None, verbose: bool = False,
               probe_wakes: bool = False) -> RayRun:
    """`probe_wakes`: each actor runs a `WakeProbe` and reports it with its loop's times (a bench's
    minute lines); off for plain runs, where nobody reads it."""
    from terra_cli.scenarios.outdir import OutDirLock

    # The cluster first: a bad --ray address leaves no empty --out-dir behind.
    with ray_cluster(prepared, address, engines, verbose) as plan, OutDirLock(prepared.job.out_dir):
        return drive(prepared, plan, on_event, probe_wakes)


def drive(prepared: PreparedJob, plan: EnginePlan, on_event: Event = lambda kind, engine, payload: None,
          probe_wakes: bool = False) -> RayRun:
    """Run `prepared` on `plan.engines` actors. KeyboardInterrupt writes every result that is
    already back, stops the actors and propagates."""
    return RayDriver(prepared, plan, on_event, probe_wakes).run()


# A call of an engine's that failed this long before the engine was lost is named as the loss's
# likely cause (an actor whose writer or refiner stops fails the call, then ends 0.5 s later).
CAUSE_WINDOW_S = 30.0


class RayDriver:
    """The driver of a Ray scenario run: it starts the engine actors, hands scenarios out as they
    take them, settles what comes back (results, readiness probes, loop statistics), requeues
    what a dead actor held, and is the only writer of --out-dir (`results.save_finished`)."""

    def __init__(self, prepared: PreparedJob, plan: EnginePlan, on_event: Event = lambda kind, engine, payload: None,
                 probe_wakes: bool = False):
        self.prepared, self.plan, self.on_event, self.probe_wakes = prepared, plan, on_event, probe_wakes
        self.job, self.out_dir = prepared.job, prepared.job.out_dir
        make_out_dir(self.out_dir)  # the caller holds it (outdir.OutDirLock)
        self.outputs = plan_outputs(prepared.file.scenarios, self.out_dir, decode=self.job.decode,
                                    overwrite=self.job.overwrite, inputs=prepared.file.input_files())
        self.log = ResultsLog(self.out_dir, RESULTS_NAME)
        self.state = RayRun(resumed=self.outputs.resumed)
        self.state.skipped = log_skipped(prepared.file, self.log)
        self.pending = deque(self.outputs.pending)
        self.state.total = len(self.pending)
        self.state.total_frames = sum(s.frames - s.context_frames for s in self.pending)
        self.attempts: dict[str, list[str]] = {}
        self.avoid: dict[str, int] = {}  # scenario -> the engine it last failed on
        self.works: dict[str, object] = {}  # scenario -> its context in the object store (kept for retries)
        # Each engine's share of the run, which --max-rollouts even splits into equal waves: the feed hands
        # jobs to whichever engine has room, so engines that step alike take about as many each.
        self.share = -(-len(self.pending) // max(1, plan.engines))
        self.loaded_for = rollouts_to_load(self.job, self.share)  # the most in flight an engine is started for
        self.window = window_for(self.loaded_for)  # the most an engine may be given
        # Contexts read ahead: what every engine's window takes at once (a wave change), up to
        # READ_AHEAD_MAX (about 1.3 GB of 288x512 RGB frames held by the driver: `read_work`
        # resizes them as it reads).
        self.reader = ReadAhead(read_work, ahead=min(READ_AHEAD_MAX, self.plan.engines * self.window))

    def run(self) -> RayRun:
        import ray

        run = self.state
        if not self.pending:  # a finished run, resumed: no engine needs to start
            return run
        self._start_engines()
        clock = time.perf_counter()
        try:
            while self.pending or any(e.open or e.videos for e in run.engines):
                if all(e.status == "dead" for e in run.engines):
                    run.errors.append(f"every engine is dead; {len(self.pending)} scenario(s) not run "
                                      "(run again to resume)")
                    break
                now = time.perf_counter()
                self.reader.want(s for s in islice(self.pending, self.reader.ahead) if s.id not in self.works)
                for engine in run.engines:
                    if engine.probe is None and engine.status in ("starting", "restarting") and now >= engine.probe_at:
                        engine.probe = engine.actor.ready.remote()
                    if engine.status == "alive":
                        self.hand_out(engine)
                        if engine.stats_ref is None and now - engine.stats_at > TICK_SECONDS:
                            engine.stats_ref = engine.actor.stats.remote()
                refs = [r for e in run.engines for r in (*e.open, *e.videos, e.probe, e.stats_ref) if r is not None]
                ready, _ = ray.wait(refs, num_returns=1, timeout=TICK_SECONDS)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    self.settle(ref)
                self.on_event("tick", None, run)
            _last_engine_loops(run.engines)
        except KeyboardInterrupt:
            # Whatever is already back is written before the actors go.
            refs = [r for e in run.engines for r in (*e.open, *e.videos)]
            try:
                for ref in (ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []):
                    self.settle(ref)
            except Exception:  # a local cluster that took the Ctrl-C too: what was written stays
                pass
            raise
        finally:
            self.reader.close()
            for engine in run.engines:
                try:
                    ray.kill(engine.actor, no_restart=True)
                except Exception:  # already gone
                    pass
            run.seconds = time.perf_counter() - clock
        return run

    def _start_engines(self) -> None:
        import ray

        from terra_cli.scenarios.ray_actor import EngineSpec, ScenarioEngine

        prepared, plan = self.prepared, self.plan
        count, device, resources = plan.engines, plan.device, plan.resources
        threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // count) if device == "cpu" else 0
        backend = prepared.backend if device == "cpu" or prepared.job.engine.backend != "auto" else "auto"
        engine_class = ray.remote(ScenarioEngine)
        # Each open call holds one of the actor's threads: the generate calls of its window, and the
        # video calls of finished rollouts (at most the backlog, and a window's worth more).
        calls = 2 * self.window + video_backlog(self.loaded_for) + 4
        longest = max(s.frames for s in self.pending)
        for index in range(count):
            spec = EngineSpec(self.job, backend, device, prepared.needs_tokenizer, index, threads,
                              injected_frame_delay(index), longest, injected_failures(), injected_video_hold(),
                              self.probe_wakes, injected_start_failure(index),
                              frame_gate=injected_frame_gate(index), rollouts=self.share)
            actor = engine_class.options(max_restarts=ENGINE_RESTARTS, max_task_retries=0,
                                         max_concurrency=calls, scheduling_strategy="SPREAD",
                                         **resources).remote(spec)
            self.state.engines.append(EngineState(index, actor, probe=actor.ready.remote()))

    def record_failure(self, s: Scenario, engine: EngineState, why: str, final: bool = False,
                       suspect: bool = True) -> None:
        run, attempts = self.state, self.attempts
        attempts.setdefault(s.id, []).append(f"engine {engine.index}: {why}")
        if len(attempts[s.id]) < MAX_ATTEMPTS and not final:
            if suspect:  # its own error: the retry goes to another engine where there is one
                self.avoid[s.id] = engine.index
            self.pending.appendleft(s)
            run.requeued += 1
            return
        self.works.pop(s.id, None)
        record = {"id": s.id, "status": "failed", "seed": s.seed, "line": s.line,
                  "reason": f"failed {len(attempts[s.id])} times: " + "; ".join(attempts[s.id])}
        self.log.add(record)
        run.failed += 1
        run.errors.append(f"{s.id}: {record['reason']}")
        self.on_event("written", engine, record)

    def finished(self, engine: EngineState, s: Scenario, result) -> None:
        run = self.state
        self.works.pop(s.id, None)
        try:
            record = save_finished(self.out_dir, self.log, s, result.tokens, result.seconds, video=result.video,
                                   replaceable=self.outputs.replaceable,
                                   extra={"engine": engine.index, "node": engine.node})
        except NotRecorded as exc:
            raise OutputError(f"{exc}; the run stopped with {run.done} scenario(s) written and recorded{exc.dropped}; "
                              "fix that, then run the same command again to resume") from exc
        if record["status"] == "done":
            run.done += 1
            engine.done += 1
            engine.written_frames += s.frames - s.context_frames
            run.generated_frames += s.frames - s.context_frames
        else:
            run.failed += 1
            run.errors.append(f"{s.id}: {record['reason']}")
        self.on_event("written", engine, record)

    def lost(self, engine: EngineState, why: str) -> None:
        """The actor died: its open scenarios go back to the queue; Ray restarts it."""
        scenarios = [*engine.open.values(), *(s for s, _ in engine.videos.values())]
        engine.lost_frames += engine.video_frames()  # generated, their videos lost with the actor
        engine.open.clear()
        engine.videos.clear()
        engine.status, engine.restarts, engine.since = "restarting", engine.restarts + 1, time.perf_counter()
        engine.lost_frames += engine.pending_frames  # as of its last stats: the work to redo
        engine.counted, engine.live, engine.pending_frames, engine.stats_ref = engine.counted + engine.live, 0, 0, None
        engine.probe = engine.actor.ready.remote()
        if engine.last_error and time.perf_counter() - engine.last_error[0] <= CAUSE_WINDOW_S:
            # what it failed with just before it went (its refiner stopped, say), not only Ray's word
            why = f"{why}; just before, a call failed with {engine.last_error[1]}"
        engine.last_error = None
        self.on_event("lost", engine, why)
        # Not suspects: a whole batch was open, so the restarted engine may take them back (the
        # attempts still count, so a scenario that kills every engine it runs on ends as failed).
        for s in reversed(scenarios):
            self.record_failure(s, engine, f"engine died ({why})", suspect=False)

    def take(self, engine: EngineState) -> Scenario | None:
        others = sum(e.status != "dead" for e in self.state.engines) > 1  # a retry waits for another engine
        for position, s in enumerate(self.pending):
            if position > 4 * self.window:
                break
            if not others or self.avoid.get(s.id) != engine.index:
                del self.pending[position]
                return s
        return None

    def hand_out(self, engine: EngineState) -> None:
        import ray

        engines, pending = self.state.engines, self.pending
        share = self.share if self.job.even_waves else None
        while may_hand_out(engine, engines, len(pending), share, time.perf_counter()):
            s = self.take(engine)
            if s is None:
                return
            if s.id not in self.works:
                try:
                    self.works[s.id] = ray.put(self.reader.take(s))
                except Exception as exc:  # its context vanished or broke since validation
                    self.record_failure(s, engine, f"context unreadable: {' '.join(str(exc).split())}", final=True)
                    continue
            engine.open[engine.actor.generate.remote(self.works[s.id])] = s
            engine.handed += 1

    def settle(self, ref) -> None:
        for engine in self.state.engines:
            if engine.probe is not None and ref == engine.probe:
                self._settle_probe(engine, ref)
                return
            if engine.stats_ref is not None and ref == engine.stats_ref:
                self._settle_stats(engine, ref)
                return
            if ref in engine.open:
                self._settle_result(engine, ref)
                return
            if ref in engine.videos:
                self._settle_video(engine, ref)
                return

    def _settle_probe(self, engine: EngineState, ref) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        engine.probe = None
        try:
            info = ray.get(ref)
        except ActorUnavailableError:  # still restarting: ask again next tick
            engine.probe_at = time.perf_counter() + TICK_SECONDS
            return
        except RayActorError as exc:  # out of restarts, or it cannot start at all
            engine.status = "dead"
            self.on_event("dead", engine, _short(exc))
            return
        engine.status, engine.node, engine.backend = "alive", info["node"], info["backend"]
        engine.in_flight = info["in_flight"]
        self.state.writers = max(self.state.writers, info.get("writers", 0))  # per engine
        engine.startup_s = info["startup_s"]
        engine.first_ready = engine.first_ready or time.perf_counter()
        self.on_event("ready" if engine.restarts == 0 else "rejoined", engine, info)

    def _settle_stats(self, engine: EngineState, ref) -> None:
        import ray
        from ray.exceptions import RayTaskError

        engine.stats_ref, engine.stats_at = None, time.perf_counter()
        try:
            stats = ray.get(ref)
        except RayTaskError as exc:  # its writer or refiner stopped: the actor ends; its loss names this
            engine.last_error = (time.perf_counter(), _short(exc))
            return
        except Exception:  # a dying actor: its generate calls say so
            return
        engine.live, engine.pending_frames = stats["frames"], stats["pending_frames"]
        engine.engine_loop = stats.get("engine_loop")

    def _settle_result(self, engine: EngineState, ref) -> None:
        s = engine.open[ref]
        for result in self._settle_call(engine, engine.open, ref, s):
            if result.video_follows:
                engine.videos[engine.actor.video.remote(s.id)] = (s, result)
            else:
                self.finished(engine, s, Finished(s.id, result.tokens, None, result.seconds))

    def _settle_video(self, engine: EngineState, ref) -> None:
        s, generated = engine.videos[ref]
        for video in self._settle_call(engine, engine.videos, ref, s):
            self.finished(engine, s, Finished(s.id, generated.tokens, video, generated.seconds))

    def _settle_call(self, engine: EngineState, calls: dict, ref, s) -> list:
        """The value of a finished call of `engine` on scenario `s` (as a list of one), or nothing: a
        dead actor leaves the call in `calls` for `lost` to hand out again; a failed call fails `s` alone."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        entry = calls.pop(ref)
        try:
            return [ray.get(ref)]
        except RayActorError as exc:
            calls[ref] = entry
            self.lost(engine, _short(exc))
        except RayTaskError as exc:
            engine.last_error = (time.perf_counter(), _short(exc))
            self.record_failure(s, engine, engine.last_error[1])
        return []


def _last_engine_loops(engines: list[EngineState]) -> None:
    """Each live engine's loop times as the run ends (the ticks' last stats may predate its last steps)."""
    import ray

    alive = [e for e in engines if e.status == "alive"]
    refs = [e.actor.stats.remote() for e in alive]
    for engine, ref in zip(alive, refs):
        try:
            engine.engine_loop = ray.get(ref, timeout=FINAL_STATS_SECONDS).get("engine_loop")
        except Exception:  # a report, not the run: an engine that does not answer keeps its last
            pass


def read_work(s: Scenario):
    """A scenario's context as data for an actor on any node: tokens, or RGB frames at Terra's
    frame size (`encoding.read_context`, in the reading threads): ACT-Bench's 1600x900 JPEGs are
    10x the bytes of Terra's 288x512 frames, and the driver held and shipped them whole (27 GB
    resident in a full run's first minute, 2026-11-27)."""
    from terra_cli.scenarios.encoding import read_context
    from terra_cli.scenarios.ray_actor import ScenarioWork

    tokens, frames = read_context(s)
    return ScenarioWork(s, context_tokens=tokens) if tokens is not None else ScenarioWork(s, context_images=frames)


def _short(exc: BaseException) -> str:
    """The last meaningful line of a Ray error (its cause), not the whole remote traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = getattr(exc, "cause", None)
    if cause is not None and str(cause).strip():
        return " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
    return (lines[-1] if lines else type(exc).__name__)[:300]

