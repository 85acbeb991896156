"""`terra bench --scenarios N`: scenario throughput the way `terra generate --scenarios` runs it.

N scenarios of random context tokens and preset trajectories go through the product path
(`scenarios.job` / `scenarios.ray_runner`, continuous batching, staggered starts as slots free up),
tokens only. Reported: aggregate generated frames/s, GPU busy fraction per GPU while frames are
being generated (NVML), each engine's start-up, a projected ACT-Bench run, and optionally the
lockstep figure (all rollouts advancing frame by frame) on a fresh engine in the same run.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from terra_cli.bench.engine_report import BUSY_BUCKET_S, BusySampler, describe_engine_loop, gpu_indices, loop_since
from terra_cli.scenarios.spec import ACT_BENCH_FRAMES, ACT_BENCH_SAMPLES  # noqa: F401  (act_bench imports them here)

ACT_BENCH_GENERATED_FRAMES = ACT_BENCH_FRAMES - 3  # 3 context frames
PRESETS = ("left", "right", "straight", "stop", "accelerate")
LOOP_LOG_S = 60.0  # on Ray, each engine's loop over the last minute goes to the log this often
# Each scenario gets a context file of its own (a shared one would let vLLM's prefix cache skip the
# prefill and flatter the rate); 100,000 is 44 ACT-Benches, days of generation on any GPU, and its
# files can still be removed within seconds of a SIGTERM.
MAX_BENCH_SCENARIOS = 100_000


@dataclass(frozen=True)
class ScenarioBenchPlan:
    scenarios: int = 256
    frames: int = 25
    context_frames: int = 3
    max_rollouts: int | None = None  # None: auto (backends.vllm_stream.auto_in_flight)
    data_parallel: int = 1  # engines, one per GPU
    ray: str | None = None  # run the engines as Ray actors: local, or a cluster's address (several engines: local)
    lockstep: int = 0  # rollouts of the lockstep comparison; 0 skips it
    backend: str = "vllm"
    device: str = "auto"
    dtype: str = "auto"
    temperature: float = 0.9
    seed: int = 0
    vllm_options: dict = field(default_factory=dict)  # engine arguments (pipeline.engine_request.engine_options and more)
    even_waves: bool = False  # --max-rollouts even (scenarios.job.even_waves)


def write_bench_scenarios(folder: Path, layout, plan: ScenarioBenchPlan) -> Path:
    """A terra scenario file: random context tokens (one .npy each), presets at 10-50 km/h, seeds."""
    rng = np.random.default_rng(plan.seed)
    smallest = np.min_scalar_type(layout.image_vocab_size - 1)  # uint16 for Terra: a quarter of int64's bytes
    lines = []
    for i in range(plan.scenarios):
        name = f"ctx{i:05d}.npy"
        codes = rng.integers(0, layout.image_vocab_size, size=(plan.context_frames, layout.image_tokens))
        np.save(folder / name, codes.astype(smallest))
        lines.append({"id": f"s{i:05d}", "context": name, "actions": PRESETS[i % len(PRESETS)],
                      "frames": plan.frames, "seed": plan.seed + i, "speed": round(float(rng.uniform(10, 50)), 1)})
    path = folder / "scenarios.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_scenario_bench(checkpoint: Path, plan: ScenarioBenchPlan, out_dir: Path | None = None,
                       log: Callable[[str], None] = print,
                       progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Run the plan; the scenario outputs (tokens) stay in `out_dir` when given, else in a
    temporary folder that is removed. `progress(generated frames, all to generate)` as they come."""
    from terra_cli.models.checkpoint import load_config
    from terra_cli.scenarios.job import ScenarioJob, prepare_job
    from terra_cli.backends.base import Sampling
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.spec import Defaults

    layout = load_config(checkpoint).layout
    with tempfile.TemporaryDirectory(prefix="terra-bench-scenarios-") as tmp:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        path = write_bench_scenarios(work, layout, plan)
        job = ScenarioJob(path, work / "outputs", Defaults(seed=plan.seed), model=ModelSpec(str(checkpoint)),
                          engine=Engine(plan.backend, plan.device, plan.dtype, options=dict(plan.vllm_options)),
                          sampling=Sampling(temperature=plan.temperature), max_rollouts=plan.max_rollouts,
                          even_waves=plan.even_waves, decode=False)
        prepared = prepare_job(job)
        gpus = gpu_indices(prepared.device, plan.data_parallel)
        where = f"on Ray ({plan.ray or 'local'}), " if uses_ray(plan.data_parallel, plan.ray) else ""
        log(f"{plan.scenarios} scenarios of {plan.frames} frames, {plan.data_parallel} engine(s) {where}"
            f"up to {plan.max_rollouts or ('even' if plan.even_waves else 'auto')} in flight each, KV cache {plan.vllm_options.get('kv_cache_dtype', 'auto')}")
        timed = TimedRun(prepared, plan.data_parallel, plan.ray, log, progress)
        run = timed.run()
        if run.errors or run.done != plan.scenarios:
            raise RuntimeError(f"scenario run incomplete: {run.done} of {plan.scenarios} done; {run.errors[:3]}")
        marks = timed.marks
        generating = marks["end"] - marks["first_frame"]
        rate = run.generated_frames / generating
        results = {
            "plan": {k: v for k, v in plan.__dict__.items()},
            "engines": timed.engine_rows(),
            "stream": {
                "scenarios": plan.scenarios, "generated_frames": run.generated_frames,
                "seconds_generating": round(generating, 2), "seconds_wall": round(marks["end"] - marks["start"], 2),
                "generated_frames_per_s": round(rate, 3), **timed.measures(),
                "projected_act_bench_hours": round(ACT_BENCH_SAMPLES * ACT_BENCH_GENERATED_FRAMES / rate / 3600, 3),
            },
        }
        log(f"continuous: {rate:.2f} generated frames/s over {generating:.1f} s, GPU busy {timed.sampler.busy()}")
        if plan.lockstep:
            results["lockstep"] = _lockstep(checkpoint, layout, plan, gpus, log)
    return results


class TimedRun:
    """A prepared scenario job run as `generate --scenarios` runs it (`run_engines`), with what a
    bench reports: marks (start, the first engine ready, first and last frame, end), each
    engine's start-up and in-flight count (on Ray also its share, restarts and lost frames), and
    how busy the GPUs were from the first frame on."""

    def __init__(self, prepared, engines: int = 1, ray: str | None = None, log: Callable[[str], None] = print,
                 progress: Callable[[int, int], None] = lambda done, total: None):
        self.prepared, self.engine_count, self.ray, self.log, self.progress = prepared, engines, ray, log, progress
        self.total = sum(s.frames - s.context_frames for s in prepared.file.scenarios)
        self.sampler = BusySampler(gpu_indices(prepared.device, engines))
        self.marks: dict[str, float] = {}
        self.engines: dict[int, dict] = {}
        self.frames = 0
        self.frame_marks: list[float] = []  # perf_counter at each new frame count, for the rate timeline
        self.engine_loop: dict | None = None
        self.loops_logged: dict[int, dict] = {}  # Ray: each engine's loop times when last logged
        self.loops_logged_at = time.perf_counter()
        self.frames_logged = 0  # the frame count when the rate was last logged
        self.engine_events: list[str] = []  # Ray: engines lost, restarted or gone, as logged
        self.busy_logged = 0  # how many GPU samples there were then

    def on_ready(self, index: int, ready) -> None:
        self.marks.setdefault("ready", time.perf_counter())
        self.engines[index] = {"engine": index, "startup_s": ready.seconds, "startup": ready.startup,
                               "in_flight": ready.in_flight, "in_flight_reason": ready.in_flight_reason}
        self.log(f"engine {index} ready in {ready.seconds:.1f} s, {ready.in_flight} in flight"
                 + (f" ({ready.in_flight_reason})" if ready.in_flight_reason else ""))

    def on_engine_event(self, line: str) -> None:
        self.engine_events.append(f"{time.perf_counter() - self.marks['start']:.0f} s: {line}")
        self.log(line)

    def on_frames(self, count: int) -> None:
        now = time.perf_counter()
        if not self.frames:
            self.marks["first_frame"] = now
            self.sampler.start()
        if count > self.frames:
            self.frame_marks.extend([now] * (count - self.frames))
            self.frames = count
            self.marks["last_frame"] = now
            self.progress(count, self.total)

    def on_tick(self, run) -> None:
        """Every LOOP_LOG_S, the generated frames/s and the GPUs' busy share over that time, and each
        engine's loop (one engine or Ray's), in the log as the run goes (a run cut off by a time limit still
        tells its rate and where its engines' time went, and when)."""
        now = time.perf_counter()
        if now - self.loops_logged_at < LOOP_LOG_S:
            return
        since, self.loops_logged_at = now - self.loops_logged_at, now
        made, self.frames_logged = self.frames - self.frames_logged, self.frames
        busy = self.sampler.busy_after(self.busy_logged)
        self.busy_logged = len(self.sampler.times)
        busy_text = f", GPU busy {'/'.join(f'{100 * b:.0f}' for b in busy)}%" if busy else ""
        self.log(f"{now - self.marks['start']:.0f} s: {made} frames in the last {since:.0f} s "
                 f"({made / since:.2f} generated frames/s), {self.frames} of {self.total}{busy_text}")
        for engine in run.engines:
            if loop := engine.engine_loop:  # (a LiveEngine's is taken now: once)
                line = describe_engine_loop(loop_since(loop, self.loops_logged.get(engine.index)))
                self.loops_logged[engine.index] = dict(loop)
                if line:
                    self.log(f"{now - self.marks['start']:.0f} s, engine {engine.index}, last minute: {line}")

    def run(self):
        self.marks["start"] = time.perf_counter()
        try:
            run = run_engines(self.prepared, self.engine_count, self.ray, self.on_ready, self.on_frames, self.on_tick,
                              self.on_engine_event)
        finally:
            self.sampler.stop()
        self.marks["end"] = time.perf_counter()
        self.engine_loop = getattr(run, "engine_loop", None)  # one engine in this process
        if line := describe_engine_loop(self.engine_loop):
            self.log(line)
        for row in getattr(run, "summary", lambda: [])():  # Ray; an engine still starting at the end has a row too
            engine = self.engines.setdefault(row["engine"], {"engine": row["engine"], "startup_s": row["startup_s"],
                                                             "startup": {}, "in_flight": None})
            engine.update({k: row[k] for k in ("status", "scenarios", "share", "frames", "restarts", "lost_frames",
                                               "engine_loop")})
            if line := describe_engine_loop(row["engine_loop"]):
                self.log(f"engine {row['engine']} {line}")
        return run

    def measures(self) -> dict:
        """What every bench reports beside its own numbers: the GPUs' busy fraction (mean and per
        BUSY_BUCKET_S) and, for one engine in this process, where its loop's time went."""
        return {"gpu_busy": self.sampler.busy(), "gpu_busy_timeline": self.sampler.timeline(),
                "frames_per_s_timeline": self.frames_timeline(), "gpu_busy_bucket_s": BUSY_BUCKET_S,
                "engine_loop": self.engine_loop, "engine_events": self.engine_events}

    def frames_timeline(self, bucket_s: float = BUSY_BUCKET_S) -> list[float]:
        """Generated frames/s per `bucket_s` from the first frame, beside the busy timeline: a
        rate that changes with a phase (a round's start, another job on the host) shows here."""
        if not self.frame_marks:
            return []
        buckets = ((np.asarray(self.frame_marks) - self.frame_marks[0]) // bucket_s).astype(int)
        return [round(n / bucket_s, 2) for n in np.bincount(buckets).tolist()]

    def engine_rows(self) -> list[dict]:
        return [self.engines[k] for k in sorted(self.engines)]


def uses_ray(engines: int, ray: str | None) -> bool:
    return engines > 1 or ray is not None


class LiveEngine:
    """One engine in this process as `TimedRun.on_tick` reads a Ray engine: its index and its loop's
    times so far, taken only when asked (once a minute, not at every frame)."""

    def __init__(self, index: int, run) -> None:
        self.index, self.run = index, run

    @property
    def engine_loop(self) -> dict | None:
        so_far = self.run.loop_so_far
        return so_far() if so_far is not None else None


def run_engines(prepared, engines: int, ray: str | None, on_ready: Callable, on_frames: Callable[[int], None],
                on_tick: Callable[[object], None] = lambda run: None,
                on_engine_event: Callable[[str], None] = lambda line: None):
    """Run a prepared scenario job the way `generate --scenarios` does: one engine in this
    process, or Ray actors (`ray` given, or several engines: a local cluster). Calls
    on_ready(engine index, EngineReady) as each engine is ready, on_engine_event(line) as a Ray
    engine is lost, rejoins or is gone for good, and on_frames(generated frames
    so far) after each frame (one engine) or every tick (Ray: frames of written scenarios and
    the engines' last counts of open ones), and on_tick with them (the RayRun; one engine: its
    run as a `LiveEngine`). Returns the run (a ScenarioRun, RayRun on Ray)."""
    from terra_cli.scenarios.job import EngineReady, run_scenario_job

    if not uses_ray(engines, ray):
        count = [0]

        def on_frame(run):
            count[0] += 1
            on_frames(count[0])
            on_tick(SimpleNamespace(engines=[LiveEngine(0, run)]))

        return run_scenario_job(prepared, on_ready=lambda ready: on_ready(0, ready), on_frame=on_frame)
    from terra_cli.scenarios.ray_hand_out import engine_event_line
    from terra_cli.scenarios.ray_runner import run_on_ray

    def on_event(kind, engine, payload):
        if kind == "ready":
            on_ready(engine.index, EngineReady(payload["startup_s"], payload["startup"], payload["in_flight"]))
        elif kind in ("lost", "rejoined", "dead"):  # a bench on fewer engines than asked must say so
            on_engine_event(engine_event_line(kind, engine, payload))
        elif kind == "tick":
            if payload.progress_frames:
                on_frames(payload.progress_frames)
            on_tick(payload)

    return run_on_ray(prepared, None if ray in (None, "local") else ray, engines, on_event=on_event, probe_wakes=True)


def _lockstep(checkpoint: Path, layout, plan: ScenarioBenchPlan, gpus: list[int], log) -> dict:
    """All rollouts advance frame by frame together (VllmBackend.generate): the figure before
    continuous batching, measured on a fresh engine."""
    from terra_cli.actions import preset_actions
    from terra_cli.backends import Sampling, load_backend
    from terra_cli.runtime import resolve_device

    rng = np.random.default_rng(plan.seed)
    context = rng.integers(0, layout.image_vocab_size, size=(plan.context_frames, layout.image_tokens))
    actions = preset_actions("left", plan.frames, 30.0)
    engine = load_backend(plan.backend, checkpoint, device=resolve_device(plan.device), dtype=plan.dtype,
                          max_rollouts=plan.lockstep, **plan.vllm_options)
    try:
        batch = (plan.lockstep, *context.shape)
        sampler = BusySampler(gpus[:1])
        started = time.perf_counter()
        sampler.start()
        engine.generate(np.broadcast_to(context, batch), np.broadcast_to(actions, (plan.lockstep, *actions.shape)),
                        plan.frames, Sampling(temperature=plan.temperature, seed=plan.seed))
        seconds = time.perf_counter() - started
        sampler.stop()
    finally:
        engine.close()
    generated = plan.lockstep * (plan.frames - plan.context_frames)
    log(f"lockstep x{plan.lockstep}: {generated / seconds:.2f} generated frames/s")
    return {"rollouts": plan.lockstep, "seconds": round(seconds, 2), "generated_frames_per_s": round(generated / seconds, 3),
            "gpu_busy": sampler.busy()[str(gpus[0])] if gpus else None}
