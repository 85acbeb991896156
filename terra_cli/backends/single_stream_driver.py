"""The single-stream decoder behind the one driver interface (backends/driver.py).

`SingleStreamDriver` runs a job's rounds (pipeline/rounds.py) through `SingleStreamDecoder.rollout`
with the seed rule of terra_cli/seeds.py (frame f of the video, over all rounds and `frame_offset`,
drawn from `draw_seed(job seed, f)`), so plain decoding gives the reference's codes for a seed.
With `max_in_flight` above 1 and plain decoding, jobs that fit one round and sample alike (a
server's sessions' next frames) run as rows of one `row_batch.RowBatchDecoder` (at most
`row_batch.MAX_ROWS`): one decode step for all of them, each job the codes it gets alone. A job
joins the rows in progress at the end of their next few steps (`row_batch.JOIN_STEPS`) and leaves
its row when its last frame is done, so no session waits for another's frame or picture. A job
that cannot join (several rounds, other sampling) is taken next once the rows in progress are
done; none joins them meanwhile. A cancelled job stops at its next frame's end.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from terra_cli.backends.batch_driver import BatchAtATimeDriver, JobSource
from terra_cli.backends.driver import admit, take_cancelled


class _JobCancelled(Exception):
    pass


# A lone job runs on the single decoder (its graph is one rollout's), unless another session (job
# affinity) ran within the last RECENT_S: then it starts the rows, which that session's next frame joins.
# Generous: a session's next frame comes after its picture and the client's own work (a planner's).
RECENT_S = 30.0


class SingleStreamDriver(BatchAtATimeDriver):
    """One job at a time, or up to `max_in_flight` (at most the backend's `max_row_batch`) one-round jobs as
    rows in progress together when the backend decodes plainly (Jacobi drafts run one rollout at a time)."""

    def __init__(self, backend, max_in_flight: int = 1):
        super().__init__(backend, max_in_flight)
        self.recent: dict[str, float] = {}  # a session's affinity -> when its last job ran
        backend.warm_row_batch(self.batch_limit())

    def batch_limit(self) -> int:
        return min(self.max_in_flight, self.backend.max_row_batch) if self.backend.decoder.draft_tokens == 0 else 1

    def compatible(self, first, job) -> bool:
        """Jobs that sample alike and fit one round each (pipeline/rounds.py: at most the model's frames)."""
        return (first.sampling.same_rule(job.sampling)
                and max(first.total_frames, job.total_frames) <= self.layout.max_frames)

    def run(self, jobs, on_frame=None, on_done=None, on_cancelled=None, idle_wait: float = 0.05, on_start=None,
            on_error=None) -> None:
        if self.batch_limit() < 2:  # one job at a time: the base loop
            return super().run(jobs, on_frame, on_done, on_cancelled, idle_wait, on_start, on_error)
        source = JobSource(jobs, self.loop)
        feed = source.feed
        clock = time.perf_counter
        decoder, running, frames, tags = None, {}, {}, itertools.count()
        first_after = None  # a job that could not join the rows in progress: the next one taken

        def admitted(job) -> bool:
            return admit(self.layout, feed, job, on_cancelled, on_error, on_start)

        began = self.loop.running_since = clock()
        try:
            while True:
                admitting, idle_before = clock(), self.loop.idle_s
                joining = []
                if not running:
                    if first_after is not None:
                        first = source.take_if(lambda job: job.key == first_after)
                        first_after = None
                    else:
                        first = source.next(idle_wait)
                    if first is None:
                        if source.finished:
                            break
                        continue
                    if not admitted(first):
                        continue
                    if not self.compatible(first, first) or not self._rows_wanted(first, source.waiting()):
                        self.loop.admit_s += clock() - admitting - (self.loop.idle_s - idle_before)
                        self._run_batch([first], feed, on_frame, on_done, on_cancelled, on_error)
                        continue
                    joining.append(first)
                opener = joining[0] if joining else next(iter(running.values()))
                if first_after is None:
                    refused = next((job for job in source.waiting() if not self.compatible(opener, job)), None)
                    if refused is not None and running:
                        first_after = refused.key  # none joins until it has run
                    while first_after is None and len(running) + len(joining) < self.batch_limit():
                        job = source.take_if(lambda job: self.compatible(opener, job))
                        if job is None:
                            break
                        if admitted(job):
                            joining.append(job)
                # taking jobs in; their prompts and frame ends (`_join`) count as the engine's steps
                self.loop.admit_s += clock() - admitting - (self.loop.idle_s - idle_before)
                if joining:
                    decoder = decoder or self.backend.row_batch(self.batch_limit())
                    self._join(decoder, joining, running, frames, tags, on_error)
                if running:
                    self._advance(decoder, running, frames, feed, on_frame, on_done, on_cancelled, on_error)
        finally:
            self.loop.run_s += clock() - began
            self.loop.running_since = None

    def _rows_wanted(self, job, waiting) -> bool:
        """Whether `job`, taken with no rows in progress, starts rows rather than running alone: another
        job waits that may join, or another session ran lately and will ask again."""
        now = time.perf_counter()
        self.recent = {key: ran for key, ran in self.recent.items() if now - ran < RECENT_S}
        return (any(self.compatible(job, other) for other in waiting)
                or any(key != job.affinity for key in self.recent))

    def _join(self, decoder, joining, running, frames, tags, on_error) -> None:
        from terra_cli.backends.row_batch import RowWork

        now = time.perf_counter()
        self.recent.update((job.affinity, now) for job in joining if job.affinity is not None)
        work = [(next(tags), RowWork(job.context, np.asarray(job.actions[: job.total_frames - 1], dtype=np.float32),
                                     job.total_frames, job.sampling.seed, job.frame_offset, job.affinity))
                for job in joining]
        started, steps_before = time.perf_counter(), decoder.steps
        try:
            rows = decoder.add(work, joining[0].sampling)
        except Exception as exc:  # these jobs failed; the rows in progress go on
            for tag, _ in work:
                decoder.drop(tag)
            if on_error is None:
                raise
            for job in joining:
                on_error(job, exc)
            return
        finally:
            self.loop.steps += decoder.steps - steps_before
            self.loop.step_s += time.perf_counter() - started
        self.loop.batches += 1
        self.loop.batched_jobs += len(joining)
        for (tag, _), job, row in zip(work, joining, rows):
            running[tag], frames[tag] = job, decoder.live[row].out

    def _advance(self, decoder, running, frames, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        clock = time.perf_counter
        started, steps_before = clock(), decoder.steps
        try:
            done = decoder.advance()
        except Exception as exc:  # the rollouts in progress failed; the engine goes on
            decoder.drop_all()
            failed = list(running.values())
            running.clear()
            frames.clear()
            if on_error is None:
                raise
            for job in failed:
                on_error(job, exc)
            return
        finally:
            self.loop.steps += decoder.steps - steps_before
            self.loop.step_s += clock() - started
        handling = clock()
        for tag, index, tokens, last in done:
            job = running[tag]
            if take_cancelled(feed, job, on_cancelled):
                decoder.drop(tag)
                running.pop(tag), frames.pop(tag)
                continue
            if on_frame is not None:
                on_frame(job, index, tokens)
            if last:
                running.pop(tag)
                if on_done is not None:
                    on_done(job, frames.pop(tag))
        self.loop.frames_s += clock() - handling

    def _run_batch(self, batch, feed, on_frame, on_done, on_cancelled, on_error) -> None:
        now = time.perf_counter()
        self.recent.update((job.affinity, now) for job in batch if job.affinity is not None)
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
