"""Rows' frame ends at fixed sizes: the forward that closes several rows' frames (each row's last code and
its action slots, `StaticKVDecoder.frame_ends_at`) over fixed inputs, at the row batch's sizes, on CUDA
one graph a size.

Rows of a `row_batch.RowBatchDecoder` join at any step, so at 32 rows some row's frame ends every few
dozen steps, not once a frame. Eager, that forward launched its ~25 kernels a layer one by one while the
GPU, done with them at once, waited for the next: one graph replay instead.
"""

from __future__ import annotations

import torch

from terra_cli.backends.static_kv import StaticKVDecoder
from terra_cli.runtime import switched_off

# TERRA_ROW_FRAME_END_GRAPHS=0 keeps the rows' frame ends eager, at their own row count (to compare).
GRAPHS_ENV = "TERRA_ROW_FRAME_END_GRAPHS"


def padded(cuda_graphs: bool) -> bool:
    """Whether a row batch whose steps are CUDA graphs runs its frame ends through `FrameEnds` too."""
    return cuda_graphs and not switched_off(GRAPHS_ENV)


class FrameEnds:
    """`StaticKVDecoder.frame_ends_at` over fixed inputs of up to `rows` runs, run at a size of
    `ROW_BUCKETS`; with `cuda_graphs`, one CUDA graph a size. A run past the table is padding."""

    def __init__(self, core: StaticKVDecoder, rows: int, cuda_graphs: bool):
        self.core, self.cuda_graphs = core, cuda_graphs
        long = dict(dtype=torch.long, device=core.device)
        self.codes = torch.zeros(rows, **long)
        self.starts = torch.full((rows,), core.layout.max_positions, **long)
        self.rows = torch.zeros(rows, **long)
        self.waypoints = torch.zeros(rows, core.layout.action_tokens, 3, dtype=torch.float32, device=core.device)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None  # not the steps': see `capture`

    def forward(self, size: int) -> torch.Tensor:
        return self.core.frame_ends_at(self.codes[:size], self.starts[:size], self.waypoints[:size], self.rows[:size])

    def run(self, size: int) -> torch.Tensor:
        """The first `size` runs' next-frame logits (size, V); with graphs, valid until the next `run`."""
        if not self.cuda_graphs:
            return self.forward(size)
        if size not in self.graphs:
            self.capture(size)
        self.graphs[size].replay()
        return self.outputs[size]

    def capture(self, size: int) -> None:
        """Warm-up and capture with every run padding (its writes land in row 0's spare positions), the
        inputs put back after. A pool of their own: a graph's logits must outlive the steps' replays."""
        saved = [t.clone() for t in (self.starts, self.rows)]
        self.starts.fill_(self.core.layout.max_positions)
        self.rows.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self.forward(size)
        self.graphs[size] = graph
        for tensor, value in zip((self.starts, self.rows), saved):
            tensor.copy_(value)
