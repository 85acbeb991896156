"""The single-stream decoder behind the one driver interface (backends/driver.py).

`SingleStreamDriver` runs a job's rounds (pipeline/rounds.py) through `SingleStreamDecoder.rollout`
with the seed rule of terra_cli/seeds.py (frame f of the video, over all rounds and `frame_offset`,
drawn from `draw_seed(job seed, f)`), so plain decoding gives the reference's codes for a seed.
With `max_in_flight` above 1 and plain decoding, jobs waiting together that fit one round and
sample alike (a server's sessions' next frames) run as one batch (`row_batch.RowBatchDecoder`, at
most `row_batch.MAX_ROWS`): one decode step for all of them, each job the codes it gets alone.
Jobs that arrive meanwhile wait in the feed (urgent ones, a session's next frame, first). A
cancelled job stops at its next frame's end.
"""

from __future__ import annotations

import time

import numpy as np

from terra_cli.backends.batch_driver import BatchAtATimeDriver
from terra_cli.backends.driver import take_cancelled


class _JobCancelled(Exception):
    pass


# Sessions ask for their next frames a few milliseconds after their last one is answered. Taking only
# what is there, the first to ask would start a batch alone and the rest would wait a whole frame for
# the next one: the sessions would run in batches out of step, or one at a time. So a batch waits for a
# job from every session (job affinity) that ran within the last RECENT_S, as long as they keep coming
# at most GATHER_S apart and up to GATHER_MAX_S in all; a lone session never waits. The server answers a
# batch's sessions as their pictures are decoded, a few at a time and ~10-30 ms each on an H200: with a
# fixed 50 ms window 32 sessions ran in batches of a few and got 0.24 frames/s each where the batch alone
# makes 0.67 (2026-11-29, lease 9); waiting through 50 ms gaps for up to 0.5 s, in batches of 15 and 0.30
# (lease 10): the picture calls came farther apart than that.
GATHER_S = 0.3
GATHER_MAX_S = 1.0
RECENT_S = 5.0


class SingleStreamDriver(BatchAtATimeDriver):
    """One job at a time, or up to `max_in_flight` (at most the backend's `max_row_batch`) one-round jobs as a
    row batch when the backend decodes plainly (Jacobi drafts run one rollout at a time)."""

    def __init__(self, backend, max_in_flight: int = 1):
        super().__init__(backend, max_in_flight)
        self.recent: dict[str, float] = {}  # a session's affinity -> when its last job ran
        self.warm_up_s = backend.warm_row_batch(self.batch_limit())

    def gather(self) -> tuple[float, int]:
        now = time.perf_counter()
        self.recent = {key: ran for key, ran in self.recent.items() if now - ran < RECENT_S}
        wanted = min(len(self.recent), self.batch_limit())
        return (GATHER_S, wanted, GATHER_MAX_S) if wanted > 1 else (0.0, 0, 0.0)

    def batch_limit(self) -> int:
        return min(self.max_in_flight, self.backend.max_row_batch) if self.backend.decoder.draft_tokens == 0 else 1

    def compatible(self, first, job) -> bool:
        """Jobs that sample alike and fit one round each (pipeline/rounds.py: at most the model's frames)."""
        from dataclasses import replace

        return (replace(first.sampling, seed=0) == replace(job.sampling, seed=0)
                and max(first.total_frames, job.total_frames) <= self.layout.max_frames)

    def _run_batch(self, batch, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        now = time.perf_counter()
        self.recent.update((job.affinity, now) for job in batch if job.affinity is not None)
        if len(batch) == 1:
            self._run_job(batch[0], feed, on_frame, on_done, on_cancelled, on_error)
        else:
            self._run_rows(batch, feed, on_frame, on_done, on_cancelled, on_error)

    def _run_rows(self, batch, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        from terra_cli.backends.row_batch import RowWork

        clock = time.perf_counter
        decoder = self.backend.row_batch(self.batch_limit())
        work = [RowWork(job.context, np.asarray(job.actions[: job.total_frames - 1], dtype=np.float32),
                        job.total_frames, job.sampling.seed, job.frame_offset) for job in batch]
        handling, ended = [0.0], set()
        steps_before = decoder.steps

        def frame_done(row: int, index: int, tokens: np.ndarray) -> bool:
            started = clock()
            try:
                if take_cancelled(feed, batch[row], on_cancelled):
                    ended.add(row)
                    return False
                if on_frame is not None:
                    on_frame(batch[row], index, tokens)
                return True
            finally:
                handling[0] += clock() - started

        def row_done(row: int, frames: np.ndarray) -> None:
            started = clock()
            ended.add(row)
            if on_done is not None:
                on_done(batch[row], frames)
            handling[0] += clock() - started

        started = clock()
        try:
            decoder.rollouts(work, batch[0].sampling, frame_done, row_done)
        except Exception as exc:  # these jobs failed; the engine goes on
            if on_error is None:
                raise
            for row, job in enumerate(batch):
                if row not in ended:
                    on_error(job, exc)
        finally:
            self.loop.steps += decoder.steps - steps_before
            self.loop.frames_s += handling[0]
            self.loop.step_s += clock() - started - handling[0]

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
