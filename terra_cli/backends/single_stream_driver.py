"""The single-stream decoder behind the one driver interface (backends/driver.py).

`SingleStreamDriver` runs one rollout at a time: a job's rounds (pipeline/rounds.py) go through
`SingleStreamDecoder.rollout` with the seed rule of terra_cli/seeds.py (frame f of the video, over
all rounds and `frame_offset`, drawn from `draw_seed(job seed, f)`), so plain decoding gives the
reference's codes for a seed. Jobs that arrive meanwhile wait in the feed (urgent ones, a
session's next frame, first). A cancelled job stops at its next frame's end.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from terra_cli.backends.driver import JobFeed, LoopTimes, admit, take_cancelled, timed_get


class _JobCancelled(Exception):
    pass


class SingleStreamDriver:
    """`max_in_flight` is accepted for the interface; the decoder holds one rollout's cache, so
    jobs run one after the other whatever it says."""

    def __init__(self, backend, max_in_flight: int = 1):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.backend = backend
        self.layout = backend.config.layout
        self.max_in_flight = max_in_flight
        self.loop = LoopTimes()

    def run(self, jobs, on_frame=None, on_done=None, on_cancelled=None, idle_wait: float = 0.05, on_start=None,
            on_error=None) -> None:
        feed = jobs if isinstance(jobs, JobFeed) else None
        pending = collections.deque(()) if feed is not None else collections.deque(jobs)
        clock = time.perf_counter
        began = self.loop.running_since = clock()
        try:
            while True:
                admitting, idle_before = clock(), self.loop.idle_s
                job = (pending.popleft() if pending else None) if feed is None else timed_get(feed, idle_wait, self.loop)
                admitted = job is not None and admit(self.layout, feed, job, on_cancelled, on_error, on_start)
                self.loop.admit_s += clock() - admitting - (self.loop.idle_s - idle_before)
                if admitted:
                    self._run_job(job, feed, on_frame, on_done, on_cancelled, on_error)
                elif job is None and (not pending if feed is None else feed.finished):
                    break
        finally:
            self.loop.run_s += clock() - began
            self.loop.running_since = None

    def _run_job(self, job, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        from terra_cli.pipeline.rounds import plan_rounds

        clock = time.perf_counter
        decoder = self.backend.decoder
        k, total = job.context.shape[0], job.total_frames
        frames = np.zeros((total, self.layout.image_tokens), dtype=np.int64)
        frames[:k] = job.context
        actions = np.asarray(job.actions[: total - 1], dtype=np.float32)
        handling = [0.0]

        def frame_done(index: int, tokens: np.ndarray) -> None:
            started = clock()
            frames[index] = tokens
            if take_cancelled(feed, job, on_cancelled):
                raise _JobCancelled
            if on_frame is not None:
                on_frame(job, index, frames[index])
            handling[0] += clock() - started

        started = clock()
        try:
            for rnd in plan_rounds(k, total, self.layout.max_frames):
                context = frames[rnd.first_frame: rnd.first_frame + rnd.context_frames]
                decoder.rollout(context, actions[rnd.first_frame: rnd.end - 1], rnd.num_frames, job.sampling,
                                job.sampling.seed, job.frame_offset + rnd.first_frame,
                                lambda local, tokens, _o=rnd.first_frame: frame_done(_o + local, tokens))
                self.loop.steps += decoder.stats["steps"]
        except _JobCancelled:
            return
        except Exception as exc:  # this job failed alone; the engine goes on
            if on_error is None:
                raise
            on_error(job, exc)
            return
        finally:
            self.loop.frames_s += handling[0]
            self.loop.step_s += clock() - started - handling[0]
        if on_done is not None:
            on_done(job, frames)
