"""Continuous batching over one vLLM engine: many rollouts in flight, each at its own frame.

`LLM.generate` runs a batch until its last request finishes (lockstep). Here we drive
`llm.llm_engine` ourselves (add_request / step, FINAL_ONLY outputs): as soon as a rollout's frame
finishes, its next frame's request goes in (prompt = previous prompt + the 576 codes + the frame's
6 action ids, served from the prefix cache), and a finished rollout's slot takes the next job.

Action rows: rollout slot s owns table rows [s * max_frames * 6, (s + 1) * max_frames * 6). When a
rollout starts a round, that round's rows are written (apply_model between steps) and, when a row
changes what it held, the slot's epoch goes up; every request carries `cache_salt=f"{s}.{epoch}"`,
so a prompt can never hit KV blocks computed while the same ids meant other waypoints, and the
prefix cache never needs a reset while requests are in flight (vLLM refuses one then). A job's
`affinity` brings it back to its last slot, so a server session's next frame reuses its prefix.
A fork's branch (`RolloutJob.prefix_of`: its parent's affinity) borrows the salt and ids of its
parent's last round for the rows they share, so its first frame is served the parent's cached
prefix; backends/vllm_slots.py holds the slots, salts and the rules that keep borrowing exact.

Sampling seeds follow terra_cli/seeds.py (the job's seed and the frame's index in the video), so a
job's tokens do not depend on its slot or neighbours. This is the vLLM side of the one driver
interface (backends/driver.py); the jobs, the feed and the loop times live there.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from terra_cli.backends.driver import (FrameDone, JobCancelled, JobDone, JobFailed, JobFeed, JobStarted,  # noqa: F401
                                       LoopTimes, RolloutJob, admit, take_cancelled, timed_get)
from terra_cli.backends.vllm import VllmBackend, write_rows, interleave
from terra_cli.backends.vllm_prefix_hashes import PrefixHashReuse
from terra_cli.backends.vllm_slots import RoundPlan, SlotTable
from terra_cli.pipeline.rounds import Round, plan_rounds
from terra_cli.runtime import switched_off


@dataclass
class _Rollout:
    job: RolloutJob
    slot: int
    rounds: list[Round]
    frames: np.ndarray  # (total_frames, T): context, then each finished frame
    round_index: int = 0
    local_frame: int = 0  # frame (within the round) of the request in flight
    prompt: list[int] = field(default_factory=list)
    action_ids: np.ndarray | None = None  # (num_frames - 1, 6) for the current round
    salt: str = ""
    plan: RoundPlan | None = None  # the current round's ids and salt (its pins end with the round)


def kv_capacity_rollouts(backend: VllmBackend, tokens_per_rollout: int) -> int | None:
    """How many rollouts of `tokens_per_rollout` KV tokens the engine's cache holds (None: unknown)."""
    cache = backend.llm.llm_engine.vllm_config.cache_config
    blocks, block_size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    if not blocks or not block_size:
        return None
    per_rollout = -(-tokens_per_rollout // block_size)
    return max(1, int(blocks) // per_rollout)


def round_tokens(layout, frames: int) -> int:
    """KV tokens of a rollout's longest round: rounds hold at most `layout.max_frames` frames."""
    return min(frames, layout.max_frames) * layout.frame_stride


def auto_in_flight(backend: VllmBackend, longest_frames: int, cap: int) -> tuple[int, str]:
    """Rollouts in flight when none is asked for: as many full-length rollouts of the longest
    scenario as the engine's KV cache holds at once, so that no request is ever preempted (a
    preempted request recomputes its whole prompt), at most `cap` and at most the engine's
    sequences. Returns the count and a one-line reason for the log."""
    tokens = round_tokens(backend.config.layout, longest_frames)
    capacity = kv_capacity_rollouts(backend, tokens)
    sequences = backend.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    if capacity is None:
        return min(cap, sequences), f"the KV cache's size is unknown: {min(cap, sequences)}"
    chosen = max(1, min(capacity, cap, sequences))
    return chosen, f"the KV cache holds {capacity} rollouts of {tokens} tokens; {chosen} in flight (at most {cap})"


def rollout_of_request(request_id: str) -> str | None:
    """The job key in a request id of `StreamDriver._submit` ("key#round.frame"), else None."""
    key, hash_mark, _ = request_id.rpartition("#")
    return key if hash_mark else None


class StreamDriver:
    """Runs `RolloutJob`s with up to `max_in_flight` at once on a `VllmBackend`'s engine."""

    def __init__(self, backend: VllmBackend, max_in_flight: int, stagger_starts: bool = False):
        self.backend = backend
        self.layout = backend.config.layout
        self.engine = backend.llm.llm_engine
        table_frames = backend.action_rows.capacity  # frames' worth of action rows
        slots = table_frames // self.layout.max_frames
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        # The table is sized for max_num_seqs sequences of max_frames frames.
        self.max_in_flight = min(max_in_flight, slots)
        self.slots = SlotTable(self.max_in_flight, self.layout, self._write_rows)
        self.requests_done = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.loop = LoopTimes()  # summed over every run() of this driver
        # A frame's request reuses its rollout's previous block hashes (vllm_prefix_hashes.py);
        # TERRA_VLLM_REUSE_PREFIX_HASHES=0 turns it off, for measuring what it saves.
        self.prefix_hashes = PrefixHashReuse(rollout_of_request)
        self.reuse_prefix_hashes = not switched_off("TERRA_VLLM_REUSE_PREFIX_HASHES")
        # Staggered starts: at most max_in_flight / image_tokens new rollouts a step, so a batch that
        # starts empty spreads its rollouts over a frame's steps, and equal-length jobs (ACT-Bench) do
        # not finish each frame in the same step. Their rounds and videos still end within a frame's
        # steps of each other (measured: videos finished in waves all the same). Batch runs ask for it
        # where runtime.stagger_starts_asked says so (on unless TERRA_STAGGER_STARTS=0: why, there).
        self.starts_per_step = None
        if stagger_starts:
            self.starts_per_step = self.max_in_flight / self.layout.image_tokens

    def run(self, jobs: Iterable[RolloutJob] | JobFeed, on_frame: FrameDone | None = None,
            on_done: JobDone | None = None, on_cancelled: JobCancelled | None = None,
            idle_wait: float = 0.05, on_start: JobStarted | None = None,
            on_error: JobFailed | None = None) -> None:
        """Generate every job; returns when all are done (a `JobFeed`: once it is closed and
        drained). A job that breaks its invariants goes to `on_error` (raised without it); an
        engine error is raised. KeyboardInterrupt aborts what is in flight (the engine is left
        empty) and propagates."""
        feed = jobs if isinstance(jobs, JobFeed) else None
        pending: Iterator[RolloutJob] | None = None if feed is not None else iter(jobs)
        free = list(range(self.max_in_flight - 1, -1, -1))
        active: dict[str, _Rollout] = {}  # request id -> rollout
        waiting: list[_Rollout] = []  # rounds that would rewrite rows an in-flight request borrows
        exhausted = False
        # Rows of the lockstep backend's ActionRows are overwritten here: it must forget them.
        self.backend.action_rows.first_row.clear()
        self.slots.restart()  # the table may have changed since the last run

        clock = time.perf_counter
        began = self.loop.running_since = clock()
        start_credit = 1.0  # staggered starts: new rollouts this step may take (at most one saved up)
        if self.reuse_prefix_hashes:
            self.prefix_hashes.attach(self.backend.llm)
        try:
            while True:
                if feed is not None:
                    gone = feed.cancelled()
                    for request_id in [r for r, rollout in active.items() if rollout.job.key in gone]:
                        rollout = active.pop(request_id)
                        self.engine.abort_request([request_id])
                        self._end(rollout, free)
                        take_cancelled(feed, rollout.job, on_cancelled)
                    for rollout in [r for r in waiting if r.job.key in gone]:
                        waiting.remove(rollout)
                        self._end(rollout, free)
                        take_cancelled(feed, rollout.job, on_cancelled)
                for rollout in list(waiting):
                    if self._start_round(rollout):
                        waiting.remove(rollout)
                        active[self._submit(rollout)] = rollout
                admitting, idle_before = clock(), self.loop.idle_s
                if self.starts_per_step is not None:
                    start_credit = min(1.0, start_credit + self.starts_per_step) if active else 1.0
                while free and not exhausted and (self.starts_per_step is None or start_credit >= 1.0):
                    if feed is None:
                        job = next(pending, None)
                        exhausted = job is None
                    else:
                        job = timed_get(feed, 0 if active else idle_wait, self.loop)
                        exhausted = job is None and feed.finished
                    if job is None:
                        break
                    if not admit(self.layout, feed, job, on_cancelled, on_error, on_start):
                        continue
                    rollout = self._start(job, self.slots.take(free, job.affinity, job.prefix_of))
                    start_credit -= 1.0
                    if self._start_round(rollout):
                        active[self._submit(rollout)] = rollout
                    else:
                        waiting.append(rollout)
                stepping = clock()
                self.loop.admit_s += stepping - admitting - (self.loop.idle_s - idle_before)
                if not active:
                    if exhausted and not waiting:
                        break
                    continue
                outputs = self.engine.step()
                handling = clock()
                self.loop.step_s += handling - stepping
                self.loop.steps += 1
                held = self.max_in_flight - len(free)
                self.loop.in_flight_sum += held
                if held == self.max_in_flight and self.loop.full_after_s is None:
                    self.loop.full_after_s = stepping - began
                for out in outputs:
                    rollout = active.pop(out.request_id, None)
                    if rollout is None:  # aborted (cancelled) after it was stepped
                        continue
                    self.requests_done += 1
                    self.cached_tokens += out.num_cached_tokens or 0
                    self.prompt_tokens += len(out.prompt_token_ids or ())
                    state = self._frame_finished(rollout, list(out.outputs[0].token_ids), on_frame)
                    if state == "submit":
                        active[self._submit(rollout)] = rollout
                    elif state == "wait":
                        waiting.append(rollout)
                    else:
                        self._end(rollout, free)
                        if on_done is not None:
                            on_done(rollout.job, rollout.frames)
                self.loop.frames_s += clock() - handling
        except BaseException:
            if active:
                self.engine.abort_request(list(active))
            raise
        finally:
            self.loop.run_s += clock() - began
            self.loop.running_since = None
            # Our salted blocks are useless to lockstep calls, and nothing is in flight now.
            if not self.engine.has_unfinished_requests():
                self.backend.llm.reset_prefix_cache()
            self.prefix_hashes.detach()

    def _end(self, rollout: _Rollout, free: list[int]) -> None:
        """A rollout leaves the engine: its round's pins end and its slot is free."""
        self.slots.release(rollout.plan)
        rollout.plan = None
        free.append(rollout.slot)
        self.prefix_hashes.forget(rollout.job.key)

    def _write_rows(self, first_rows: np.ndarray, waypoints: np.ndarray) -> None:
        self.backend.llm.apply_model(functools.partial(write_rows, first_rows, waypoints))

    # -- one rollout ------------------------------------------------------------------------

    def _start(self, job: RolloutJob, slot: int) -> _Rollout:
        context = np.asarray(job.context, dtype=np.int64)
        frames = np.zeros((job.total_frames, self.layout.image_tokens), dtype=np.int64)
        frames[: context.shape[0]] = context
        rounds = plan_rounds(context.shape[0], job.total_frames, self.layout.max_frames)
        return _Rollout(job, slot, rounds, frames)

    def _start_round(self, rollout: _Rollout) -> bool:
        """Write the round's rows and build its first prompt; False when it must wait (it would
        rewrite rows an in-flight request borrows: backends/vllm_slots.py)."""
        rnd = rollout.rounds[rollout.round_index]
        waypoints = np.ascontiguousarray(rollout.job.actions[rnd.first_frame : rnd.end - 1], dtype=np.float32)
        plan = self.slots.plan(rollout.slot, waypoints, rollout.job.prefix_of)
        if plan is None:
            return False
        rollout.plan, rollout.salt, rollout.action_ids = plan, plan.salt, plan.ids
        context = rollout.frames[rnd.first_frame : rnd.first_frame + rnd.context_frames]
        rollout.prompt = interleave(context, rollout.action_ids[: rnd.context_frames])
        rollout.local_frame = rnd.context_frames
        return True

    def _frame_finished(self, rollout: _Rollout, codes: list[int], on_frame: FrameDone | None) -> str:
        """Store a finished frame; "submit" when the rollout has another frame to request, "wait"
        when its next round waits for a pinned slot, "done" when it has finished."""
        if len(codes) != self.layout.image_tokens:
            raise RuntimeError(f"vLLM returned {len(codes)} codes for a frame, expected {self.layout.image_tokens}")
        rnd = rollout.rounds[rollout.round_index]
        index = rnd.first_frame + rollout.local_frame
        rollout.frames[index] = codes
        if on_frame is not None:
            on_frame(rollout.job, index, rollout.frames[index])
        rollout.local_frame += 1
        if rollout.local_frame < rnd.num_frames:
            rollout.prompt = rollout.prompt + codes + rollout.action_ids[rollout.local_frame - 1].tolist()
            return "submit"
        rollout.round_index += 1
        if rollout.round_index < len(rollout.rounds):
            self.slots.release(rollout.plan)
            rollout.plan = None
            return "submit" if self._start_round(rollout) else "wait"
        return "done"

    def _submit(self, rollout: _Rollout) -> str:
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        rnd = rollout.rounds[rollout.round_index]
        frame = rollout.job.frame_offset + rnd.first_frame + rollout.local_frame  # in the whole video
        params = self.backend.sampling_params(rollout.job.sampling, 0, frame)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"{rollout.job.key}#{rollout.round_index}.{rollout.local_frame}"
        self.engine.add_request(request_id, tokens_input(rollout.prompt, cache_salt=rollout.salt), params)
        return request_id
