"""Several rollouts' frames decided together, one decode step for all of them (many sessions at once).

`RowBatchDecoder` keeps each rollout of a batch in a region of its own of one static cache (a row of
`StaticKVDecoder(rows=...)`) and runs their frames in lockstep: every step feeds each row's last code
at the row's own position and decides each row's next code, with one forward for all rows and, on
CUDA, one CUDA graph. A row's prompt and the step that closes its frame run for that row alone.
A row keeps what its last rollout wrote (`Resident`): a rollout that continues it (a server session's
next frame, whose context is the frames so far) goes to that row and skips its prompt, which at 24
frames of context is 14,000 positions a session.

Rows need not start together (`add`, `advance`): each row has its own place in its frame, so a rollout
joins the running batch at the next few steps' end, and a row whose frame is done goes on with its next
frame or is free. A server's sessions come back with their next frames one after another (each after its
picture and a round trip): in lockstep batches, every session waited for the last one's picture; here
none waits for another's.

Each row draws from a generator of its own under the seed rule of `terra_cli/seeds.py` (frame f of a
rollout seeded s from `draw_seed(s, f)`), with the reference's sampling rule (`device_sampling`): a
rollout gets the codes it gets alone on `SingleStreamDecoder`, whatever shares its batch (on a GPU the
batched GEMMs may round differently from one row's, as any two batch sizes do).

A free row idles in the batch's steps (its position does not move; what it writes there, a later prompt
or frame end rewrites). Batches of 1-32 rows run at the next size of
`ROW_BUCKETS` (idle rows fill the rest), so a few CUDA graphs and compiled shapes serve every batch.
What a step costs at 1-64 rows: benchmarks/README.md, "One decode step for B rollouts at once".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from terra_cli.backends.base import Sampling
from terra_cli.backends.device_sampling import FrameGenerators, StepSampler, draw_codes, noise_streams
from terra_cli.backends.static_kv import StaticKVDecoder, host_to_device

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
JOIN_STEPS = 16  # `advance`'s steps at most: how long a rollout waits to join (~40 ms at 32 rows on an H200)
# `advance` calls whose steps may wait on the GPU at once. The host runs ahead of the GPU: unbounded, it
# queued a whole frame's steps, so a rollout could join only when some frame ended (a sync), and the
# server's pictures queued behind up to a frame of steps (36 ms a picture at 32 sessions against 9 alone,
# 2026-11-29, lease 12).
QUEUED_ADVANCES = 2
MAX_ROWS = ROW_BUCKETS[-1]


def bucket(rows: int) -> int:
    """The rows a batch of `rows` rollouts runs at."""
    for size in ROW_BUCKETS:
        if rows <= size:
            return size
    raise ValueError(f"a row batch holds at most {MAX_ROWS} rollouts, got {rows}")


@dataclass
class Resident:
    """What a row's cache holds after a rollout: every frame's codes (F, T) but the last frame's last
    code, and the action slots after each frame but the last (F - 1, A, 3). A later rollout whose
    context is exactly those frames with those actions first (a session's next frame) needs only the
    step that closes its last frame, not its whole prompt again."""

    frames: np.ndarray
    actions: np.ndarray
    owner: str | None = None  # the rollout's `RowWork.owner`

    def holds(self, work: "RowWork") -> bool:
        known = self.frames.shape[0]
        return (work.context.shape == self.frames.shape and work.actions.shape[0] >= known
                and np.array_equal(work.context, self.frames)
                and np.array_equal(work.actions[:known - 1], self.actions))


@dataclass
class RowWork:
    """One rollout's round: context (K, T) int64, actions (num_frames - 1, A, 3) float32 (checked by the
    caller), `seed` the rollout's own, `first_frame` the video frame of its first context frame."""

    context: np.ndarray
    actions: np.ndarray
    num_frames: int
    seed: int
    first_frame: int = 0
    owner: str | None = None  # whose rollouts these are (a server session): its next round takes its own row


@dataclass
class _Live:
    """A rollout in progress on a row: `frame` is the frame its steps decide, `left` the steps until
    that frame's codes are all decided."""

    tag: object
    work: RowWork
    out: np.ndarray
    waypoints: torch.Tensor
    seeds: FrameGenerators
    frame: int
    left: int = 0


class RowBatchDecoder:
    """Up to `rows` rollouts' caches over the weights and layer functions of `single` (a
    `StaticKVDecoder` of the same model, whose compiled code and weight copies are shared)."""

    def __init__(self, single: StaticKVDecoder, rows: int, cuda_graphs: bool = False):
        self.core = StaticKVDecoder(single.model, rows=rows, ops_from=single)
        self.layout = single.layout
        self.rows = rows
        device = self.core.device
        long = dict(dtype=torch.long, device=device)
        self.codes = torch.zeros(rows, **long)  # each row's last decided code, fed by the next step
        self.positions = torch.zeros(rows, **long)  # where each row's code is fed
        self.moving = torch.zeros(rows, **long)  # 1: the row has a frame in progress; 0: it idles
        self.next_index = torch.zeros(rows, **long)  # the code of its frame each row's step decides
        # a column past the frame's codes: a free row's steps write there once its frame is done
        self.frame_codes = torch.zeros(rows, self.layout.image_tokens + 1, **long)
        self.noise = torch.zeros(rows, self.layout.image_vocab_size, dtype=torch.float32, device=device)
        self.generators = [torch.Generator(device=device) for _ in range(rows)]
        self.noise_streams = noise_streams(device)  # the rows' noise drawn in parallel (device_sampling.NOISE_STREAMS)
        self.sampling = Sampling()
        self.sampler = StepSampler(self.core.compiled)
        # a graph needs FlashAttention's path: the torch one reads each row's length on the host
        self.cuda_graphs = cuda_graphs and self.core.flash is not None
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.steps = 0
        self.resident: list[Resident | None] = [None] * rows
        self.live: dict[int, _Live] = {}  # row -> the rollout in progress there
        self.queued: list = []  # CUDA events after the last advances' steps (QUEUED_ADVANCES)
        self.run_ahead = self.core.device.type == "cuda"  # see `advance`
        self.prompts_reused = 0  # rollouts that started from a row's resident frames

    @torch.inference_mode()  # as `rollouts` runs: dynamo guards on it
    def warm_up(self, sampling: Sampling) -> float:
        """Compile (and on CUDA capture) a step at every row count a batch can run at before the first
        batch: Inductor takes seconds a shape, which would otherwise fall on the first sessions' frames.
        The warm-up's cache writes sit at position 0 of each row, which every prompt rewrites. Seconds
        taken."""
        if not (self.cuda_graphs or self.core.compiled):
            return 0.0
        if self.live:
            raise RuntimeError("warm_up runs before rollouts, not among them")
        started = time.perf_counter()
        self.sampling = sampling
        self.resident = [None] * self.rows  # its steps write at position 0 of every row
        state = [self.codes, self.positions, self.next_index, self.frame_codes]
        for n in (size for size in ROW_BUCKETS if size <= self.rows):
            if self.cuda_graphs:
                self.run_steps(n, 0)  # captured, not replayed
            else:
                saved = [t.clone() for t in state]
                self.step(n)
                for tensor, value in zip(state, saved):
                    tensor.copy_(value)
        return time.perf_counter() - started

    def step(self, n: int) -> None:
        """Rows 0..n-1: feed each row's code at its position and decide its next code (no host sync)."""
        logits = self.core.forward_rows(self.codes[:n], self.positions[:n])
        codes = draw_codes(logits, self.layout, self.sampling, self.generators[:n], self.noise, self.sampler,
                           self.noise_streams)
        self.frame_codes[:n].scatter_(1, self.next_index[:n, None], codes[:, None])
        self.codes[:n].copy_(codes)
        self.positions[:n].add_(self.moving[:n])
        self.next_index[:n].add_(self.moving[:n])

    def run_steps(self, n: int, times: int) -> None:
        self.steps += times
        if not self.cuda_graphs:
            for _ in range(times):
                self.step(n)
            return
        key = (n, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
        graph = self.graphs.get(key) or self.graphs.setdefault(key, self.capture(n))
        for _ in range(times):
            graph.replay()

    def capture(self, n: int):
        """One step of n rows as a CUDA graph (`single_stream.capture_step`), drawing from rows 0..n-1's generators."""
        from terra_cli.backends.single_stream import capture_step

        def use_generators(generators):
            self.generators[:n] = generators

        return capture_step(lambda: self.step(n), [self.codes, self.positions, self.next_index, self.frame_codes],
                            self.generators[:n], use_generators, self.pool)

    def place(self, work: list[RowWork]) -> list[int]:
        """Each rollout's row among those no rollout holds now: the row whose cache already holds its
        context (`Resident.holds`); else a row its owner's last rollout left, a row holding nothing, or
        the lowest row, which no other rollout of `work` takes (so others' kept rows stay theirs)."""
        rows: list[int | None] = [None] * len(work)
        taken: set[int] = set(self.live)
        for i, w in enumerate(work):
            for row, resident in enumerate(self.resident):
                if row not in taken and resident is not None and resident.holds(w):
                    rows[i] = row
                    taken.add(row)
                    break

        def preference(row: int, owner: str | None) -> tuple:
            resident = self.resident[row]
            mine = resident is not None and owner is not None and resident.owner == owner
            return (not mine, resident is not None, row)

        for i, w in enumerate(work):
            if rows[i] is None:
                rows[i] = min((row for row in range(self.rows) if row not in taken),
                              key=lambda row: preference(row, w.owner))
                taken.add(rows[i])
        return rows

    def compatible(self, sampling: Sampling) -> bool:
        """Whether a rollout sampling so may join the rollouts in progress (one graph a sampling rule)."""
        return not self.live or sampling.same_rule(self.sampling)

    @torch.inference_mode()
    def add(self, work: list[tuple[object, RowWork]], sampling: Sampling) -> list[int]:
        """Start (tag, rollout) pairs on free rows at their first frame to decide: each its prompt, or, on
        a row that holds its context, only the step closing its last frame (those in one forward). Their
        steps run from the next `advance`. Returns their rows."""
        if len(self.live) + len(work) > self.rows:
            raise ValueError(f"{len(self.live) + len(work)} rollouts at once; this decoder holds {self.rows}")
        if not self.compatible(sampling):
            raise ValueError("rollouts in progress sample by other settings")
        core, device = self.core, self.core.device
        self.sampling = sampling
        rows = self.place([w for _, w in work])
        prompted, prompt_logits, continuing = [], [], []
        for (tag, w), row in zip(work, rows):
            out = np.empty((w.num_frames, self.layout.image_tokens), dtype=np.int64)
            out[:w.context.shape[0]] = w.context
            self.live[row] = _Live(tag, w, out, host_to_device(w.actions, device, torch.float32),
                                   FrameGenerators(self.generators[row], w.seed, w.first_frame), w.context.shape[0])
            if self.resident[row] is not None and self.resident[row].holds(w):
                continuing.append(row)
            else:
                prompted.append(row)
                prompt_logits.append(core.forward_prompt(host_to_device(w.context, device), self.live[row].waypoints,
                                                         row=row))
            self.resident[row] = None  # until the rollout's last frame is in
        if prompted:
            self._start_frames(prompted, torch.cat(prompt_logits))
        if continuing:
            self._start_frames(continuing, self._close_frames(
                continuing, [int(self.live[r].work.context[-1, -1]) for r in continuing],
                [self.live[r].frame - 1 for r in continuing]))
            self.prompts_reused += len(continuing)
        return rows

    def _close_frames(self, rows: list[int], last_codes, frames: list[int]) -> torch.Tensor:
        """Row rows[i]'s frame frames[i] closed (its last code, then its action slots), all in one forward ->
        each row's next frame's code-0 logits (S, V). (Eager: as CUDA graphs at the batch sizes, padded,
        they made no difference at 32 sessions, 2026-12-06: the GPU, not the host, is what the steps wait on.)"""
        core = self.core
        last = last_codes if isinstance(last_codes, torch.Tensor) else host_to_device(last_codes, core.device)
        waypoints = torch.stack([self.live[row].waypoints[f] for row, f in zip(rows, frames)])
        return core.forward_frame_ends(last, frames, waypoints, rows)

    def _start_frames(self, rows: list[int], logits: torch.Tensor) -> None:
        """Each row's next frame begun: its code 0 drawn from logits (S, V), as `next_codes` draws it alone
        (the same draws from the row's generator, reseeded for the frame), for all rows in a few kernels."""
        for row in rows:
            live = self.live[row]
            live.seeds.start_frame(live.frame)
            live.left = self.layout.image_tokens - 1
        # eager: the joining rows come in any number (the step's noise rows are scratch between steps)
        codes = draw_codes(logits, self.layout, self.sampling, [self.generators[row] for row in rows], self.noise)
        device = self.core.device
        index = host_to_device(rows, device)
        self.frame_codes[index, 0] = codes
        self.codes[index] = codes
        stride = self.layout.frame_stride
        self.positions[index] = host_to_device([self.live[row].frame * stride for row in rows], device)
        self.next_index[index] = 1
        self.moving[index] = 1

    @torch.inference_mode()
    def advance(self, max_steps: int | None = None) -> list[tuple[object, int, np.ndarray, bool]]:
        """Up to `max_steps` (`JOIN_STEPS`) decode steps of every rollout in progress, fewer where one's frame is done
        first. Returns (tag, frame, codes (T,), last) for each frame done; a rollout whose last frame is
        done leaves its row (its frames stay there: `Resident`), the others go on with their next frame.
        With `run_ahead` (CUDA), the next steps are queued before the host waits for the done frames' codes,
        so the GPU does not idle while they are copied and handed on."""
        if not self.live:
            return []
        if all(live.left for live in self.live.values()):  # (a run-ahead may have ended some frames already)
            self._run_chunk(max_steps)
        finished = [row for row, live in self.live.items() if live.left == 0]
        if not finished:
            return []
        codes = self.layout.image_tokens
        # (a copy: the rows' next frames write over theirs; indices through `host_to_device`, which does not wait)
        decided = self.frame_codes.index_select(0, host_to_device(finished, self.core.device))[:, :codes]
        copied = None
        if decided.is_cuda:
            host = torch.empty(decided.shape, dtype=decided.dtype, pin_memory=True)
            host.copy_(decided, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = decided
        ended = [(row, self.live[row]) for row in finished]
        closing = [row for row, live in ended if live.frame < live.work.num_frames - 1]
        if closing:  # the frames that go on are closed in one forward and their next frames started
            last_codes = self.frame_codes.index_select(0, host_to_device(closing, self.core.device))[:, codes - 1]
            logits = self._close_frames(closing, last_codes, [self.live[row].frame for row in closing])
            for row in closing:
                self.live[row].frame += 1
            self._start_frames(closing, logits)
        for row, live in ended:
            if row not in closing:
                self._free(row)
        if self.run_ahead and self.live:
            self._run_chunk(max_steps)
        if copied is not None:
            copied.synchronize()
        done = []
        for (row, live), tokens in zip(ended, host.numpy()):
            frame = live.frame - 1 if row in closing else live.frame
            live.out[frame] = tokens
            last = row not in closing
            done.append((live.tag, frame, live.out[frame], last))
            if last:
                self.resident[row] = Resident(live.out.copy(), np.array(live.work.actions[:live.work.num_frames - 1]),
                                              live.work.owner)
        return done

    def _run_chunk(self, max_steps: int | None) -> None:
        n = min(bucket(max(self.live) + 1), self.rows)
        times = min(JOIN_STEPS if max_steps is None else max_steps, min(live.left for live in self.live.values()))
        self.run_steps(n, times)
        if self.core.device.type == "cuda":
            self.queued.append(torch.cuda.Event())
            self.queued[-1].record()
            if len(self.queued) > QUEUED_ADVANCES:
                self.queued.pop(0).synchronize()
        for live in self.live.values():
            live.left -= times

    def drop(self, tag) -> None:
        """Stop the rollout `tag` (cancelled): its row is free, and holds nothing a later rollout may reuse."""
        for row, live in list(self.live.items()):
            if live.tag == tag:
                self._free(row)
                self.resident[row] = None

    def drop_all(self) -> None:
        """After a failure: every row free, none reused."""
        for row in list(self.live):
            self._free(row)
        self.resident = [None] * self.rows

    def _free(self, row: int) -> None:
        del self.live[row]
        self.moving[row] = 0

    def rollouts(self, work: list[RowWork], sampling: Sampling, on_frame=None, on_row_done=None) -> list[np.ndarray]:
        """Rollouts that start together, each run to its end: each one's frames (num_frames, T). `on_frame(i,
        f, tokens)` after frame f of work[i] (f within its round); returning False drops that rollout
        (cancelled). `on_row_done(i, frames)` when work[i]'s last frame is in."""
        if self.live:
            raise RuntimeError("rollouts are in progress")
        if len(work) > self.rows:
            raise ValueError(f"{len(work)} rollouts need {bucket(len(work))} rows; this decoder holds {self.rows}")
        rows = self.add(list(enumerate(work)), sampling)
        out = [self.live[row].out for row in rows]
        while self.live:
            for i, f, tokens, last in self.advance(self.layout.image_tokens):
                if on_frame is not None and on_frame(i, f, tokens) is False:
                    self.drop(i)
                elif last and on_row_done is not None:
                    on_row_done(i, out[i])
        return out
