"""Video jobs (`/v1/videos`): a scenario line in, an mp4 (and tokens) out.

A job's context is encoded on the media thread, its tokens generated on the engine, and the
finished video decoded and written (atomically) under the server's work folder. Finished jobs
are kept until `keep_finished` newer ones have finished, then their files are deleted.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from terra_cli.backends.driver import RolloutJob
from terra_cli.server.engine import EngineService, Handlers
from terra_cli.server.requests import VideoSpec

ACTIVE = ("queued", "encoding", "running", "writing")


@dataclass
class VideoJob:
    id: str
    spec: VideoSpec
    status: str = "queued"
    frames_done: int = 0
    error: str | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
    video: Path | None = None
    tokens: Path | None = None
    generation_started: float | None = None
    generation_seconds: float | None = None  # engine time only, as a local run reports it
    done_event: threading.Event = field(default_factory=threading.Event)

    @property
    def generated(self) -> int:
        return self.spec.frames - self.spec.context.count

    def public(self) -> dict:
        return {"id": self.id, "label": self.spec.label, "status": self.status, "frames": self.spec.frames,
                "context_frames": self.spec.context.count, "generated_frames": self.frames_done,
                "progress": round(self.frames_done / max(self.generated, 1), 4), "error": self.error,
                "seed": self.spec.sampling.seed, "tokens": self.tokens is not None, "created": self.created, "finished": self.finished,
                "seconds": None if self.finished is None else round(self.finished - self.created, 3),
                "generation_seconds": None if self.generation_seconds is None else round(self.generation_seconds, 3)}


class QueueFull(Exception):
    pass


class VideoJobs:
    def __init__(self, engine: EngineService, workdir: Path, *, max_queued: int, keep_finished: int = 256):
        self.engine, self.workdir = engine, Path(workdir)
        self.max_queued, self.keep_finished = max_queued, keep_finished
        self.jobs: dict[str, VideoJob] = {}
        self.finished_order: collections.deque[str] = collections.deque()
        self.lock = threading.Lock()
        # Held while a job passes from encoding to the engine and while a cancel decides what to do: a
        # cancel between the two would find a running job that the engine does not know yet, and be lost.
        self.hand_over = threading.Lock()

    def active(self) -> int:
        with self.lock:
            return sum(1 for j in self.jobs.values() if j.status in ACTIVE)

    def create(self, spec: VideoSpec) -> VideoJob:
        with self.lock:
            if sum(1 for j in self.jobs.values() if j.status in ACTIVE) >= self.max_queued:
                raise QueueFull(f"{self.max_queued} video jobs are queued or running, this server's cap")
            job = VideoJob(f"v-{secrets.token_hex(8)}", spec)
            self.jobs[job.id] = job
        self.engine.media.submit(self._encode_and_submit, job)
        return job

    def get(self, job_id: str) -> VideoJob | None:
        with self.lock:
            return self.jobs.get(job_id)

    def cancel(self, job_id: str) -> VideoJob | None:
        job = self.get(job_id)
        if job is None:
            return None
        with self.hand_over:
            if job.status in ACTIVE:
                if job.status in ("queued", "encoding"):
                    self._end(job, "cancelled")  # the media thread sees it and does not submit
                self.engine.cancel(job.id)
        return job

    def cancel_all(self) -> None:
        for job_id in list(self.jobs):
            self.cancel(job_id)

    # -- work -------------------------------------------------------------------------------

    def _encode_and_submit(self, job: VideoJob) -> None:
        if job.status != "queued":
            return
        spec = job.spec
        try:
            job.status = "encoding"
            context = spec.context
            if context.tokens is not None:
                tokens = context.tokens
                self._check_tokens(tokens)
            else:
                images = context.images
                if images is None:
                    from terra_cli.models.default import sample_context_frames

                    images = list(sample_context_frames(context.count))
                tokens = self.engine.encode(images)
            rollout = RolloutJob(job.id, tokens, spec.actions, spec.frames, spec.sampling)
            with self.hand_over:
                if job.status != "encoding":
                    return
                job.status = "running"
                job.generation_started = time.perf_counter()
                self.engine.submit(rollout, Handlers(
                    on_frame=lambda index, t: self._frame(job),
                    on_done=lambda all_tokens: self._generated(job, all_tokens),
                    on_cancelled=lambda: self._end(job, "cancelled"),
                    on_error=lambda exc: self._end(job, "failed", str(exc))))
        except Exception as exc:
            self._end(job, "failed", " ".join(str(exc).split()) or type(exc).__name__)

    def _check_tokens(self, tokens: np.ndarray) -> None:
        layout = self.engine.layout
        if tokens.shape[1] != layout.image_tokens or tokens.min() < 0 or tokens.max() >= layout.image_vocab_size:
            raise ValueError(f"context.tokens must be codes in [0, {layout.image_vocab_size - 1}] of shape "
                             f"(frames, {layout.image_tokens})")

    def _generated(self, job: VideoJob, tokens: np.ndarray) -> None:
        job.generation_seconds = time.perf_counter() - job.generation_started
        self.engine.media.submit(self._write, job, tokens)

    def _frame(self, job: VideoJob) -> None:
        job.frames_done += 1

    def _write(self, job: VideoJob, tokens: np.ndarray) -> None:
        from terra_cli.media.atomic import atomic_save_npy
        from terra_cli.media.frames import write_video
        from terra_cli.pipeline.video import VIDEO_FPS

        if job.status != "running":
            return
        job.status = "writing"
        try:
            if job.spec.keep_tokens:
                job.tokens = self.workdir / f"{job.id}.npy"
                atomic_save_npy(job.tokens, tokens.astype(np.int64), overwrite=True)
            job.video = self.workdir / f"{job.id}.mp4"
            write_video(job.video, list(self.engine.decode(tokens)), fps=VIDEO_FPS, overwrite=True)
        except Exception as exc:
            self._end(job, "failed", f"writing the video failed: {exc}")
        else:
            self._end(job, "done")

    def _end(self, job: VideoJob, status: str, error: str | None = None) -> None:
        with self.lock:
            if job.status not in ACTIVE:
                return
            job.status, job.error, job.finished = status, error, time.time()
            self.finished_order.append(job.id)
            while len(self.finished_order) > self.keep_finished:
                old = self.jobs.pop(self.finished_order.popleft(), None)
                for path in (old.video, old.tokens) if old else ():
                    if path is not None:
                        path.unlink(missing_ok=True)
        job.done_event.set()
