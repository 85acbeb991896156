"""The driver's display of a Ray scenario run: one bar over generated frames (rate, ETA) with a
note of scenarios written, frames/s overall and per engine, and engines alive/restarting; a line
per engine event; a per-engine summary at the end."""

from __future__ import annotations

import time
from typing import Callable

from terra_cli.cli.progress import TaskProgress
from terra_cli.scenarios.ray_hand_out import engine_event_line


class RayDisplay:
    def __init__(self, progress: TaskProgress, say: Callable[[str], None], written: list[int] | None = None):
        self.progress, self.say = progress, say
        self.written = written if written is not None else [0]  # scenarios written by this run
        self.started = time.perf_counter()
        self.sized = False

    def event(self, kind: str, engine, payload) -> None:
        line = engine_event_line(kind, engine, payload)
        if kind == "tick":
            self._tick(payload)
        elif line is not None:
            self.say(line)
        elif kind == "written" and payload.get("status") == "done":
            self.written[0] += 1
        elif kind == "written" and payload.get("status") == "failed":
            self.say(f"scenario {payload['id']} failed: {payload['reason']}")

    def _tick(self, run) -> None:
        now = time.perf_counter()
        bar = self.progress.progress
        if not self.sized:  # resumed scenarios are not part of this run's work
            bar.update(self.progress.task, total=max(run.total_frames, 1))
            self.sized = True
        alive = [e for e in run.engines if e.status == "alive"]
        states = [f"{len(alive)} alive"] + [f"{n} {state}" for state in ("starting", "restarting", "dead")
                                             if (n := sum(e.status == state for e in run.engines))]
        rate = sum(e.frames_per_second(now) for e in run.engines)
        per_engine = " ".join(f"e{e.index} {e.frames_per_second(now):.1f}" for e in run.engines if e.first_ready)
        note = f"{run.done}/{run.total} written · engines {', '.join(states)}"
        if per_engine:
            note += f" · {rate:.1f} frames/s ({per_engine})"
        bar.update(self.progress.task, completed=min(run.progress_frames, run.total_frames), note=note)

    def summary(self, run) -> None:
        for row in run.summary():
            restarts = (f", {row['restarts']} restart(s), {row['lost_frames']} frames lost with it"
                        if row["restarts"] else "")
            self.say(f"engine {row['engine']} on {row['node'] or '?'} ({row['status']}): {row['scenarios']} scenario(s) "
                     f"= {row['share']:.0f}% of those written, {row['frames']} frames, "
                     f"{row['frames_per_s']:.2f} frames/s{restarts}")
        if run.requeued:
            self.say(f"{run.requeued} scenario(s) handed out again after an engine died or a scenario failed")
