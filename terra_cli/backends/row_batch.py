"""Several rollouts' frames decided together, one decode step for all of them (many sessions at once).

`RowBatchDecoder` keeps each rollout of a batch in a region of its own of one static cache (a row of
`StaticKVDecoder(rows=...)`) and runs their frames in lockstep: every step feeds each row's last code
at the row's own position and decides each row's next code, with one forward for all rows and, on
CUDA, one CUDA graph. A row's prompt and the step that closes its frame run for that row alone.
A row keeps what its last rollout wrote (`Resident`): a rollout that continues it (a server session's
next frame, whose context is the frames so far) goes to that row and skips its prompt, which at 24
frames of context is 14,000 positions a session.

Each row draws from a generator of its own under the seed rule of `terra_cli/seeds.py` (frame f of a
rollout seeded s from `draw_seed(s, f)`), with the reference's sampling rule (`device_sampling`): a
rollout gets the codes it gets alone on `SingleStreamDecoder`, whatever shares its batch (on a GPU the
batched GEMMs may round differently from one row's, as any two batch sizes do).

A batch starts together; a row whose frames are done idles (its step rewrites its last position with
the same code) until the batch's last row is done. Batches of 2-32 rows run at the next size of
`ROW_BUCKETS` (idle rows fill the rest), so a few CUDA graphs and compiled shapes serve every batch.
What a step costs at 1-64 rows: benchmarks/README.md, "One decode step for B rollouts at once".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from terra_cli.backends.base import Sampling
from terra_cli.backends.device_sampling import FrameGenerators, filtered_probabilities, greedy_codes, next_codes
from terra_cli.backends.static_kv import StaticKVDecoder

ROW_BUCKETS = (2, 4, 8, 16, 32)
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
        self.next_index = torch.zeros(1, **long)  # the code of the frame the step decides (all rows alike)
        self.frame_codes = torch.zeros(rows, self.layout.image_tokens, **long)
        self.noise = torch.zeros(rows, self.layout.image_vocab_size, dtype=torch.float32, device=device)
        self.generators = [torch.Generator(device=device) for _ in range(rows)]
        self.sampling = Sampling()
        # a graph needs FlashAttention's path: the torch one reads each row's length on the host
        self.cuda_graphs = cuda_graphs and self.core.flash is not None
        self.graphs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.steps = 0
        self.resident: list[Resident | None] = [None] * rows
        self.prompts_reused = 0  # rollouts that started from a row's resident frames

    @torch.inference_mode()  # as `rollouts` runs: dynamo guards on it
    def warm_up(self, sampling: Sampling) -> float:
        """Compile (and on CUDA capture) a step at every row count a batch can run at before the first
        batch: Inductor takes seconds a shape, which would otherwise fall on the first sessions' frames.
        The warm-up's cache writes sit at position 0 of each row, which every prompt rewrites. Seconds
        taken."""
        if not (self.cuda_graphs or self.core.compiled):
            return 0.0
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
        if self.sampling.greedy:
            codes = greedy_codes(logits, self.layout)
        else:
            probabilities = filtered_probabilities(logits, self.layout, self.sampling)
            for row in range(n):  # the draws a row alone takes (`device_sampling.race_sample`), from its own stream
                self.noise[row].exponential_(generator=self.generators[row])
            codes = (probabilities / self.noise[:n]).argmax(dim=-1)
        self.frame_codes[:n].index_copy_(1, self.next_index, codes[:, None])
        self.codes[:n].copy_(codes)
        self.positions[:n].add_(self.moving[:n])
        self.next_index.add_(1)

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
        """Each rollout's row: the row whose cache already holds its context (`Resident.holds`), else
        the lowest row no other rollout of the batch takes."""
        rows: list[int | None] = [None] * len(work)
        taken: set[int] = set()
        for i, w in enumerate(work):
            for row, resident in enumerate(self.resident):
                if row not in taken and resident is not None and resident.holds(w):
                    rows[i] = row
                    taken.add(row)
                    break
        free = (row for row in range(self.rows) if row not in taken)
        return [row if row is not None else next(free) for row in rows]

    @torch.inference_mode()
    def rollouts(self, work: list[RowWork], sampling: Sampling, on_frame=None, on_row_done=None) -> list[np.ndarray]:
        """Each rollout's frames (num_frames, T). `on_frame(i, f, tokens)` after frame f of work[i] (f within
        its round); returning False drops that rollout (cancelled): it idles from then on. `on_row_done(i,
        frames)` when work[i]'s last frame is in."""
        layout, core = self.layout, self.core
        device, stride, codes = core.device, layout.frame_stride, layout.image_tokens
        if len(work) > self.rows:
            raise ValueError(f"{len(work)} rollouts need {bucket(len(work))} rows; this decoder holds {self.rows}")
        row_of = self.place(work)
        n = min(bucket(max(row_of) + 1), self.rows) if max(row_of) > 0 else 1
        self.sampling = sampling
        out = [np.empty((w.num_frames, codes), dtype=np.int64) for w in work]
        waypoints = [torch.tensor(w.actions, device=device) for w in work]
        seeds = [FrameGenerators(self.generators[row_of[i]], w.seed, w.first_frame) for i, w in enumerate(work)]
        pending: list[torch.Tensor | None] = [None] * len(work)
        continuing = []  # rollouts whose row holds their context: only its last frame's closing step is new
        for i, w in enumerate(work):
            row = row_of[i]
            out[i][:w.context.shape[0]] = w.context
            if self.resident[row] is not None and self.resident[row].holds(w):
                continuing.append(i)
            else:
                pending[i] = core.forward_prompt(torch.tensor(w.context, device=device), waypoints[i], row=row)
            self.resident[row] = None  # until the rollout's last frame is in
        if continuing:
            last = [work[i].context.shape[0] - 1 for i in continuing]
            logits = core.forward_frame_ends(torch.tensor([work[i].context[-1, -1] for i in continuing], device=device),
                                             last, torch.stack([waypoints[i][f] for i, f in zip(continuing, last)]),
                                             [row_of[i] for i in continuing])
            for i, row_logits in zip(continuing, logits):
                pending[i] = row_logits[None]
            self.prompts_reused += len(continuing)
        self.moving.zero_()
        live = [True] * len(work)
        for g in range(max(w.num_frames - w.context.shape[0] for w in work)):
            frames = {}  # work index -> the frame it decides now
            for i, w in enumerate(work):
                row, f = row_of[i], w.context.shape[0] + g
                if not live[i] or f >= w.num_frames:
                    self.moving[row] = 0
                    continue
                frames[i] = f
                code = next_codes(pending[i], layout, sampling, seeds[i].start_frame(f))
                self.frame_codes[row, :1].copy_(code)
                self.codes[row:row + 1].copy_(code)
                self.positions[row] = f * stride
                self.moving[row] = 1
            if not frames:
                break
            self.next_index.fill_(1)
            self.run_steps(n, codes - 1)
            decided = self.frame_codes[:n].cpu().numpy()  # the frames' one copy to the host
            closing = [i for i, f in frames.items() if f < work[i].num_frames - 1]
            if closing:  # the frames that go on are closed in one forward
                rows = [row_of[i] for i in closing]
                logits = core.forward_frame_ends(self.frame_codes[rows, codes - 1], [frames[i] for i in closing],
                                                 torch.stack([waypoints[i][frames[i]] for i in closing]), rows)
                for i, row_logits in zip(closing, logits):
                    pending[i] = row_logits[None]
            for i, f in frames.items():
                w, row = work[i], row_of[i]
                out[i][f] = decided[row]
                if on_frame is not None and on_frame(i, f, out[i][f]) is False:
                    live[i] = False
                    continue
                if f == w.num_frames - 1:
                    self.resident[row] = Resident(out[i].copy(), np.array(w.actions[:w.num_frames - 1]))
                    if on_row_done is not None:
                        on_row_done(i, out[i])
        return out
