"""Rich progress bars: frames generated (tokens/s, ETA) and encode/decode steps; one place for all commands."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

# Narrow enough that the counts, rate, elapsed time and ETA fit an 80-column terminal beside the label.
BAR_WIDTH = 24


class RateColumn(ProgressColumn):
    """Items a second, as rich measures them over the last half minute."""

    def render(self, task) -> Text:
        return Text("" if task.speed is None else f"{task.speed:,.1f}/s", style="progress.data.speed")


class FrameProgress:
    def __init__(self, console: Console, total_frames: int, tokens_per_frame: int, rollouts: int = 1):
        self.tokens_per_frame = tokens_per_frame * rollouts
        self.progress = Progress(
            TextColumn("[bold]generating"),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TextColumn("frames  {task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("generate", total=total_frames, rate="")
        self.started = self.last = 0.0
        self.elapsed = 0.0
        self.frame_seconds: list[float] = []

    def __enter__(self):
        self.progress.__enter__()
        self.started = self.last = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.started
        return self.progress.__exit__(*exc)

    def frame_done(self, frame_index: int, frame_tokens) -> None:
        now = time.perf_counter()
        seconds = now - self.last
        self.last = now
        self.frame_seconds.append(seconds)
        rate = f"{self.tokens_per_frame / seconds:,.0f} tok/s" if seconds > 0 else ""
        self.progress.update(self.task, advance=1, rate=rate)


class StepProgress:
    """A progress bar for encoding / decoding, shown only once the step takes over a second."""

    def __init__(self, console: Console, label: str, total: int):
        self.console = console
        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(),
                                 TextColumn("frames"), RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=console, transient=False, auto_refresh=False)
        self.task = self.progress.add_task(label, total=total)
        self.label = label
        self.started = 0.0
        self.shown = False

    def __enter__(self):
        self.started = time.perf_counter()
        return self

    def advance(self, n: int) -> None:
        self.progress.update(self.task, advance=n)
        if not self.shown and time.perf_counter() - self.started > 1.0:
            self.progress.start()
            self.shown = True
        if self.shown:
            self.progress.refresh()

    def __exit__(self, *exc):
        if self.shown:
            self.progress.stop()
        elif exc[0] is None:
            self.console.print(f"{self.label}: {self.progress.tasks[0].completed:.0f} frames in "
                               f"{time.perf_counter() - self.started:.1f} s", highlight=False)
        return False


class TaskProgress:
    """A bar over a count (frames, scenarios) with rate and ETA, and a free note beside the label
    (a stage, a running rate); the note is plain text, never read as markup. `add_bar` puts a
    second count under it (videos written after the frames), with its own rate and ETA."""

    def __init__(self, console: Console, label: str, total: int, unit: str = "frames"):
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), TextColumn("{task.fields[note]}", markup=False),
            BarColumn(bar_width=BAR_WIDTH), MofNCompleteColumn(), TextColumn("{task.fields[unit]}", markup=False),
            RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
        )
        self.task = self.progress.add_task(label, total=total, note="", unit=unit)

    def add_bar(self, label: str, total: int, unit: str):
        """Another bar below, started now: its id for `advance_bar`."""
        return self.progress.add_task(label, total=total, note="", unit=unit)

    def advance_bar(self, bar, n: int = 1) -> None:
        self.progress.update(bar, advance=n)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    @property
    def completed(self) -> float:
        return self.progress.tasks[0].completed

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if note is None:
            self.progress.update(self.task, advance=n)
        else:
            self.progress.update(self.task, advance=n, note=note)

    def note(self, text: str) -> None:
        self.progress.update(self.task, note=text)

    def set(self, completed: int, note: str) -> None:
        self.progress.update(self.task, completed=completed, note=note)


class LazyFrameBar:
    """`bar(done, total)`: a TaskProgress of generated frames (rate, ETA) that appears with the
    first frame, for a library call that reports its progress that way (the benches); `close()`
    ends it. Lines printed on the same console go above it."""

    def __init__(self, console: Console, label: str):
        self.console, self.label = console, label
        self.bar: TaskProgress | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = TaskProgress(self.console, self.label, total, unit="generated frames")
            self.bar.__enter__()
        self.bar.set(done, "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None
