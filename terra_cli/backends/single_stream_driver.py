"""The single-stream decoder behind the one driver interface (backends/driver.py).

`SingleStreamDriver` runs one rollout at a time: a job's rounds (pipeline/rounds.py) go through
`SingleStreamDecoder.rollout` with the seed rule of terra_cli/seeds.py (frame f of the video, over
all rounds and `frame_offset`, drawn from `draw_seed(job seed, f)`), so plain decoding gives the
reference's codes for a seed. Jobs that arrive meanwhile wait in the feed (urgent ones, a
session's next frame, first). A cancelled job stops at its next frame's end.
"""

from __future__ import annotations

import time

import numpy as np

from terra_cli.backends.batch_driver import BatchAtATimeDriver
from terra_cli.backends.driver import take_cancelled


class _JobCancelled(Exception):
    pass


class SingleStreamDriver(BatchAtATimeDriver):
    """`max_in_flight` is accepted for the interface; the decoder holds one rollout's cache, so
    jobs run one after the other whatever it says."""

    def batch_limit(self) -> int:
        return 1

    def _run_batch(self, batch, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        self._run_job(batch[0], feed, on_frame, on_done, on_cancelled, on_error)

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
