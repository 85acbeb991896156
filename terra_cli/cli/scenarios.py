"""`terra generate --scenarios FILE`: many videos on one engine or on Ray engines. The user still
types `terra generate --scenarios`; `generate` parses the options into a `ScenarioJob` and hands it
here, which checks it, reports progress and the summary, and maps a run's failure to its exit code."""

from __future__ import annotations

from typing import Optional

import typer

from terra_cli.cli.app import EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED, _state, console, error_line, say
from terra_cli.errors import InputError


def generate_scenarios(job, data_parallel: int, ray_address: Optional[str] = None,
                       engines: Optional[int] = None) -> None:
    from terra_cli.scenarios.job import prepare_job
    from terra_cli.scenarios.outdir import OutDirLock

    if ray_address is not None and data_parallel > 1:
        raise InputError(f"--data-parallel {data_parallel} is a local Ray cluster of {data_parallel} engines; with "
                         f"--ray give --engines {data_parallel} instead")
    if engines is not None and ray_address is None:
        raise InputError("--engines works with --ray ADDRESS (on one machine: --data-parallel N)")
    ray = None
    if ray_address is not None or data_parallel > 1:
        from terra_cli.scenarios.ray_cluster import require_ray

        require_ray("--ray" if ray_address is not None else f"--data-parallel {data_parallel}")
        ray = (None if ray_address in (None, "local") else ray_address,
               engines if ray_address is not None else data_parallel)
    prepared = prepare_job(job)  # every line and option checked before any model loads
    if ray is None:
        with OutDirLock(job.out_dir):  # one run per --out-dir, held from before the model loads
            _run_scenarios(prepared, data_parallel)
        return
    from terra_cli.scenarios.ray_cluster import ray_cluster

    # The cluster is reached before --out-dir is made and locked: a bad --ray address leaves nothing behind.
    with ray_cluster(prepared, *ray, verbose=_state["verbose"]) as plan, OutDirLock(job.out_dir):
        _run_scenarios(prepared, data_parallel, ray, plan)


def _run_scenarios(prepared, data_parallel: int, ray: Optional[tuple] = None, plan=None) -> None:
    from terra_cli.cli.progress import TaskProgress
    from terra_cli.scenarios.job import pending_scenarios, run_scenario_job

    job = prepared.job
    file, out_dir = prepared.file, job.out_dir
    in_flight = job.max_rollouts or 0  # 0: --max-rollouts auto, the engine says how many once it is ready
    where = "1 engine" if ray is None else f"Ray ({ray[0] or 'local'}, {ray[1] or 'one per GPU'} engine(s))"
    say(f"{len(file.scenarios)} scenario(s) from {job.scenarios} ({file.source_format}), backend {prepared.backend}, "
        f"model {prepared.model_label}, {where}, "
        + (f"up to {in_flight} in flight each" if in_flight
           else "each engine's scenarios in equal waves" if job.even_waves else "rollouts in flight as the engine holds") + f" -> {out_dir}/")
    pending = pending_scenarios(prepared)  # a resumed run's bars count what it still makes
    total_frames = sum(s.frames - s.context_frames for s in pending)
    progress = TaskProgress(console, "scenarios", total_frames, unit="generated frames")
    written = [0]
    # --videos-at-end writes every video after the last frame (minutes on a long run): a bar of its own, rate and ETA
    videos_bar = progress.add_bar("videos", len(pending), "written") if job.videos_at_end and pending else None

    def note() -> str:  # the frames' rate is the bar's own column
        return f"{written[0]} of {len(pending)} written"

    def frame_done(worker: int) -> None:
        progress.advance(1, note=note())

    def scenario_written(worker: int, record: dict) -> None:
        done = record.get("status") == "done"
        written[0] += done
        if videos_bar is not None and done:
            progress.advance_bar(videos_bar)
        progress.note(note())  # also once no frame is made any more (--videos-at-end's videos)

    def engine_ready(worker: int, ready) -> None:
        say(f"engine {worker} ready in {ready.seconds:.1f} s" + (f"; {ready.in_flight_reason}" if ready.in_flight_reason else ""))

    try:
        if ray is not None:
            from terra_cli.cli.ray_progress import RayDisplay
            from terra_cli.scenarios.ray_runner import drive

            display = RayDisplay(progress, say, written)
            with progress:
                run = drive(prepared, plan, on_event=display.event)
        else:
            with progress:
                run = run_scenario_job(prepared, on_ready=lambda ready: engine_ready(0, ready),
                                       on_frame=lambda run: frame_done(0),
                                       on_written=lambda record: scenario_written(0, record))
    except KeyboardInterrupt:
        say(f"interrupted: {written[0]} scenario(s) written and recorded in {out_dir}/results.jsonl by this run; "
            "run the same command again to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    say(f"{run.done} scenario(s) written, {run.resumed} already done, {run.skipped} invalid line(s) skipped, "
        f"{run.failed} failed; {run.generated_frames} frames in {run.seconds:.1f} s "
        f"({run.generated_frames / max(run.seconds, 1e-9):.2f} generated frames/s) -> {out_dir}/results.jsonl")
    if ray is not None:
        display.summary(run)
    if run.failed or run.errors:  # the run's failure, not the user's input (that was all checked up front): exit 1
        error_line(f"{run.failed} scenario(s) could not be written, {len(run.errors)} error(s): "
                   + "; ".join(run.errors[:3]) + f" (see {out_dir}/results.jsonl; the same command retries them)")
        raise typer.Exit(EXIT_INTERNAL_ERROR)
