"""The one driver interface: how every front-end runs the world model, whatever the backend.

A front-end (one video, a scenario file, a Ray engine actor, the server, the simulator) turns its
work into `RolloutJob`s, puts them into a `JobFeed` (or passes a list), and calls
`backend.driver(max_in_flight).run(jobs, on_frame=..., on_done=...)`. The driver reports each
generated frame, each finished job, each cancelled one and each job that failed alone; nothing
outside `backends/` knows which backend is behind it.

- vLLM: `vllm_stream.StreamDriver`, continuous batching (every rollout at its own frame);
- the reference: `hf.ReferenceDriver`, a batch of compatible jobs at a time in lockstep;
- the single-stream decoder: `single_stream_driver.SingleStreamDriver`, one rollout at a time
  (both of the latter on `batch_driver.BatchAtATimeDriver`'s loop).

Both plan a job's rounds with `pipeline.rounds.plan_rounds` and draw frame f of a job with the
seed rule of `terra_cli.seeds` (f counted from the video's first frame: `job.frame_offset`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import numpy as np

from terra_cli.backends.base import Sampling

HOLD_POLL_SECONDS = 0.05  # how often an idle driver looks again at a feed that holds its jobs back


@dataclass(frozen=True)
class RolloutJob:
    """One rollout's tokens to generate: context (K, T) int64, actions (>= total_frames - 1, 6, 3)
    indexed from the job's first context frame, `sampling.seed` the rollout's own seed."""

    key: str
    context: np.ndarray
    actions: np.ndarray
    total_frames: int  # context included
    sampling: Sampling
    # Jobs with the same affinity (a server session's steps) get the slot the last one had when it
    # is free, so their prompts keep their salt and hit the prefix cache.
    affinity: str | None = None
    # Where the job's first context frame sits in the video it continues (a session's step, an
    # environment's next frame): draws follow the video's frame numbers, so continuing a video
    # job by job draws what one job for the whole video draws. Rounds are planned from the job's
    # own first frame, so such a job starts on a round boundary (pipeline/rounds.py).
    frame_offset: int = 0
    # A fork's branch: the affinity of the rollout whose history this job's begins with (its
    # parent). On vLLM the job's prompt borrows that rollout's cache salt and action ids for the
    # rows both hold alike, so the shared prefix is served from the parent's cached blocks.
    prefix_of: str | None = None


# on_start(job) as the engine takes it; on_frame(job, frame index within the job, tokens (T,));
# on_done(job, all its tokens (total_frames, T)); on_cancelled(job); on_error(job, exception):
# this job failed alone and the engine goes on (without on_error the driver raises it).
JobStarted = Callable[[RolloutJob], None]
FrameDone = Callable[[RolloutJob, int, np.ndarray], None]
JobDone = Callable[[RolloutJob, np.ndarray], None]
JobCancelled = Callable[[RolloutJob], None]
JobFailed = Callable[[RolloutJob, BaseException], None]


class JobFeed:
    """Jobs that arrive while a driver runs (a server's requests, a Ray actor's share, the encode-
    ahead thread of a scenario run).

    `put` and `cancel` may be called from any thread; `close` says no more will come, and the
    driver returns once everything put before it is done or cancelled. A driver with nothing in
    flight waits on the feed instead of spinning; with rollouts in flight it never waits, so new
    work joins the running batch at the next engine step. `urgent` jobs (a session's next frame)
    are taken before the others.
    """

    def __init__(self, capacity: int | None = None, hold: Callable[[], bool] | None = None) -> None:
        # hold: while it returns True, `get` gives no job (the consumer is not to take more now,
        # such as a run whose video writer is behind); it may raise, to end the run.
        self._hold = hold
        self._jobs: collections.deque[RolloutJob] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._capacity = capacity  # jobs waiting at most; put() blocks beyond it (None: no bound)
        self._cancelled: set[str] = set()
        self._closed = False
        # How long `hold` kept jobs back from a consumer that asked for one (it asks only with a free
        # slot): slots the engine could have filled, the price of a writer that fell behind
        self._held_s, self._held_since = 0.0, None

    def held_seconds(self) -> float:
        """Seconds `get` found the feed held so far, the hold still in progress included."""
        since = self._held_since
        return self._held_s + (time.perf_counter() - since if since is not None else 0.0)

    def put(self, job: RolloutJob, *, urgent: bool = False) -> None:
        """Add a job; with a capacity, wait while that many are waiting. Raises RuntimeError once
        the feed is closed, also while waiting."""
        with self._changed:
            if self._capacity is not None and not urgent:
                self._changed.wait_for(lambda: self._closed or len(self._jobs) < self._capacity)
            if self._closed:
                raise RuntimeError("this JobFeed is closed")
            self._jobs.appendleft(job) if urgent else self._jobs.append(job)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()  # wakes a waiting driver and a producer waiting for room

    def cancel(self, key: str) -> None:
        """Drop the job `key` whether it is queued or in flight (on_cancelled is called for it)."""
        with self._changed:
            self._cancelled.add(key)
            self._changed.notify_all()

    def cancelled(self) -> set[str]:
        with self._lock:
            return set(self._cancelled)

    def forget(self, key: str) -> None:
        with self._lock:
            self._cancelled.discard(key)

    def get(self, wait: float) -> RolloutJob | None:
        """The next job, waiting up to `wait` seconds; None when there is none now, the feed holds
        its jobs back, or a cancellation arrived while waiting (the driver looks at it first)."""
        if self._hold is not None:
            held, now = self._hold(), time.perf_counter()
            keeping_back = held and bool(self._jobs)  # (a hold with nothing waiting costs no slot)
            if keeping_back and self._held_since is None:
                self._held_since = now
            elif not keeping_back and self._held_since is not None:
                self._held_s += now - self._held_since
                self._held_since = None
            if held:
                time.sleep(min(wait, HOLD_POLL_SECONDS))
                return None
        with self._changed:
            if not self._jobs and wait > 0 and not self._closed:
                cancelled = len(self._cancelled)
                self._changed.wait_for(lambda: self._jobs or self._closed or len(self._cancelled) != cancelled,
                                       timeout=wait)
            if not self._jobs:
                return None
            job = self._jobs.popleft()
            self._changed.notify_all()  # a producer waiting for room
            return job

    def take_if(self, accept: Callable[[RolloutJob], bool]) -> RolloutJob | None:
        """The first waiting job that `accept`s (a batch's next compatible job), without waiting."""
        with self._changed:
            for index, job in enumerate(self._jobs):
                if accept(job):
                    del self._jobs[index]
                    self._changed.notify_all()
                    return job
        return None

    def waiting(self) -> list[RolloutJob]:
        """The jobs waiting now, in the order `get` would give them (a copy)."""
        with self._lock:
            return list(self._jobs)

    @property
    def finished(self) -> bool:
        """Closed, and every job put before closing has been taken."""
        with self._lock:
            return self._closed and not self._jobs


@dataclass
class LoopTimes:
    """Where a driver's thread spent a run's wall time: inside the engine's step (vLLM's
    `engine.step()`, or the reference's token loop), taking in new jobs (whatever the job source
    does to make one), handling finished frames (callbacks, the next frame's request), and idle:
    waiting on a `JobFeed` with nothing in flight (a Ray actor before its first scenarios arrive
    or after its last, a server between requests). On a GPU the engine waits on neither taking in
    jobs nor handling frames: a share of them is time the GPU may stand idle; idle time is the
    front-end's, not the engine's (on four H100s it was most of what read as "taking in jobs"
    before it was counted apart: benchmarks/README.md)."""

    steps: int = 0
    step_s: float = 0.0
    admit_s: float = 0.0
    frames_s: float = 0.0
    idle_s: float = 0.0
    run_s: float = 0.0  # of the runs that returned
    running_since: float | None = None  # the run in progress (a server's or a Ray actor's never returns)
    # Continuous batching only: rollouts holding a slot, summed over steps (their mean says how
    # full the batch ran: a run that fills its slots late makes more steps for the same frames),
    # and when the slots were first all held, in seconds from the first run's start.
    in_flight_sum: int = 0
    full_after_s: float | None = None
    # Batch-at-a-time drivers only (the reference's, single-stream's): batches run and the jobs in them.
    batches: int = 0
    batched_jobs: int = 0

    def as_dict(self) -> dict:
        run_s = self.run_s + (time.perf_counter() - self.running_since if self.running_since is not None else 0.0)
        other = max(0.0, run_s - self.step_s - self.admit_s - self.frames_s - self.idle_s)
        return {"steps": self.steps, "seconds": round(run_s, 3), "in_engine_step_s": round(self.step_s, 3),
                "admitting_jobs_s": round(self.admit_s, 3), "handling_frames_s": round(self.frames_s, 3),
                "idle_s": round(self.idle_s, 3), "other_s": round(other, 3),
                "ms_per_step": round(1000 * self.step_s / self.steps, 3) if self.steps else None,
                **({"rollout_steps": self.in_flight_sum, "mean_in_flight": round(self.in_flight_sum / self.steps, 1),
                    "full_after_s": None if self.full_after_s is None else round(self.full_after_s, 2)}
                   if self.in_flight_sum and self.steps else {}),
                **({"batches": self.batches, "mean_batch": round(self.batched_jobs / self.batches, 2)}
                   if self.batches else {})}


def take_cancelled(feed: "JobFeed | None", job: RolloutJob, on_cancelled: JobCancelled | None) -> bool:
    """Whether `job` was cancelled through `feed`; if so it is reported (once) and forgotten. Both
    drivers ask this of a job they are about to take and of each job in flight."""
    if feed is None or job.key not in feed.cancelled():
        return False
    feed.forget(job.key)
    if on_cancelled is not None:
        on_cancelled(job)
    return True


def admit(layout, feed: "JobFeed | None", job: RolloutJob, on_cancelled: JobCancelled | None,
          on_error: JobFailed | None, on_start: JobStarted | None) -> bool:
    """Whether a driver takes `job` now: not cancelled, its invariants hold (`check_job`; a job that
    fails them is reported to `on_error`, or raises without it), and then `on_start` is called. Every
    driver admits a job through this."""
    if take_cancelled(feed, job, on_cancelled):
        return False
    try:
        check_job(layout, job)
    except Exception as exc:
        if on_error is None:
            raise
        on_error(job, exc)
        return False
    if on_start is not None:
        on_start(job)
    return True


def timed_get(feed: "JobFeed", wait: float, loop: LoopTimes) -> RolloutJob | None:
    """`feed.get(wait)`, its waiting counted as idle (the caller has nothing in flight when wait > 0)."""
    if wait <= 0:
        return feed.get(0)
    began = time.perf_counter()
    try:
        return feed.get(wait)
    finally:
        loop.idle_s += time.perf_counter() - began


class Driver(Protocol):
    max_in_flight: int
    loop: LoopTimes

    def run(self, jobs: Iterable[RolloutJob] | JobFeed, on_frame: FrameDone | None = None,
            on_done: JobDone | None = None, on_cancelled: JobCancelled | None = None,
            idle_wait: float = 0.05, on_start: JobStarted | None = None,
            on_error: JobFailed | None = None) -> None:
        """Generate every job; returns when all are done (a `JobFeed`: once it is closed and
        drained). KeyboardInterrupt aborts what is in flight and propagates."""
        ...


def check_job(layout, job: RolloutJob) -> None:
    """A job's invariants, asserted as the engine takes it (the request layers validate what users
    give, with their own messages; this catches a front-end that built a job wrong)."""
    from terra_cli.errors import InputError
    from terra_cli.pipeline.rounds import MAX_TOTAL_FRAMES

    context, actions = job.context, job.actions
    if context.ndim != 2 or context.shape[1] != layout.image_tokens or not np.issubdtype(context.dtype, np.integer):
        raise InputError(f"job {job.key}: context must be integer codes of shape (frames, {layout.image_tokens}), "
                         f"got {context.dtype} {context.shape}")
    if context.size and (context.min() < 0 or context.max() >= layout.image_vocab_size):
        raise InputError(f"job {job.key}: context codes must be in [0, {layout.image_vocab_size - 1}]")
    if not 1 <= context.shape[0] < job.total_frames <= MAX_TOTAL_FRAMES:
        raise InputError(f"job {job.key}: {job.total_frames} frames after {context.shape[0]} context frame(s)")
    if actions.ndim != 3 or actions.shape[0] < job.total_frames - 1 or actions.shape[1:] != (layout.action_tokens, 3):
        raise InputError(f"job {job.key}: actions must have shape (>= {job.total_frames - 1}, {layout.action_tokens}, 3), "
                         f"got {actions.shape}")
    if not np.isfinite(actions[: job.total_frames - 1]).all():
        raise InputError(f"job {job.key}: actions contain NaN or inf")


def compatible(a: RolloutJob, b: RolloutJob) -> bool:
    """Two jobs that can share a lockstep batch: same shape of work and the same sampling but the seed."""
    return (a.context.shape == b.context.shape and a.total_frames == b.total_frames
            and a.frame_offset == b.frame_offset and a.sampling.same_rule(b.sampling))


def rollout_jobs(context_tokens: np.ndarray, action_waypoints: np.ndarray, total_frames: int,
                 sampling: Sampling, key: str = "rollout") -> list[RolloutJob]:
    """One job per rollout of a lockstep request: context (R, K, T) or (K, T), actions
    (R, F, A, 3) or (F, A, 3); rollout r is seeded `sampling.seed + r` (terra_cli/seeds.py)."""
    from dataclasses import replace

    from terra_cli.seeds import rollout_seed

    context = np.asarray(context_tokens)
    context = context[None] if context.ndim == 2 else context
    actions = np.asarray(action_waypoints, dtype=np.float32)
    actions = actions[None] if actions.ndim == 3 else actions
    rollouts = max(context.shape[0], actions.shape[0])
    return [RolloutJob(f"{key}{r}", np.asarray(context[min(r, context.shape[0] - 1)], dtype=np.int64),
                       actions[min(r, actions.shape[0] - 1)], total_frames,
                       replace(sampling, seed=rollout_seed(sampling.seed, r)))
            for r in range(rollouts)]


def run_lockstep(driver: Driver, jobs: list[RolloutJob], on_frame: Callable[[int, np.ndarray], None] | None = None,
                 ) -> np.ndarray:
    """Run `jobs` (all of one length) on `driver`; all their tokens (R, frames, T). `on_frame(index,
    tokens (R, T))` once every rollout has finished frame `index`, in order."""
    results: dict[str, np.ndarray] = {}
    position = {job.key: r for r, job in enumerate(jobs)}
    pending: dict[int, dict[int, np.ndarray]] = collections.defaultdict(dict)
    reported = [min(job.context.shape[0] for job in jobs)]

    def frame_done(job: RolloutJob, index: int, tokens: np.ndarray) -> None:
        pending[index][position[job.key]] = np.array(tokens)
        while on_frame is not None and len(pending.get(reported[0], ())) == len(jobs):
            rows = pending.pop(reported[0])
            on_frame(reported[0], np.stack([rows[r] for r in range(len(jobs))]))
            reported[0] += 1

    driver.run(jobs, on_frame=frame_done, on_done=lambda job, tokens: results.__setitem__(job.key, tokens.copy()))
    return np.stack([results[job.key] for job in jobs])
