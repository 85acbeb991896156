"""The results log of a scenario run and the one way a finished scenario is written.

`DIR/results.jsonl` holds one JSON line per scenario (id, status, seed, frames, seconds, paths, and a
digest of the line's content), appended, flushed and synced as each scenario is written: a scenario
counts as written once its line is there, which is what a re-run reads to resume. `save_finished`
writes one finished scenario's files atomically and then its line; a single engine's writer thread
(`runner`) and the Ray driver (`ray_runner`) both write through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Container

import numpy as np

from terra_cli.errors import OutputError
from terra_cli.pipeline.video import VIDEO_FPS
from terra_cli.scenarios.outdir import RESULTS_NAME, read_results, results_logs
from terra_cli.scenarios.spec import Scenario, ScenarioFile
from terra_cli.scenarios.writers import decode_frames


def completed_ids(out_dir: Path) -> set[str]:
    """Ids whose results line says done and whose files are all there (results.jsonl, and the logs
    of data-parallel workers that a crash kept from being folded in)."""
    out_dir = Path(out_dir)
    done: set[str] = set()
    for results in results_logs(out_dir):
        for record in read_results(results):
            if record.get("status") == "done" and all((out_dir / p).is_file() for p in record.get("paths", [])):
                done.add(str(record.get("id")))
    return done


class ResultsLog:
    """Appends one JSON line per scenario, flushed and synced, under a lock (writer thread + main).
    A failed append raises an OutputError naming the log."""

    def __init__(self, out_dir: Path, name: str = RESULTS_NAME):
        self.path = Path(out_dir) / name
        self.lock = threading.Lock()

    def add(self, record: dict) -> None:
        from terra_cli.media.atomic import describe_os_error

        line = json.dumps(record, sort_keys=True) + "\n"
        with self.lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise OutputError(describe_os_error(exc, self.path).replace("cannot write", "cannot append to", 1)) \
                    from exc


def log_skipped(file: ScenarioFile, log: ResultsLog) -> int:
    """Records each skipped line once: a resumed run does not append the same skips again."""
    known = {(r.get("line"), r.get("reason")) for r in read_results(log.path) if r.get("status") == "skipped"}
    for problem in file.problems:
        if (problem.line, problem.message) not in known:
            log.add({"id": problem.id, "line": problem.line, "status": "skipped", "reason": problem.message})
    return len(file.problems)


class NotRecorded(OutputError):
    """The results log could not be appended; the scenario's files were removed (a re-run makes them)."""

    def __init__(self, message: str, dropped: str):
        super().__init__(message)
        self.dropped = dropped


def save_finished(out_dir: Path, log: ResultsLog, scenario: Scenario, tokens: np.ndarray, seconds: float, *,
                  decoder=None, video: bytes | Exception | None = None, replaceable: bool | Container[str] = (),
                  extra: dict | None = None) -> dict:
    """Write one finished scenario (its files atomically, then its results line) and return the
    line: what a single-engine run's writer and the Ray driver both do with a finished scenario.
    `video`: the mp4 already encoded (by a Ray engine or a writer process), or why that failed.
    Raises NotRecorded if the log fails."""
    written: list[str] = []
    common = {"id": scenario.id, "seed": scenario.seed, "line": scenario.line, "digest": scenario.digest}
    try:
        paths = write_scenario(out_dir, scenario, tokens, decoder, overwrite=replaceable, written=written, video=video)
    except Exception as exc:  # one scenario's failed write must not stop the others
        record = {**common, "status": "failed", "reason": " ".join(str(exc).split()), "paths": written}
    else:
        record = {**common, "status": "done", "frames": int(tokens.shape[0]), "seconds": round(seconds, 2),
                  "paths": paths}
    record.update(extra or {})
    try:
        log.add(record)
    except OutputError as exc:
        _remove(out_dir, written)  # not recorded: a re-run makes them again
        dropped = f" ({scenario.id}'s files, written but not recorded, were removed)" if written else ""
        raise NotRecorded(str(exc), dropped) from exc
    return record


def _remove(out_dir: Path, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            (out_dir / name).unlink()


def write_scenario(out_dir: Path, scenario: Scenario, tokens: np.ndarray, tokenizer, *,
                   overwrite: bool | Container[str] = False, written: list[str] | None = None,
                   video: bytes | Exception | None = None) -> list[str]:
    """`{stem}.npy` (all frames' tokens) and, with a tokenizer or `video` bytes, `{stem}.mp4`; each
    atomic. An existing file is replaced only if `overwrite` is True or names it (`plan_outputs`
    says which); otherwise the write fails and nothing is replaced. `written` collects the names
    as they land. `video` an Exception: the video failed where it was made; it is raised after the
    tokens are written, as a decode failing here would be."""
    from terra_cli.media.atomic import atomic_path, atomic_save_npy
    from terra_cli.media.frames import write_video

    def may_replace(name: str) -> bool:
        return overwrite if isinstance(overwrite, bool) else name in overwrite

    written = [] if written is None else written
    stem = scenario.output_stem
    (out_dir / stem).parent.mkdir(parents=True, exist_ok=True)
    tokens_name = f"{stem}.npy"
    atomic_save_npy(out_dir / tokens_name, tokens.astype(np.int64), overwrite=may_replace(tokens_name))
    written.append(tokens_name)
    video_name = f"{stem}.mp4"
    if isinstance(video, Exception):
        raise video
    if video is not None:  # encoded elsewhere (a Ray engine, a writer process): placed as it is
        with atomic_path(out_dir / video_name, overwrite=may_replace(video_name)) as tmp, open(tmp, "wb") as f:
            f.write(video)
            f.flush()
            os.fsync(f.fileno())
        written.append(video_name)
        return [video_name, tokens_name]
    if tokenizer is None:
        return [tokens_name]
    write_video(out_dir / video_name, decode_frames(tokenizer, tokens, scenario.seed), fps=VIDEO_FPS,
                overwrite=may_replace(video_name))
    written.append(video_name)
    return [video_name, tokens_name]
