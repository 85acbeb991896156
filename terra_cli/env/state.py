"""One environment's state: its frames, the waypoint rows between them, its seed and lineage, and
the `RolloutJob` that draws its next frame (built exactly as server/sessions.py's `_one_frame`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from terra_cli.backends.base import Sampling
from terra_cli.backends.driver import RolloutJob
from terra_cli.pipeline.rounds import plan_rounds
from terra_cli.seeds import Lineage  # noqa: F401  (part of an EnvState)


@dataclass
class EnvState:
    id: str  # the jobs' affinity: on vLLM an environment's frames come back to its slot
    sampling: Sampling
    lineage: Lineage
    context_frames: int
    tokens: list[np.ndarray]  # every frame so far, context first
    # Row j conditions frame j + 1. Rows between the context frames that reset was not given are
    # the first step's action, as in a server session.
    rows: list[np.ndarray] = field(default_factory=list)
    parent: str | None = None  # the environment this one was forked from: its jobs' prefix_of

    @property
    def frames(self) -> int:
        return len(self.tokens)

    def next_job(self, waypoints: np.ndarray, layout, step: int) -> tuple[RolloutJob, list[np.ndarray]]:
        """The job for frame n = len(tokens) under `waypoints`, and the rows it used (stored
        once the frame comes back). Context: the frames of the round n falls in; `frame_offset`:
        that round's first frame, so frame n draws as frame n of a whole run with this seed."""
        n = len(self.tokens)
        rows = self.rows + [waypoints] * (n - len(self.rows))
        rnd = plan_rounds(self.context_frames, n + 1, layout.max_frames)[-1]
        job = RolloutJob(f"{self.id}#{n}.{step}", np.stack(self.tokens[rnd.first_frame:n]),
                         np.stack(rows[rnd.first_frame:n]).astype(np.float32), n - rnd.first_frame + 1,
                         self.sampling, affinity=self.id, frame_offset=rnd.first_frame, prefix_of=self.parent)
        return job, rows

    def branch(self, new_id: str) -> "EnvState":
        """A copy of this state (frames and rows) drawing with the lineage's next branch seed."""
        return EnvState(new_id, replace(self.sampling, seed=self.lineage.next_seed()), self.lineage,
                        self.context_frames, list(self.tokens), list(self.rows), parent=self.id)
