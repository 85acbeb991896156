"""`run_scenarios`: every scenario of a file through one engine, resumable, writing as it goes.

Generation goes through `backends.vllm_stream.StreamDriver` (continuous batching) on the vLLM
backend, or scenario by scenario through `pipeline.rounds.generate_tokens` on the reference.
Contexts are encoded in batches as scenarios are admitted; finished scenarios are decoded and
written by a background thread, so the engine keeps stepping while a video is encoded. Each
written scenario appends one line to `DIR/results.jsonl` (id, status, seed, frames, seconds,
paths); a re-run skips every id whose line says done and whose files exist.

`ScenarioJob` is the whole request as plain data: `prepare_job` validates it without a model,
`run_scenario_job` loads the engine and runs it, and `scenarios.parallel` hands the same job to
one worker process per GPU.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.errors import InputError
from terra_cli.scenarios.spec import Scenario, ScenarioFile, report

RESULTS_NAME = "results.jsonl"
SHARD_RESULTS_GLOB = "results.shard-*.jsonl"  # data-parallel workers' logs, folded into RESULTS_NAME
ENCODE_BATCH = 16  # scenarios whose contexts are encoded together
VIDEO_FPS = 10


@dataclass
class ScenarioRun:
    done: int = 0
    skipped: int = 0
    failed: int = 0
    resumed: int = 0
    generated_frames: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def completed_ids(out_dir: Path) -> set[str]:
    """Ids whose results line says done and whose files are all there (results.jsonl, and the logs
    of data-parallel workers that a crash kept from being folded in)."""
    out_dir = Path(out_dir)
    done: set[str] = set()
    for results in [out_dir / RESULTS_NAME, *sorted(out_dir.glob(SHARD_RESULTS_GLOB))]:
        for record in read_results(results):
            if record.get("status") == "done" and all((out_dir / p).is_file() for p in record.get("paths", [])):
                done.add(str(record.get("id")))
    return done


def read_results(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: that scenario runs again
        if isinstance(record, dict):
            records.append(record)
    return records


class ResultsLog:
    """Appends one JSON line per scenario, flushed and synced, under a lock (writer thread + main)."""

    def __init__(self, out_dir: Path, name: str = RESULTS_NAME):
        self.path = Path(out_dir) / name
        self.lock = threading.Lock()

    def add(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def check_scenarios(file: ScenarioFile, skip_invalid: bool) -> None:
    if file.problems and not skip_invalid:
        raise InputError(report(file.problems, file.path).replace("\n  ", " ").replace(") line", "); line") +
                         " (fix them, or pass --skip-invalid to skip those lines)")


def run_scenarios(
    file: ScenarioFile,
    out_dir: Path,
    backend,
    tokenizer,
    *,
    max_rollouts: int,
    skip_invalid: bool = False,
    temperature: float = 0.9,
    top_k: int = 0,
    top_p: float = 1.0,
    on_progress: Callable[[ScenarioRun, int], None] = lambda run, total: None,
    on_written: Callable[[dict], None] = lambda record: None,
    only_ids: set[str] | None = None,
    results_name: str = RESULTS_NAME,
    decode: bool = True,
    frame_decoder=None,
) -> ScenarioRun:
    """Generate and write every pending scenario (of `only_ids`, when given: a data-parallel
    worker's share, whose skipped lines the parent records). KeyboardInterrupt stops generation;
    scenarios already finished are still written before it propagates."""
    check_scenarios(file, skip_invalid)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = ResultsLog(out_dir, results_name)
    run = ScenarioRun()
    if only_ids is None:
        run.skipped = log_skipped(file, log)
    finished_before = completed_ids(out_dir)
    mine = file.scenarios if only_ids is None else [s for s in file.scenarios if s.id in only_ids]
    pending = [s for s in mine if s.id not in finished_before]
    run.resumed = len(mine) - len(pending)
    by_key = {s.id: s for s in pending}
    started = {s.id: 0.0 for s in pending}
    # frame_decoder: Terra's video refiner (refiner.decoder.RefinerDecoder); default: the tokenizer, frame by frame
    writer = _Writer(out_dir, (frame_decoder or tokenizer) if decode else None, log, run, on_written)
    clock = time.perf_counter()

    def sampling(s: Scenario) -> Sampling:
        return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s.seed)

    def finished(key: str, tokens: np.ndarray) -> None:
        s = by_key[key]
        writer.put(s, tokens, time.perf_counter() - started[key])
        run.generated_frames += s.frames - s.context_frames

    try:
        if getattr(backend, "name", "") == "vllm":
            from terra_cli.backends.vllm_stream import RolloutJob, StreamDriver

            def jobs() -> Iterator[RolloutJob]:
                for s, context in _encoded(pending, tokenizer):
                    started[s.id] = time.perf_counter()
                    yield RolloutJob(s.id, context, s.actions, s.frames, sampling(s))

            StreamDriver(backend, max_rollouts).run(
                jobs(), on_frame=lambda job, i, t: on_progress(run, len(pending)),
                on_done=lambda job, tokens: finished(job.key, tokens.copy()))
        else:
            from terra_cli.pipeline.rounds import generate_tokens

            for s, context in _encoded(pending, tokenizer):
                started[s.id] = time.perf_counter()
                tokens = generate_tokens(backend, context, s.actions, s.frames, sampling(s),
                                         on_frame=lambda i, t: on_progress(run, len(pending)))[0]
                finished(s.id, tokens)
    finally:
        writer.close()
        run.seconds = time.perf_counter() - clock
    return run


def log_skipped(file: ScenarioFile, log: ResultsLog) -> int:
    for problem in file.problems:
        log.add({"id": None, "line": problem.line, "status": "skipped", "reason": problem.message})
    return len(file.problems)


def _encoded(scenarios: list[Scenario], tokenizer) -> Iterator[tuple[Scenario, np.ndarray]]:
    """(scenario, context tokens (K, T)) in order; image contexts encoded ENCODE_BATCH scenarios at a time."""
    from terra_cli.pipeline.inputs import load_context_tokens, read_context_frames

    for start in range(0, len(scenarios), ENCODE_BATCH):
        chunk = scenarios[start : start + ENCODE_BATCH]
        images, owners = [], []
        for s in chunk:
            if s.context_tokens is None:
                frames = read_context_frames(list(s.context_images), s.context_frames) if s.context_images \
                    else _sample_road(s.context_frames)
                images.extend(frames)
                owners.append((s, len(frames)))
        encoded = iter(tokenizer.tokenize(images)) if images else iter(())
        contexts = {}
        for s, count in owners:
            contexts[s.id] = np.stack([next(encoded) for _ in range(count)])
        for s in chunk:
            if s.context_tokens is not None:
                yield s, load_context_tokens(s.context_tokens, s.context_frames)
            else:
                yield s, contexts[s.id]


def _sample_road(count: int) -> list[np.ndarray]:
    from terra_cli.models.default import sample_context_frames

    return list(sample_context_frames(count))


class _Writer:
    """A background thread that decodes and writes finished scenarios (bounded queue)."""

    def __init__(self, out_dir: Path, tokenizer, log: ResultsLog, run: ScenarioRun, on_written: Callable[[dict], None]):
        self.out_dir, self.tokenizer, self.log, self.run = out_dir, tokenizer, log, run
        self.on_written = on_written
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.thread = threading.Thread(target=self._work, name="terra-scenario-writer", daemon=True)
        self.thread.start()

    def put(self, scenario: Scenario, tokens: np.ndarray, seconds: float) -> None:
        self.queue.put((scenario, tokens, seconds))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            scenario, tokens, seconds = item
            try:
                paths = write_scenario(self.out_dir, scenario, tokens, self.tokenizer)
            except Exception as exc:  # one scenario's failed write must not stop the others
                self.run.failed += 1
                self.run.errors.append(f"{scenario.id}: {exc}")
                record = {"id": scenario.id, "status": "failed", "reason": str(exc), "seed": scenario.seed}
            else:
                self.run.done += 1
                record = {"id": scenario.id, "status": "done", "seed": scenario.seed, "frames": int(tokens.shape[0]),
                          "seconds": round(seconds, 2), "paths": paths, "line": scenario.line}
            self.log.add(record)
            self.on_written(record)


def write_scenario(out_dir: Path, scenario: Scenario, tokens: np.ndarray, tokenizer) -> list[str]:
    """`{stem}.npy` (all frames' tokens) and, with a tokenizer, `{stem}.mp4`; each atomic. A re-run
    replaces files of a scenario that was not recorded as done."""
    from terra_cli.media.atomic import atomic_save_npy
    from terra_cli.media.frames import write_video

    stem = scenario.output_stem
    (out_dir / stem).parent.mkdir(parents=True, exist_ok=True)
    names = [f"{stem}.npy"]
    atomic_save_npy(out_dir / names[0], tokens.astype(np.int64), overwrite=True)
    if tokenizer is not None:
        names.insert(0, f"{stem}.mp4")
        seeded = {"seed": scenario.seed} if getattr(tokenizer, "seeded", False) else {}  # the refiner samples noise
        write_video(out_dir / names[0], list(tokenizer.decode_tokens(tokens, **seeded)), fps=VIDEO_FPS, overwrite=True)
    return names
