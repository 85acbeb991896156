"""Scenario runs on Ray: engine actors across a cluster, scenarios handed out as they take them.

`--ray [ADDRESS]` and `--data-parallel N` (a local cluster of N engines) both come here. The
driver has validated every line (`prepare_job`) and reads `results.jsonl` for resume. It reads
each scenario's context itself and ships the decoded frames or tokens through the object store;
an actor (`ray_actor.ScenarioEngine`, one per GPU) returns tokens and the encoded video, and the
driver writes them with `runner.save_finished`, as a single-engine run does. No shared
filesystem is needed, and the driver is the only writer: a scenario is written once.

Hand-out is dynamic: each engine holds at most `window` open calls (its continuous batch plus a
few queued), topped up as scenarios finish, so a fast engine takes more and a slow one less.
A dead actor's open scenarios go back to the front of the queue for the others; Ray restarts it
(max_restarts) and it rejoins once its engine is loaded again. A scenario that fails
MAX_ATTEMPTS times (an error of its own, or an engine dying under it), each time on another
engine where there is one, is recorded as failed with the reasons, and the run goes on.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from terra_cli.errors import InputError
from terra_cli.scenarios.job import PreparedJob
from terra_cli.scenarios.runner import RESULTS_NAME, ResultsLog, ScenarioRun, completed_ids, log_skipped, save_finished
from terra_cli.scenarios.spec import Scenario

MAX_ATTEMPTS = 3
ENGINE_RESTARTS = 3  # per actor; then it stays dead and the others finish the run
TICK_SECONDS = 0.5
CONNECT_SECONDS = float(os.environ.get("TERRA_RAY_CONNECT_TIMEOUT", "30"))
INSTALL_HINT = "pip install 'terra-cli[ray]' (on the driver and on every node of the cluster)"


def require_ray(reason: str):
    try:
        import ray
    except ImportError:
        raise InputError(f"{reason} runs on Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(ray, address: str | None, *, cpus: int, gpus: int, verbose: bool = False) -> bool:
    """Join the cluster at `address` (auto, ray://host:port, host:port) within CONNECT_SECONDS,
    or start a local one (None). True when this call started Ray (and must shut it down)."""
    if ray.is_initialized():
        return False
    common = dict(include_dashboard=False, log_to_driver=verbose, logging_level="INFO" if verbose else "ERROR")
    if address is None:
        ray.init(num_cpus=cpus, num_gpus=gpus, **common)
        return True
    unreachable = _port_closed(address)
    if unreachable:
        raise InputError(f"cannot reach a Ray cluster at --ray {address}: {unreachable} (start one with "
                         "`ray start --head`, or pass --ray local for a cluster of this machine)")
    outcome: dict = {}

    def join() -> None:
        try:
            ray.init(address=address, **common)
            outcome["ok"] = True
        except BaseException as exc:  # reported below, one line
            outcome["error"] = " ".join(str(exc).split())[:300]

    thread = threading.Thread(target=join, name="terra-ray-connect", daemon=True)
    thread.start()
    thread.join(CONNECT_SECONDS)
    if "ok" not in outcome:
        why = outcome.get("error") or f"no answer within {CONNECT_SECONDS:.0f} s"
        raise InputError(f"cannot reach a Ray cluster at --ray {address}: {why} (start one with `ray start --head`, "
                         "or pass --ray local for a cluster of this machine)")
    return False


def _port_closed(address: str) -> str | None:
    """Why HOST:PORT (or ray://HOST:PORT) takes no TCP connection, found within a few seconds;
    None when it does, or for `auto`, which Ray resolves and refuses quickly itself."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=min(CONNECT_SECONDS, 5)).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def plan_engines(ray, prepared: PreparedJob, cap: int | None) -> tuple[int, str, dict]:
    """(engines, device, actor resources): one per GPU of the cluster; on a CPU-only cluster (or
    --device cpu), one per node unless --engines says otherwise."""
    if cap is not None and cap < 1:
        raise InputError(f"--engines must be at least 1, got {cap}")
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus and prepared.job.device != "cpu":
        if cap is not None and cap > gpus:
            raise InputError(f"{cap} engines need {cap} GPUs; the Ray cluster has {gpus}")
        return cap or gpus, "cuda", {"num_gpus": 1}
    if prepared.device.startswith("cuda"):
        raise InputError(f"--device {prepared.job.device}: the Ray cluster has no GPU (pass --device cpu to run "
                         "on its CPUs)")
    cpus = int(resources.get("CPU", 0))
    count = cap or max(1, sum(1 for node in ray.nodes() if node.get("Alive")))
    if count > cpus:
        raise InputError(f"{count} CPU engines need {count} CPUs; the Ray cluster has {cpus}")
    return count, "cpu", {"num_cpus": 1}


@dataclass
class EngineState:
    index: int
    actor: object
    status: str = "starting"  # starting, alive, restarting, dead
    node: str = ""
    backend: str = ""
    startup_s: float | None = None
    probe: object = None  # ready() while starting or restarting
    probe_at: float = 0.0  # when to ask again while Ray restarts it
    stats_ref: object = None
    stats_at: float = 0.0
    open: dict = field(default_factory=dict)  # generate() ref -> scenario
    done: int = 0
    written_frames: int = 0  # generated frames of its written scenarios
    counted: int = 0  # frames generated by earlier incarnations
    live: int = 0  # frames generated by this incarnation
    pending_frames: int = 0  # generated frames of its open scenarios
    restarts: int = 0
    first_ready: float | None = None

    def frames_per_second(self, now: float) -> float:
        frames = max(self.counted + self.live, self.written_frames)  # live counts arrive every tick
        return frames / max(now - self.first_ready, 1e-9) if self.first_ready else 0.0


@dataclass
class RayRun(ScenarioRun):
    total: int = 0  # scenarios to run this time
    total_frames: int = 0  # their generated frames
    requeued: int = 0
    engines: list[EngineState] = field(default_factory=list)

    @property
    def progress_frames(self) -> int:
        return sum(e.written_frames + (e.pending_frames if e.status == "alive" else 0) for e in self.engines)

    def summary(self) -> list[dict]:
        now, done = time.perf_counter(), max(self.done, 1)
        return [{"engine": e.index, "node": e.node, "status": e.status, "scenarios": e.done,
                 "share": round(100 * e.done / done, 1), "frames": e.written_frames,
                 "frames_per_s": round(e.frames_per_second(now), 2), "restarts": e.restarts, "startup_s": e.startup_s}
                for e in self.engines]


Event = Callable[[str, "EngineState | None", object], None]  # (kind, engine, payload)


def window_for(prepared: PreparedJob, backend: str) -> int:
    """Open calls per engine: its whole continuous batch and a few more, so it never waits on
    the driver; the reference engine runs one scenario at a time and gets one queued."""
    rollouts = prepared.job.max_rollouts
    return rollouts + max(2, rollouts // 8) if backend == "vllm" else 2


def test_frame_delays() -> dict[int, float]:
    """TERRA_RAY_TEST_FRAME_DELAY="1=0.3,2=0.1": engine index -> seconds slept after each frame
    (tests make one engine deliberately slow)."""
    delays = {}
    for part in filter(None, os.environ.get("TERRA_RAY_TEST_FRAME_DELAY", "").split(",")):
        index, _, seconds = part.partition("=")
        delays[int(index)] = float(seconds)
    return delays


@dataclass(frozen=True)
class EnginePlan:
    engines: int
    device: str  # cpu or cuda
    resources: dict  # each actor's: num_gpus=1, or num_cpus=1


@contextlib.contextmanager
def ray_cluster(prepared: PreparedJob, address: str | None = None, engines: int | None = None,
                verbose: bool = False) -> Iterator[EnginePlan]:
    """Connected to (or running) a cluster, with the engines planned on it; a local cluster
    started here is shut down on the way out."""
    reason = f"--data-parallel {engines}" if address is None and engines and engines > 1 else "--ray"
    ray = require_ray(reason)
    from terra_cli.runtime import cuda_device_count

    if address is None and prepared.device.startswith("cuda:"):
        raise InputError(f"several engines spread over all visible GPUs; drop --device {prepared.job.device} "
                         "(choose GPUs with CUDA_VISIBLE_DEVICES)")
    local_gpus = cuda_device_count() if address is None and prepared.device != "cpu" else 0
    started_here = connect(ray, address, cpus=max(engines or 1, os.cpu_count() or 1), gpus=local_gpus,
                           verbose=verbose)
    try:
        yield EnginePlan(*plan_engines(ray, prepared, engines))
    finally:
        if started_here:
            ray.shutdown()


def run_on_ray(prepared: PreparedJob, address: str | None = None, engines: int | None = None, *,
               on_event: Event = lambda kind, engine, payload: None, verbose: bool = False) -> RayRun:
    with ray_cluster(prepared, address, engines, verbose) as plan:
        return drive(prepared, plan, on_event)


def drive(prepared: PreparedJob, plan: EnginePlan, on_event: Event = lambda kind, engine, payload: None) -> RayRun:
    """Run `prepared` on `plan.engines` actors. KeyboardInterrupt writes every result that is
    already back, stops the actors and propagates."""
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

    from terra_cli.scenarios.ray_actor import EngineSpec, ScenarioEngine

    job, out_dir = prepared.job, prepared.job.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log = ResultsLog(out_dir, RESULTS_NAME)
    run = RayRun()
    run.skipped = log_skipped(prepared.file, log)
    done_before = completed_ids(out_dir)
    pending = deque(s for s in prepared.file.scenarios if s.id not in done_before)
    run.resumed = len(prepared.file.scenarios) - len(pending)
    run.total, run.total_frames = len(pending), sum(s.frames - s.context_frames for s in pending)
    attempts: dict[str, list[str]] = {}
    avoid: dict[str, int] = {}  # scenario -> the engine it last failed on
    works: dict[str, object] = {}  # scenario -> its context in the object store (kept for retries)
    if not pending:  # a finished run, resumed: no engine needs to start
        return run
    delays = test_frame_delays()
    count, device, resources = plan.engines, plan.device, plan.resources
    threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // count) if device == "cpu" else 0
    backend = prepared.backend if device == "cpu" or prepared.job.backend != "auto" else "auto"
    engine_class = ray.remote(ScenarioEngine)
    window = max(window_for(prepared, "vllm"), window_for(prepared, "hf"))
    for index in range(count):
        spec = EngineSpec(job, backend, device, prepared.needs_tokenizer, index, threads, delays.get(index, 0.0))
        actor = engine_class.options(max_restarts=ENGINE_RESTARTS, max_task_retries=0, max_concurrency=window + 4,
                                     scheduling_strategy="SPREAD", **resources).remote(spec)
        run.engines.append(EngineState(index, actor, probe=actor.ready.remote()))
    clock = time.perf_counter()

    def record_failure(s: Scenario, engine: EngineState, why: str, final: bool = False) -> None:
        attempts.setdefault(s.id, []).append(f"engine {engine.index}: {why}")
        if len(attempts[s.id]) < MAX_ATTEMPTS and not final:
            avoid[s.id] = engine.index
            pending.appendleft(s)
            run.requeued += 1
            return
        works.pop(s.id, None)
        record = {"id": s.id, "status": "failed", "seed": s.seed, "line": s.line,
                  "reason": f"failed {len(attempts[s.id])} times: " + "; ".join(attempts[s.id])}
        log.add(record)
        run.failed += 1
        run.errors.append(f"{s.id}: {record['reason']}")
        on_event("written", engine, record)

    def finished(engine: EngineState, s: Scenario, result) -> None:
        works.pop(s.id, None)
        record = save_finished(out_dir, log, s, result.tokens, result.seconds, video=result.video,
                               extra={"engine": engine.index, "node": engine.node})
        if record["status"] == "done":
            run.done += 1
            engine.done += 1
            engine.written_frames += s.frames - s.context_frames
            run.generated_frames += s.frames - s.context_frames
        else:
            run.failed += 1
            run.errors.append(f"{s.id}: {record['reason']}")
        on_event("written", engine, record)

    def lost(engine: EngineState, why: str) -> None:
        """The actor died: its open scenarios go back to the queue; Ray restarts it."""
        scenarios = list(engine.open.values())
        engine.open.clear()
        engine.status, engine.restarts = "restarting", engine.restarts + 1
        engine.counted, engine.live, engine.pending_frames, engine.stats_ref = engine.counted + engine.live, 0, 0, None
        engine.probe = engine.actor.ready.remote()
        on_event("lost", engine, why)
        for s in reversed(scenarios):
            record_failure(s, engine, f"engine died ({why})")

    def take(engine: EngineState) -> Scenario | None:
        others = sum(e.status != "dead" for e in run.engines) > 1  # a retry waits for another engine
        for position, s in enumerate(pending):
            if position > 4 * window:
                break
            if not others or avoid.get(s.id) != engine.index:
                del pending[position]
                return s
        return None

    def hand_out(engine: EngineState) -> None:
        limit = window_for(prepared, engine.backend)
        while len(engine.open) < limit and pending:
            s = take(engine)
            if s is None:
                return
            if s.id not in works:
                try:
                    works[s.id] = ray.put(read_work(s))
                except Exception as exc:  # its context vanished or broke since validation
                    record_failure(s, engine, f"context unreadable: {' '.join(str(exc).split())}", final=True)
                    continue
            engine.open[engine.actor.generate.remote(works[s.id])] = s

    def settle(ref) -> None:
        for engine in run.engines:
            if engine.probe is not None and ref == engine.probe:
                engine.probe = None
                try:
                    info = ray.get(ref)
                except ActorUnavailableError:  # still restarting: ask again next tick
                    engine.probe_at = time.perf_counter() + TICK_SECONDS
                    return
                except RayActorError as exc:  # out of restarts, or it cannot start at all
                    engine.status = "dead"
                    on_event("dead", engine, _short(exc))
                    return
                engine.status, engine.node, engine.backend = "alive", info["node"], info["backend"]
                engine.startup_s = info["startup_s"]
                engine.first_ready = engine.first_ready or time.perf_counter()
                on_event("ready" if engine.restarts == 0 else "rejoined", engine, info)
                return
            if engine.stats_ref is not None and ref == engine.stats_ref:
                engine.stats_ref, engine.stats_at = None, time.perf_counter()
                try:
                    stats = ray.get(ref)
                except Exception:  # a dying actor: its generate calls say so
                    return
                engine.live, engine.pending_frames = stats["frames"], stats["pending_frames"]
                return
            if ref in engine.open:
                s = engine.open.pop(ref)
                try:
                    result = ray.get(ref)
                except RayActorError as exc:
                    engine.open[ref] = s
                    lost(engine, _short(exc))
                except RayTaskError as exc:
                    record_failure(s, engine, _short(exc))
                else:
                    finished(engine, s, result)
                return

    try:
        while pending or any(e.open for e in run.engines):
            if all(e.status == "dead" for e in run.engines):
                run.errors.append(f"every engine is dead; {len(pending)} scenario(s) not run (run again to resume)")
                break
            now = time.perf_counter()
            for engine in run.engines:
                if engine.probe is None and engine.status in ("starting", "restarting") and now >= engine.probe_at:
                    engine.probe = engine.actor.ready.remote()
                if engine.status == "alive":
                    hand_out(engine)
                    if engine.stats_ref is None and now - engine.stats_at > TICK_SECONDS:
                        engine.stats_ref = engine.actor.stats.remote()
            refs = [r for e in run.engines for r in (*e.open, e.probe, e.stats_ref) if r is not None]
            ready, _ = ray.wait(refs, num_returns=1, timeout=TICK_SECONDS)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                settle(ref)
            on_event("tick", None, run)
    except KeyboardInterrupt:
        # Whatever is already back is written before the actors go.
        refs = [r for e in run.engines for r in e.open]
        for ref in (ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []):
            settle(ref)
        raise
    finally:
        for engine in run.engines:
            ray.kill(engine.actor, no_restart=True)
        run.seconds = time.perf_counter() - clock
    return run


def read_work(s: Scenario):
    """A scenario's context as data for an actor on any node: tokens, or RGB frames."""
    from terra_cli.pipeline.inputs import load_context_tokens, read_context_frames
    from terra_cli.scenarios.ray_actor import ScenarioWork

    if s.context_tokens is not None:
        return ScenarioWork(s, context_tokens=load_context_tokens(s.context_tokens, s.context_frames))
    if s.context_images:
        return ScenarioWork(s, context_images=read_context_frames(list(s.context_images), s.context_frames))
    from terra_cli.models.default import sample_context_frames

    return ScenarioWork(s, context_images=list(sample_context_frames(s.context_frames)))


def _short(exc: BaseException) -> str:
    """The last meaningful line of a Ray error (its cause), not the whole remote traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = getattr(exc, "cause", None)
    if cause is not None and str(cause).strip():
        return " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
    return (lines[-1] if lines else type(exc).__name__)[:300]

