"""Compiling in a process of its own while the engine generates (`CompileApart`).

Why: terra compiles two things in the engine's process after the engine is up: the refiner
(`refiner/compile_apart.py`) and the tokenizer's decoder that decodes frames ahead
(`scenarios/decoder_compile_apart.py`). Dynamo's tracing and Inductor's lowering are minutes of
Python on a cold cache, and that thread takes the interpreter lock from the engine's loop thread
every time the loop lets go of it (at each blocking CUDA call): on an H200 the engine made 1 frame
in the 149 s of a cold refiner compile beside it (benchmarks/README.md, 2026-11-28). A child process
compiles the same graphs (same weights, shapes, options, device and lab switches, so the same cache
keys) into Inductor's on-disk cache while the engine runs at its own pace; the parent then compiles
from that cache (on a CPU: a tiny refiner's UNet 14 s against 121 s cold, every graph a cache hit,
`benchmarks/scripts/cpu_compile_apart.py`).

The child is a plain subprocess (`python -m MODULE REQUEST_JSON`) with the parent's environment
(CUDA_VISIBLE_DEVICES, TERRA_CACHE, the lab switches); it prints one JSON line of what it did. Its
failure costs nothing but the time: the parent compiles itself, as it would have.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

STOP_SECONDS = 10.0  # after a terminate, how long the child gets before it is killed


class CompileApart:
    """A child process (`command` + [request_json]) filling Inductor's cache. `wait()` blocks
    (without the interpreter lock) until it ends; `stop()` ends it early (the run ended first)."""

    def __init__(self, request_json: str, command: Sequence[str]):
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the child's wall time, once it ended
        self.result: dict | None = None  # its JSON line, when it succeeded
        self.error: str | None = None  # why it did not, in one line
        self._errors = tempfile.TemporaryFile()
        self.process = subprocess.Popen([*command, request_json], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=self._errors, env=child_environment())

    def wait(self, timeout: float | None = None) -> dict | None:
        """The child's result (its JSON line), or None with `error` set. A child still running after
        `timeout` seconds from its start is ended (a hung compile must not hold its parent forever)."""
        if self.seconds is not None:
            return self.result
        left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - self.started))
        try:
            out, _ = self.process.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.stop()
            out, _ = self.process.communicate()
            self.seconds = time.perf_counter() - self.started
            self.error = f"still compiling after {timeout:g} s: ended"
            self._errors.close()
            return None
        self.seconds = time.perf_counter() - self.started
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if self.process.returncode == 0 and lines:
            try:
                self.result = json.loads(lines[-1])
            except ValueError:
                self.error = f"its last line is no JSON: {lines[-1][:200]!r}"
        else:
            self.error = f"exit {self.process.returncode}: {self._last_error_line()}"
        self._errors.close()
        return self.result

    @property
    def succeeded_seconds(self) -> float | None:
        """The child's seconds (2 decimals) if it compiled; None while it runs, or if it failed."""
        return round(self.seconds, 2) if self.result is not None else None

    def failure_line(self, what: str) -> str:
        """The one line a parent logs when the child failed and it compiles `what` itself."""
        return f"{what}: compiling apart failed after {self.seconds:.1f} s ({self.error}); compiling here, beside the engine"

    def stop(self) -> None:
        """End the child if it still runs (safe to call twice, and after `wait`); a `wait` in
        another thread then returns with the child's exit status as its error."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _last_error_line(self) -> str:
        self._errors.seek(0)
        lines = [line.strip() for line in self._errors.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else "no message"


def child_environment(environ=None) -> dict:
    """The parent's environment, where terra runs from a source folder (not an installed package)
    with that folder first on PYTHONPATH: the child then runs the parent's terra, whatever its own
    working directory (a Ray worker's) or the interpreter's installed copy would give."""
    environ = dict(os.environ if environ is None else environ)
    root = Path(__file__).resolve().parents[1]
    if not {"site-packages", "dist-packages"} & set(root.parts):
        environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [environ.get("PYTHONPATH")])])
    return environ
