"""The loop of drivers that run one batch of jobs to its end before they take the next (the
reference's lockstep batches, the single-stream decoder's one rollout): taking jobs from a list
or a `JobFeed`, admitting them, and counting idle and admission time, written once for both."""

from __future__ import annotations

import collections
import time

from terra_cli.backends import driver
from terra_cli.backends.driver import JobFeed, LoopTimes, RolloutJob, admit, timed_get


class JobSource:
    """A driver's jobs, from a `JobFeed` (they arrive while it runs) or a list (all there at the start)."""

    def __init__(self, jobs, loop: LoopTimes):
        self.feed = jobs if isinstance(jobs, JobFeed) else None
        self.queue = collections.deque(jobs) if self.feed is None else None
        self.loop = loop

    def next(self, wait: float) -> RolloutJob | None:
        """The next job; from a feed, waiting up to `wait` s (counted as the loop's idle time)."""
        if self.feed is None:
            return self.queue.popleft() if self.queue else None
        return timed_get(self.feed, wait, self.loop)

    def take_if(self, accept) -> RolloutJob | None:
        """The first waiting job that `accept`s, without waiting."""
        if self.feed is not None:
            return self.feed.take_if(accept)
        for index, job in enumerate(self.queue):
            if accept(job):
                del self.queue[index]
                return job
        return None

    def waiting(self) -> list[RolloutJob]:
        return self.feed.waiting() if self.feed is not None else list(self.queue)

    @property
    def finished(self) -> bool:
        return self.feed.finished if self.feed is not None else not self.queue


class BatchAtATimeDriver:
    """A driver that runs one batch of jobs to its end before it takes the next: the reference's
    lockstep batches of compatible jobs (`hf.ReferenceDriver`) and the single-stream decoder's one
    rollout at a time (`single_stream_driver.SingleStreamDriver`). The loop is this class's: taking
    jobs from a list or a feed, admitting them (`admit`), and counting idle and admission time;
    a subclass runs a batch (`_run_batch`) and may bound it (`batch_limit`)."""

    def __init__(self, backend, max_in_flight: int = 1):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.backend = backend
        self.layout = backend.config.layout
        self.max_in_flight = max_in_flight
        self.loop = LoopTimes()

    def batch_limit(self) -> int:
        """Jobs a batch takes at most."""
        return self.max_in_flight

    def compatible(self, first: RolloutJob, job: RolloutJob) -> bool:
        """Whether `job` may join the batch `first` opened (the reference's lockstep: `driver.compatible`)."""
        return driver.compatible(first, job)

    def run(self, jobs, on_frame=None, on_done=None, on_cancelled=None, idle_wait: float = 0.05, on_start=None,
            on_error=None) -> None:
        source = JobSource(jobs, self.loop)
        feed = source.feed

        def admitted(job) -> bool:
            return job is not None and admit(self.layout, feed, job, on_cancelled, on_error, on_start)

        clock = time.perf_counter
        began = self.loop.running_since = clock()
        try:
            while True:
                admitting, idle_before = clock(), self.loop.idle_s
                first = source.next(idle_wait)
                batch = [first] if admitted(first) else []
                while batch and len(batch) < self.batch_limit():
                    job = source.take_if(lambda job: self.compatible(first, job))
                    if job is None:
                        break
                    if admitted(job):
                        batch.append(job)
                self.loop.admit_s += clock() - admitting - (self.loop.idle_s - idle_before)
                if batch:
                    self.loop.batches += 1
                    self.loop.batched_jobs += len(batch)
                    self._run_batch(batch, feed, on_frame, on_done, on_cancelled, on_error)
                elif first is None and source.finished:
                    break
        finally:
            self.loop.run_s += clock() - began
            self.loop.running_since = None

    def _run_batch(self, batch: list[RolloutJob], feed: "JobFeed | None", on_frame, on_done, on_cancelled,
                   on_error) -> None:
        raise NotImplementedError
