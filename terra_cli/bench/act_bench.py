"""`terra bench --act-bench N`: an ACT-Bench-shaped run end to end, the time a user will see.

N samples in ACT-Bench's own JSONL format (sample_id, context_frames image paths relative to an
image root, instruction_trajs of 60 points per frame) are written under a temporary folder, with
random smooth JPEG context images of nuScenes' CAM_FRONT size (1600x900, resized by the reader as
real ones are) and preset trajectories at 10-50 km/h. They then go through `terra generate
--scenarios`' own code (`scenarios.job.prepare_job` + `run_scenario_job`): images read and
encoded, continuous batching, 47 frames in two rounds (the second re-seeded with the first's last
three frames), every video decoded and written as mp4 with its tokens and a `results.jsonl` line.

Reported: wall seconds per sample and generated frames/s, the phases (engine start-up, admission
to first frame, generating, draining the writer: the videos still being made after the last
frame, by the writer processes or thread), and two projections for ACT-Bench's 2,286 samples:
start-up once plus the measured steady time per sample, and `pipelined_projection_s`, where
encoding and writing run beside generation as they do once a run is longer than its batch.

With `--decoder refiner` (`ActBenchPlan.refiner`, a `refiner.decoder.RefinerChoice`) the videos are
Terra's video refiner's, made as `generate --scenarios --decoder refiner` makes them: each engine
loads the refiner before itself and refines its own videos in a thread beside generation
(`refiner.stage`). Then also reported: refined videos/s after start-up, the refiner thread's busy
seconds per sample, the refiner's pace on the wall (`refiner_pace_s`: from each engine's first UNet
batch to its last video, so a compile's wait is left out; what the pipelined projection uses), and per
engine the refiner's compile (`plan.refiner`).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from terra_cli.bench.scenarios import ACT_BENCH_SAMPLES, PRESETS, TimedRun, uses_ray

NUSCENES_SIZE = (1600, 900)  # CAM_FRONT width x height
DISTINCT_IMAGE_SETS = 64  # samples beyond this reuse earlier images (their encoding costs the same)


@dataclass(frozen=True)
class ActBenchPlan:
    samples: int
    frames: int = 47  # ACT-Bench: 3 context + 44 generated
    context_frames: int = 3
    max_rollouts: int | None = None  # None: auto (backends.vllm_stream.auto_in_flight)
    backend: str = "vllm"
    device: str = "auto"
    dtype: str = "auto"
    temperature: float = 0.9
    seed: int = 0
    image_size: tuple[int, int] = NUSCENES_SIZE
    vllm_options: dict = field(default_factory=dict)
    writers: int | None = None  # video writer processes; None: the scenario job's default for the device
    data_parallel: int = 1  # engines, one per GPU
    ray: str | None = None  # run the engines as Ray actors: local, or a cluster's address (several engines: local)
    refiner: object = None  # refiner.decoder.RefinerChoice: --decoder refiner; None: the frame-wise decoder
    even_waves: bool = False  # --max-rollouts even (scenarios.job.even_waves)
    videos_at_end: bool = False  # --videos-at-end (scenarios.job.ScenarioJob.videos_at_end)


def pipelined_projection_s(phases: dict, samples: int, in_flight: int, target: int = ACT_BENCH_SAMPLES,
                           writer_s_per_sample: float | None = None) -> float:
    """Seconds for `target` samples when reading, encoding and writing run beside generation, as
    they do in a run longer than one batch: start-up and the first frame's wait once, then each
    sample at the slower of the engine's rate and the writer's, then the last batch's drain.

    The writer's pace: `writer_s_per_sample` as measured (seconds per video over the writer
    processes), else the drain after the last frame, which holds the videos of the last batch to
    finish: about min(samples, in_flight) of them. The measured projection
    (`projected_act_bench_hours`) instead counts every phase once per `samples`, which a run no
    larger than its batch makes too long: its samples finish together, so none of their videos
    were made while others generated."""
    generate = phases["generating"] / samples
    write = writer_s_per_sample if writer_s_per_sample is not None else \
        phases["drain_writer"] / max(1, min(samples, in_flight))
    return phases["startup"] + phases["ready_to_first_frame"] + target * max(generate, write) + phases["drain_writer"]


def write_act_bench_samples(folder: Path, plan: ActBenchPlan) -> tuple[Path, Path]:
    """ACT-Bench lines and their context images: returns (JSONL path, image root)."""
    from PIL import Image

    from terra_cli.actions import preset_trajs

    rng = np.random.default_rng(plan.seed)
    root = folder / "nuscenes"
    (root / "samples" / "CAM_FRONT").mkdir(parents=True, exist_ok=True)
    width, height = plan.image_size
    lines = []
    for i in range(plan.samples):
        names = []
        for k in range(plan.context_frames):
            name = f"samples/CAM_FRONT/bench_{i % DISTINCT_IMAGE_SETS:04d}_{k}.jpg"
            if i < DISTINCT_IMAGE_SETS:
                # Smooth colour fields: JPEG sizes like a photo's, not incompressible noise.
                coarse = rng.integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
                Image.fromarray(coarse).resize((width, height), Image.BILINEAR).save(root / name, quality=90)
            names.append(name)
        speed = float(rng.uniform(10, 50))
        trajs = preset_trajs(PRESETS[i % len(PRESETS)], plan.frames - 1, speed)
        lines.append({"sample_id": i, "context_frames": names,
                      "instruction_trajs": np.round(trajs, 4).tolist(), "seed": plan.seed + i})
    path = folder / "act_bench.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, root


def bench_tokenizer(checkpoint: Path, model: str | None, seed: int, log: Callable[[str], None] = print) -> str | None:
    """The image tokenizer for the run: the model's own (a Terra snapshot's), else the
    embedded one when its codes fit the model, else random weights of Terra's tokenizer for a
    Terra-size model (the work per image is the real one's)."""
    from terra_cli.errors import InputError
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.models.resolve import resolve_model
    from tokenizer_decoder import TERRA_TOKENIZER_CONFIG, TokenizerConfig

    own = resolve_model(model).tokenizer if model is not None else None
    if own is not None:  # named here: the run gets the snapshot's world-model folder, which alone has none
        return own.source if own.subfolder is None else f"{own.source}/{own.subfolder}"
    layout = load_config(checkpoint).layout
    embedded = TokenizerConfig.load(default_tokenizer_dir())
    if embedded.codebook_size == layout.image_vocab_size:
        return str(default_tokenizer_dir())
    if TERRA_TOKENIZER_CONFIG.codebook_size != layout.image_vocab_size:
        raise InputError(f"--act-bench: no image tokenizer with {layout.image_vocab_size} codes for --model {model}")
    from terra_cli.bench.cache import cached_folder, random_model_cache
    from tokenizer_decoder import ImageTokenizer

    target = cached_folder(
        random_model_cache() / f"random-terra-tokenizer-seed{seed}",
        lambda folder: ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=seed, device="cpu").save_pretrained(folder),
        log, "Terra's tokenizer config with random weights")
    return str(target)


def run_act_bench(checkpoint: Path, tokenizer: str | None, plan: ActBenchPlan, out_dir: Path | None = None,
                  log: Callable[[str], None] = print,
                  progress: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Write the samples, run them the way `terra generate --scenarios` does, time it. Everything
    stays in `out_dir` when given, else in a temporary folder that is removed.
    `progress(generated frames, all to generate)` as they come."""
    from terra_cli.errors import InputError
    from terra_cli.models.checkpoint import load_config
    from terra_cli.pipeline.rounds import plan_rounds
    from terra_cli.scenarios.job import ScenarioJob, prepare_job
    from terra_cli.backends.base import Sampling
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.runner import RESULTS_NAME, read_results
    from terra_cli.scenarios.spec import Defaults

    with tempfile.TemporaryDirectory(prefix="terra-bench-act-") as tmp:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        outputs = work / "outputs"
        if outputs.is_dir() and any(outputs.iterdir()):
            raise InputError(f"--keep-outputs {work} holds an earlier run's outputs/, which this run would resume "
                             "instead of measuring; name a new folder")
        work.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        path, image_root = write_act_bench_samples(work, plan)
        written_s = time.perf_counter() - started
        job = ScenarioJob(path, outputs, Defaults(frames=plan.frames, seed=plan.seed, image_root=image_root),
                          model=ModelSpec(str(checkpoint), tokenizer=tokenizer),
                          engine=Engine(plan.backend, plan.device, plan.dtype, options=dict(plan.vllm_options)),
                          sampling=Sampling(temperature=plan.temperature), max_rollouts=plan.max_rollouts,
                          even_waves=plan.even_waves, decode=True, writers=plan.writers, refiner=plan.refiner,
                          videos_at_end=plan.videos_at_end)
        prepared = prepare_job(job)
        first = prepared.file.scenarios[0]
        rounds = len(plan_rounds(first.context_frames, first.frames, load_config(checkpoint).layout.max_frames))
        timed = TimedRun(prepared, plan.data_parallel, plan.ray, log, progress)
        where = f" on {plan.data_parallel} engine(s) on Ray ({plan.ray or 'local'})" \
            if uses_ray(plan.data_parallel, plan.ray) else ""
        decoder_note = "" if plan.refiner is None else \
            f", refined by Terra's video refiner ({plan.refiner.options.batch_windows} window(s) per UNet call)"
        log(f"{plan.samples} ACT-Bench samples of {plan.frames} frames ({timed.total} frames to generate){where}, "
            f"KV cache {plan.vllm_options.get('kv_cache_dtype', 'auto')}{decoder_note}")
        run = timed.run()
        marks, end = timed.marks, timed.marks["end"]
        if run.errors or run.done != plan.samples:
            raise RuntimeError(f"ACT-Bench run incomplete: {run.done} of {plan.samples} done; {run.errors[:3]}")
        records = [r for r in read_results(outputs / RESULTS_NAME) if r.get("status") == "done"]
        videos = sorted(p.name for p in outputs.rglob("*.mp4"))
        steady = end - marks["ready"]
        startup = marks["ready"] - marks["start"]  # the first engine's: from then on, work is done
        engines = timed.engine_rows()
        stages = refiner_stages(timed.engine_loop, engines, uses_ray(plan.data_parallel, plan.ray))
        refined_count = sum(stage["refined_videos"] for stage in stages)
        refiner_s_per_sample = round(sum(stage["refiner_busy_s"] for stage in stages) / refined_count, 3) \
            if refined_count else None
        results = {
            "plan": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in plan.__dict__.items() if k != "refiner"},
                     "decoder": "frames" if plan.refiner is None else "refiner",
                     "refiner": None if plan.refiner is None else refiner_plan(plan.refiner, stages)},
            "tokenizer": tokenizer,
            "engine": engines[0],
            "engines": engines,
            "run": {
                "samples": plan.samples, "rounds_per_sample": rounds, "generated_frames": run.generated_frames,
                "videos_written": len(videos),
                "writers": run.writers,
                "writer_s_per_video": round(run.video_seconds / run.videos_made, 3) if run.videos_made else None,
                "frames_decoded_after_finish": run.frames_decoded_late,
                "results_lines_done": len(records),
                "seconds_wall": round(end - marks["start"], 2),
                "seconds_per_sample_wall": round((end - marks["start"]) / plan.samples, 3),
                "seconds_per_sample_steady": round(steady / plan.samples, 3),
                "generated_frames_per_s": round(run.generated_frames / max(steady, 1e-9), 3),
                # on the tokens-only bench's clock (`bench --scenarios`: from the first frame to the end), videos
                # included: the like-for-like rate; the one above also counts the first frame's wait after start-up
                "generated_frames_per_s_from_first_frame": round(
                    run.generated_frames / max(end - marks["first_frame"], 1e-9), 3),
                # --decoder refiner (None otherwise): videos written per second after start-up, and the
                # refiner thread's busy seconds per video summed over the engines that reported them
                "refined_videos_per_s": None if plan.refiner is None else round(len(videos) / max(steady, 1e-9), 4),
                "refiner_s_per_sample": refiner_s_per_sample,
                **timed.measures(),
                "phases_s": {
                    "write_samples": round(written_s, 2),
                    "startup": round(startup, 2),
                    "ready_to_first_frame": round(marks["first_frame"] - marks["ready"], 2),
                    "generating": round(marks["last_frame"] - marks["first_frame"], 2),
                    "drain_writer": round(end - marks["last_frame"], 2),
                },
                "projected_samples": ACT_BENCH_SAMPLES,
                "projected_act_bench_hours": round((startup + ACT_BENCH_SAMPLES * steady / plan.samples) / 3600, 3),
            },
        }
        in_flight = sum(e.get("in_flight") or 0 for e in engines) or plan.samples
        if plan.refiner is not None:
            # each engine's refiner makes its videos one UNet batch at a time: its pace is its wall from
            # the first batch to the last video (busy time where a stage has no wall yet); engines in parallel
            # (writer_s_per_video is a refined video's wait in the queue as well)
            pace = refiner_pace_s(stages)
            results["run"]["refiner_pace_s_per_sample"] = None if pace is None else round(pace, 3)
        else:
            per_video = results["run"]["writer_s_per_video"]  # None on Ray: the engines make the videos
            pace = per_video / max(1, run.writers) if per_video is not None else None
        results["run"]["projected_act_bench_hours_pipelined"] = round(pipelined_projection_s(
            results["run"]["phases_s"], plan.samples, in_flight, writer_s_per_sample=pace) / 3600, 3)
        if run.generated_frames != timed.total:
            raise RuntimeError(f"{run.generated_frames} frames written, {timed.total} expected")
    r = results["run"]
    rate = "" if r["refined_videos_per_s"] is None else f", {r['refined_videos_per_s']:.3f} refined videos/s"
    log(f"{r['seconds_per_sample_wall']:.2f} s/sample wall ({r['seconds_per_sample_steady']:.2f} after start-up), "
        f"{r['generated_frames_per_s']:.2f} generated frames/s{rate}, ACT-Bench projected "
        f"{r['projected_act_bench_hours']:.2f} h ({r['projected_act_bench_hours_pipelined']:.2f} h with encoding and "
        f"writing beside generation)")
    return results


def refiner_stages(engine_loop: dict | None, engines: list[dict], on_ray: bool) -> list[dict]:
    """The refiner stages' reports (`RefineStage.decode_stats`, in each engine's loop times): one
    engine's in this process, else each Ray engine's last (one that never reported has none)."""
    loops = [e.get("engine_loop") for e in engines] if on_ray else [engine_loop]
    return [loop for loop in loops if loop and loop.get("refined_videos") is not None]


def refiner_pace_s(stages: list[dict]) -> float | None:
    """Seconds a refined video with every engine's refiner at work: each stage makes its videos at its
    wall from its first UNet batch to its last video (`refiner_wall_s`), a compile's and the first
    videos' waits left out, or where it has none at its busy seconds; the engines add their rates."""
    rates = []
    for stage in stages:
        videos = stage.get("refined_videos") or 0
        seconds = stage.get("refiner_wall_s") or stage.get("refiner_busy_s")
        if videos and seconds:
            rates.append(videos / seconds)
    return 1.0 / sum(rates) if rates else None


def refiner_plan(choice, stages: list[dict]) -> dict:
    """`plan.refiner` of the results: the weights and options asked for, and per engine the compile
    mode it resolved to, the seconds its UNet and VAE decoder took to compile (0: eager), and the
    seconds of the child that compiled them first while the engine generated (None: none, or it failed)."""
    options = choice.options
    return {"weights": choice.spec, "windows_per_call": options.batch_windows, "compile": options.compile,
            "dtype": options.dtype, "compile_mode": sorted({stage["refiner_compile_mode"] for stage in stages}),
            "compile_s": [stage["refiner_compile_s"] for stage in stages],
            "vae_decoder_compile_s": [stage["refiner_vae_compile_s"] for stage in stages],
            "compiled_apart_s": [stage.get("refiner_compiled_apart_s") for stage in stages]}
