"""A scenario run as plain data: what `terra generate --scenarios` asks for, checked before any
model loads, then run on one engine (`run_scenario_job`) or on several (`scenarios.ray_runner`).

A `ScenarioJob` is picklable on purpose: a data-parallel worker process receives the same job and
re-reads the same file, so a worker cannot see a different scenario than its parent validated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError
from terra_cli.models.resolve import ModelSpec
from terra_cli.pipeline.world_model import Engine
from terra_cli.seeds import check_seed_range
from terra_cli.scenarios.outdir import check_out_dir, plan_outputs
from terra_cli.scenarios.runner import RESULTS_NAME, ScenarioRun, check_scenarios, run_scenarios
from terra_cli.scenarios.spec import Defaults, ScenarioFile, check_context_tokens, read_scenarios


@dataclass(frozen=True)
class ScenarioJob:
    scenarios: Path
    out_dir: Path
    defaults: Defaults = Defaults()
    rollouts: int = 1
    skip_invalid: bool = False
    model: ModelSpec = ModelSpec()
    # backend, device, dtype, the reference's CPU threads, vLLM's options (engine_request.VllmOptions; a bench adds
    # raw vLLM arguments)
    engine: Engine = Engine()
    # temperature, top_k, top_p; each scenario's own seed replaces `sampling.seed`
    sampling: Sampling = Sampling()
    max_rollouts: int | None = None  # in flight on one engine; None: as many as the KV cache holds (auto_in_flight)
    even_waves: bool = False  # with max_rollouts None: --max-rollouts even (equal waves, up to EVEN_WAVES_LIMIT)
    decode: bool = True  # False: tokens only (.npy), no image decoder
    overwrite: bool = False  # replace files no terra run recorded for their scenario; re-run changed scenarios
    refiner: object = None  # refiner.decoder.RefinerChoice: decode with Terra's video refiner
    writers: int | None = None  # video writer processes (scenarios.writers); None: default_writers for the device
    # --videos-at-end: the engine's writer threads decode nothing while it generates, and every video once it is
    # done (one engine: beside it the decoder slowed its steps 12-15%, while alone it needs a fraction of that)
    videos_at_end: bool = False


@dataclass
class PreparedJob:
    """What `prepare_job` found out without loading a model."""

    job: ScenarioJob
    file: ScenarioFile
    backend: str  # resolved: hf or vllm
    device: str  # resolved: cpu, cuda or cuda:N
    model_label: str
    needs_tokenizer: bool
    pending: list  # what --out-dir does not hold yet, as prepare_job found it (the run plans again, holding it)


def prepare_job(job: ScenarioJob) -> PreparedJob:
    """Every check that needs no model weights: options, --out-dir, every scenario line (token
    contexts against the model's config), model and tokenizer found, and what the run would
    replace in --out-dir. Raises a one-line InputError or OutputError naming what is wrong; writes
    nothing (the run re-checks --out-dir once it holds it)."""
    from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name
    from terra_cli.models.checkpoint import load_config
    from terra_cli.runtime import resolve_device, resolve_dtype_name
    from terra_cli.media.frames import check_video_writer

    out_dir = Path(job.out_dir)
    check_out_dir(out_dir)
    check_seed_range(job.defaults.seed, job.rollouts, "--seed")
    device = resolve_device(job.engine.device)
    resolve_dtype_name(job.engine.dtype, device)
    if job.max_rollouts is not None and job.max_rollouts < 1:
        raise InputError(f"--max-rollouts must be at least 1 or auto, got {job.max_rollouts}")
    if job.even_waves and job.max_rollouts is not None:
        raise InputError(f"--max-rollouts is either even or a count, not both (got {job.max_rollouts} and even)")
    _check_writers(job)
    _check_videos_at_end(job)
    if job.defaults.image_root is not None and not Path(job.defaults.image_root).is_dir():
        raise InputError(f"--image-root {job.defaults.image_root} is not a folder (give the nuScenes dataroot)")
    file = read_scenarios(job.scenarios, job.defaults, job.rollouts)  # every line, before any model
    check_scenarios(file, job.skip_invalid)
    backend = resolve_backend_name(job.engine.backend)
    check_backend_options(backend, job.engine.options, device)
    if job.decode:
        check_video_writer()
    if job.refiner is not None:
        _check_refiner(job, file)
    choice = job.model.resolve()
    layout = load_config(choice.world_model_dir).layout
    file = check_context_tokens(file, layout.image_tokens, layout.image_vocab_size)
    check_scenarios(file, job.skip_invalid)
    images = any(s.context_tokens is None for s in file.scenarios)
    needs_tokenizer = job.decode or images
    if needs_tokenizer and choice.tokenizer is None:
        why = "to decode videos" if job.decode else "to encode image contexts"
        raise InputError(f"--model {job.model.model} comes without an image tokenizer, needed {why}: pass --tokenizer "
                         "DIR_OR_HUB_ID" + ("" if images else " (or --no-decode for tokens only)"))
    pending = list(file.scenarios)
    if out_dir.is_dir():
        pending = plan_outputs(file.scenarios, out_dir, decode=job.decode, overwrite=job.overwrite,
                               inputs=file.input_files()).pending
    return PreparedJob(job, file, backend, device, choice.label, needs_tokenizer, pending)


# --max-rollouts auto: at most this many in flight (256 was the fastest measured, benchmarks/README.md)
AUTO_MAX_ROLLOUTS = 256


# --max-rollouts even: at most this many in flight (vLLM captures CUDA graphs for batches up to 512)
EVEN_WAVES_LIMIT = 512


def parse_max_rollouts(text) -> int | None:
    """--max-rollouts: `auto` or `even` (None: chosen from the KV cache once the engine is up;
    `wants_even_waves` tells them apart) or a count >= 1."""
    value = str(text).strip().lower()
    if value in ("auto", "even"):
        return None
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"--max-rollouts must be auto, even or a whole number >= 1, got {text!r}")
    return int(value)


def wants_even_waves(text) -> bool:
    """--max-rollouts even: the run's rollouts in equal waves (`even_waves`)."""
    return str(text).strip().lower() == "even"


def even_waves(rollouts: int, capacity: int) -> int:
    """Rollouts in flight that run `rollouts` rollouts of one length in the fewest waves, all equally
    full: 572 at a capacity of 511 are two waves of 286, not one of 511 and one of 61. Rollouts of
    one length start and end together, and a wave of few costs nearly the steps of a full one (a
    step reads the weights whatever it holds), so a small last wave is a wave of steps for few frames."""
    if rollouts < 1 or capacity < 1:
        raise ValueError("rollouts and capacity must be at least 1")
    waves = -(-rollouts // capacity)
    return -(-rollouts // waves)


def rollouts_to_load(job: ScenarioJob, rollouts: int | None) -> int:
    """The rollouts in flight an engine is started for (vLLM's max_num_seqs, from which terra sizes its
    KV cache): an explicit count; with `even_waves`, equal waves of the engine's `rollouts` up to
    EVEN_WAVES_LIMIT; else AUTO_MAX_ROLLOUTS."""
    if job.max_rollouts is not None:
        return job.max_rollouts
    if job.even_waves and rollouts:
        return even_waves(rollouts, EVEN_WAVES_LIMIT)
    return AUTO_MAX_ROLLOUTS


MAX_WRITERS = 32


def _check_writers(job: ScenarioJob) -> None:
    if job.writers is None or job.writers == 0:
        return
    if not 0 < job.writers <= MAX_WRITERS:
        raise InputError(f"--writers must be 0 to {MAX_WRITERS}, got {job.writers}")
    if not job.decode:
        raise InputError("--writers makes videos: drop it with --no-decode (tokens only)")
    if job.refiner is not None:
        raise InputError("--decoder refiner decodes in the engine's process (one copy of the refiner on the GPU): "
                         "drop --writers")


def _check_videos_at_end(job: ScenarioJob) -> None:
    if not job.videos_at_end:
        return
    if not job.decode:
        raise InputError("--videos-at-end is about videos: drop it with --no-decode (tokens only)")
    if job.refiner is not None:
        raise InputError("--decoder refiner refines beside the engine: drop --videos-at-end")
    if job.writers:
        raise InputError(f"--videos-at-end decodes in the engine's own writer threads: drop --writers {job.writers}")


def job_writers(job: ScenarioJob, device: str) -> int:
    """The writer processes a run on `device` uses: --writers, or its default; none without videos
    or with the refiner (see runner.run_scenarios)."""
    from terra_cli.scenarios.writers import default_writers

    if not job.decode or job.refiner is not None:
        return 0
    return default_writers(device) if job.writers is None else job.writers


def _check_refiner(job: ScenarioJob, file: ScenarioFile) -> None:
    from terra_cli.refiner.checkpoint import resolve_refiner_file
    from terra_cli.refiner.windows import check_frames

    if not job.decode:
        raise InputError("--decoder refiner makes videos: drop --no-decode (or use --decoder frames)")
    for s in file.scenarios:
        check_frames(s.frames)
    resolve_refiner_file(job.refiner.spec)


@dataclass
class EngineReady:
    seconds: float  # from the start of loading to an engine that takes requests
    startup: dict  # vLLM's own start-up phases, when known
    in_flight: int = 1  # rollouts in flight on this engine
    in_flight_reason: str = ""  # why that many, with --max-rollouts auto


@dataclass
class LoadedEngine:
    engine: object
    tokenizer: object  # the image tokenizer, or None when the job needs none
    ready: EngineReady
    world: object = None  # the pipeline.world_model.WorldModel that holds both


def load_job_engine(job: ScenarioJob, backend: str, device: str, needs_tokenizer: bool,
                    longest_frames: int | None = None,
                    adjust_options: Callable[[object, dict], None] = lambda tokenizer, options: None,
                    rollouts: int | None = None) -> LoadedEngine:
    """The tokenizer and the engine of a job on `device`, and how many rollouts it takes at once
    (`--max-rollouts auto`: as many of `longest_frames` as its KV cache holds; `even`: `rollouts`,
    this engine's share of the run, split into equal waves of at most that many). One engine here,
    one per Ray actor (`ray_actor.py`). `adjust_options(tokenizer, engine options)` runs between
    the two loads (the refiner takes its GPU share there)."""
    from terra_cli.pipeline.world_model import load_world_model

    started = time.perf_counter()
    load_for = rollouts_to_load(job, rollouts)
    world = load_world_model(job.model.resolve(), replace(job.engine, backend=backend, device=device),
                             needs_tokenizer=needs_tokenizer, max_rollouts=load_for, between=adjust_options)
    try:
        in_flight, reason = job.max_rollouts, ""
        if in_flight is None:
            in_flight, reason = world.backend.auto_in_flight(longest_frames or world.layout.max_frames, load_for)
            if job.even_waves and rollouts:
                in_flight = even_waves(rollouts, in_flight)
                reason += (f"; --max-rollouts even: this engine's {rollouts} rollout(s) in "
                           f"{-(-rollouts // in_flight)} wave(s) of at most {in_flight}")
    except BaseException:
        world.close()
        raise
    startup = {k: v for k, v in world.startup.items() if k != "timeline"}
    return LoadedEngine(world.backend, world.tokenizer, EngineReady(round(time.perf_counter() - started, 2), startup,
                                                                    in_flight, reason), world)


def run_scenario_job(
    prepared: PreparedJob,
    *,
    on_ready: Callable[[EngineReady], None] = lambda ready: None,
    on_frame: Callable[[ScenarioRun], None] = lambda run: None,
    on_written: Callable[[dict], None] = lambda record: None,
    only_ids: set[str] | None = None,
    results_name: str = RESULTS_NAME,
    lock: bool = True,
) -> ScenarioRun:
    """Load the tokenizer and the engine, run the pending scenarios, close the engine. `on_frame`
    gets the run so far after each generated frame."""
    job = prepared.job
    decoders = []

    def take_refiner_share(tokenizer, options: dict) -> None:
        # The refiner loads (strictly, CPU time checked) before the engine, which leaves it room.
        from terra_cli.refiner.decoder import engine_refiner

        decoders.append(engine_refiner(job.refiner, [s.frames for s in prepared.file.scenarios], tokenizer, options))

    longest = max((s.frames for s in prepared.file.scenarios), default=None)
    loaded = load_job_engine(job, prepared.backend, prepared.device, prepared.needs_tokenizer, longest,
                             take_refiner_share if job.refiner is not None else (lambda tokenizer, options: None),
                             rollouts=len(pending_scenarios(prepared, only_ids)) if job.even_waves else None)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    frame_decoder = decoders[0] if decoders else None
    try:
        # Refining runs in the refiner stage's thread, beside token generation on the same device
        # (the stage moves the weights there); `--no-decode` then `terra refine` runs it as a second stage.
        on_ready(loaded.ready)
        return run_scenarios(prepared.file, job.out_dir, engine, tokenizer, decode=job.decode,
                             max_rollouts=loaded.ready.in_flight, skip_invalid=job.skip_invalid,
                             sampling=job.sampling,
                             on_progress=lambda run, total: on_frame(run), on_written=on_written,
                             only_ids=only_ids, results_name=results_name, overwrite=job.overwrite, lock=lock,
                             frame_decoder=frame_decoder, writers=job_writers(job, prepared.device),
                             videos_at_end=job.videos_at_end)
    finally:
        engine.close()


def pending_scenarios(prepared: PreparedJob, only_ids: set[str] | None = None) -> list:
    """The scenarios a run would generate (a resumed run skips what is done), known before the
    engine is loaded: `--max-rollouts even` sizes its waves by them, the progress bars their totals."""
    return [s for s in prepared.pending if only_ids is None or s.id in only_ids]
