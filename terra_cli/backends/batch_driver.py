"""The loop of drivers that run one batch of jobs to its end before they take the next (the
reference's lockstep batches, the single-stream decoder's one rollout): taking jobs from a list
or a `JobFeed`, admitting them, and counting idle and admission time, written once for both."""

from __future__ import annotations

import collections
import time

from terra_cli.backends import driver
from terra_cli.backends.driver import JobFeed, LoopTimes, RolloutJob, admit, timed_get



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
        feed = jobs if isinstance(jobs, JobFeed) else None
        pending = collections.deque(()) if feed is not None else collections.deque(jobs)

        def admitted(job) -> bool:
            return job is not None and admit(self.layout, feed, job, on_cancelled, on_error, on_start)

        def take_compatible(first):
            if feed is not None:
                return feed.take_if(lambda job: self.compatible(first, job))
            for index, job in enumerate(pending):
                if self.compatible(first, job):
                    del pending[index]
                    return job
            return None

        clock = time.perf_counter
        began = self.loop.running_since = clock()
        try:
            while True:
                admitting, idle_before = clock(), self.loop.idle_s
                first = (pending.popleft() if pending else None) if feed is None else timed_get(feed, idle_wait, self.loop)
                batch = [first] if admitted(first) else []
                while batch and len(batch) < self.batch_limit():
                    job = take_compatible(first)
                    if job is None:
                        break
                    if admitted(job):
                        batch.append(job)
                self.loop.admit_s += clock() - admitting - (self.loop.idle_s - idle_before)
                if batch:
                    self.loop.batches += 1
                    self.loop.batched_jobs += len(batch)
                    self._run_batch(batch, feed, on_frame, on_done, on_cancelled, on_error)
                elif first is None and (not pending if feed is None else feed.finished):
                    break
        finally:
            self.loop.run_s += clock() - began
            self.loop.running_since = None

    def _run_batch(self, batch: list[RolloutJob], feed: "JobFeed | None", on_frame, on_done, on_cancelled,
                   on_error) -> None:
        raise NotImplementedError
