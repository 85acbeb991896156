"""`--data-parallel N`: one engine per GPU, each a worker process pinned with CUDA_VISIBLE_DEVICES.

Why processes and not vLLM's own data parallelism: vLLM 0.25's `data_parallel_size` is built for
serving (an API server balancing requests, engines that step in lockstep for MoE collectives), and
its offline `LLM` entry point runs one engine per process anyway. Our scenarios never talk to each
other, so N independent engines need no collective communication at all, and a scenario's tokens
depend only on its seed: they are the same on any engine, in any share.

The parent validates everything, splits the pending scenarios, starts the workers, draws one
progress display from their events, and folds their logs (`results.shard-K.jsonl`) into
`results.jsonl`. A crash before the fold loses nothing: resume reads the shard logs too.
"""

from __future__ import annotations

import os
import queue
import signal
import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from terra_cli.errors import InputError
from terra_cli.scenarios.job import EngineReady, PreparedJob, run_scenario_job
from terra_cli.scenarios.outdir import OutDirLock, check_out_dir, plan_outputs
from terra_cli.scenarios.runner import RESULTS_NAME, SHARD_RESULTS_GLOB, ResultsLog, ScenarioRun, log_skipped, read_results
from terra_cli.scenarios.spec import Scenario

POLL_SECONDS = 0.5


def split_scenarios(scenarios: list[Scenario], workers: int) -> list[list[Scenario]]:
    """Longest first onto the least-loaded worker (by generated frames), so shares finish together;
    ties keep file order, so the split is the same on every run."""
    if workers < 1:
        raise InputError(f"--data-parallel must be at least 1, got {workers}")
    shares: list[list[Scenario]] = [[] for _ in range(workers)]
    load = [0] * workers
    order = sorted(range(len(scenarios)), key=lambda i: (-(scenarios[i].frames - scenarios[i].context_frames), i))
    for i in order:
        target = min(range(workers), key=lambda w: (load[w], w))
        shares[target].append(scenarios[i])
        load[target] += scenarios[i].frames - scenarios[i].context_frames
    for share in shares:
        share.sort(key=lambda s: s.line)
    return shares


def merge_shard_results(out_dir: Path) -> int:
    """Append every worker log's lines to results.jsonl, then remove the worker logs. A crash in
    between leaves a line twice, which readers take as one."""
    out_dir = Path(out_dir)
    merged = 0
    log = ResultsLog(out_dir, RESULTS_NAME)
    for shard_log in sorted(out_dir.glob(SHARD_RESULTS_GLOB)):
        for record in read_results(shard_log):
            log.add(record)
            merged += 1
        shard_log.unlink()
    return merged


def worker_devices(device: str, workers: int) -> list[str | None]:
    """What each worker's CUDA_VISIBLE_DEVICES becomes (None: left as it is, for CPU workers)."""
    if device == "cpu":
        return [None] * workers
    if device != "cuda":
        raise InputError(f"--data-parallel {workers} spreads over all visible GPUs; drop --device {device} "
                         "(choose GPUs with CUDA_VISIBLE_DEVICES)")
    from terra_cli.runtime import cuda_device_count

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else \
        [str(i) for i in range(cuda_device_count())]
    if len(ids) < workers:
        raise InputError(f"--data-parallel {workers} needs {workers} GPUs; {len(ids)} visible"
                         + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))
    return ids[:workers]


@dataclass
class ParallelRun(ScenarioRun):
    engines: list[dict] = field(default_factory=list)  # per worker: gpu, scenarios, start-up, status


def run_data_parallel(
    prepared: PreparedJob,
    workers: int,
    *,
    on_ready: Callable[[int, EngineReady], None] = lambda worker, ready: None,
    on_frame: Callable[[int], None] = lambda worker: None,
    on_written: Callable[[int, dict], None] = lambda worker, record: None,
) -> ParallelRun:
    """Run `prepared` on `workers` engines. KeyboardInterrupt (or SIGTERM, which the CLI turns
    into one) stops every worker; each writes what it finished, and the logs are folded before
    the interrupt propagates. This process holds --out-dir for the workers."""
    job = prepared.job
    devices = worker_devices(prepared.device, workers)
    out_dir = Path(job.out_dir)
    check_out_dir(out_dir)
    with OutDirLock(out_dir):
        return _run_workers(prepared, devices, out_dir, on_ready, on_frame, on_written)


def _run_workers(prepared: PreparedJob, devices: list[str | None], out_dir: Path, on_ready, on_frame,
                 on_written) -> ParallelRun:
    import multiprocessing
    import time

    job, workers = prepared.job, len(devices)
    merge_shard_results(out_dir)
    plan = plan_outputs(prepared.file.scenarios, out_dir, decode=job.decode, overwrite=job.overwrite)
    run = ParallelRun()
    run.skipped = log_skipped(prepared.file, ResultsLog(out_dir, RESULTS_NAME))
    pending = plan.pending
    run.resumed = plan.resumed
    shares = split_scenarios(pending, workers)
    threads = max(1, (os.cpu_count() or 1) // workers) if prepared.device == "cpu" else 0
    context = multiprocessing.get_context("spawn")  # a fork would copy CUDA or vLLM state into the workers
    events = context.Queue()
    processes = {}
    clock = time.perf_counter()
    for worker, (share, gpu) in enumerate(zip(shares, devices)):
        run.engines.append({"worker": worker, "gpu": gpu, "scenarios": len(share), "status": "idle"})
        if not share:
            continue
        worker_job = PreparedJob(replace(job, threads=threads or job.threads), prepared.file, prepared.backend,
                                 "cuda" if gpu is not None else prepared.device, prepared.model_label,
                                 prepared.needs_tokenizer)
        process = context.Process(target=_worker_main, name=f"terra-dp{worker}",
                                  args=(worker_job, worker, [s.id for s in share], gpu, events))
        with _environment({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}):
            process.start()
        processes[worker] = process
        run.engines[worker]["status"] = "running"
    interrupted = False
    try:
        while processes:
            try:
                _dispatch(events.get(timeout=POLL_SECONDS), run, on_ready, on_frame, on_written)
            except queue.Empty:
                pass
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True
                _stop(processes)
            for worker, process in list(processes.items()):
                if not process.is_alive():
                    process.join()
                    _drain(events, run, on_ready, on_frame, on_written)
                    if run.engines[worker]["status"] == "running":
                        run.engines[worker]["status"] = f"exited with code {process.exitcode}"
                        run.errors.append(f"worker {worker}: exited with code {process.exitcode}")
                    del processes[worker]
        _drain(events, run, on_ready, on_frame, on_written)
    finally:
        for process in processes.values():
            process.kill()
        merge_shard_results(out_dir)
        run.seconds = time.perf_counter() - clock
    if interrupted:
        raise KeyboardInterrupt
    return run


def _dispatch(event, run: ParallelRun, on_ready, on_frame, on_written) -> None:
    kind, worker, payload = event
    engine = run.engines[worker]
    if kind == "ready":
        engine["startup_s"], engine["startup"] = payload.seconds, payload.startup
        on_ready(worker, payload)
    elif kind == "frame":
        run.generated_frames += 1
        on_frame(worker)
    elif kind == "written":
        if payload.get("status") == "done":
            run.done += 1
        else:
            run.failed += 1
            run.errors.append(f"{payload.get('id')}: {payload.get('reason')}")
        on_written(worker, payload)
    elif kind in ("finished", "interrupted"):
        engine["status"] = kind
    elif kind == "error":
        engine["status"] = "failed"
        run.errors.append(f"worker {worker} (GPU {engine['gpu']}): {payload}")


def _drain(events, run, on_ready, on_frame, on_written) -> None:
    while True:
        try:
            _dispatch(events.get_nowait(), run, on_ready, on_frame, on_written)
        except queue.Empty:
            return


def _stop(processes: dict) -> None:
    for process in processes.values():
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)


@contextlib.contextmanager
def _environment(values: dict):
    """Variables set for the duration (a spawned process copies the environment when it starts)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _worker_main(prepared: PreparedJob, worker: int, ids: list[str], gpu: str | None, events) -> None:
    # A terminal's Ctrl-C reaches every process of the group; the parent alone decides, and
    # forwards one SIGTERM, so a worker is never interrupted twice while it writes what it has.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt_once)
    signal.signal(signal.SIGHUP, _interrupt_once)
    if prepared.backend == "vllm":
        from terra_cli.runtime import configure_vllm_env

        configure_vllm_env()
    try:
        run_scenario_job(
            prepared, only_ids=set(ids), results_name=SHARD_RESULTS_GLOB.replace("*", str(worker)), lock=False,
            on_ready=lambda ready: events.put(("ready", worker, ready)),
            on_frame=lambda: events.put(("frame", worker, None)),
            on_written=lambda record: events.put(("written", worker, record)))
    except KeyboardInterrupt:
        events.put(("interrupted", worker, None))
    except Exception as exc:  # reported by the parent as this worker's failure, one line
        events.put(("error", worker, " ".join(f"{type(exc).__name__}: {exc}".split())))
    else:
        events.put(("finished", worker, None))
    events.close()
    events.join_thread()


def _interrupt_once(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise KeyboardInterrupt

