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

The same environment is not the same cache key. Inductor's key also holds its options and a few
torch globals (matmul precision, the default dtype, deterministic algorithms) as the process has them
when it compiles, and the engine's process is not a fresh interpreter: vLLM's GPU worker, for one,
calls `torch.set_float32_matmul_precision("highest")` at its start, which turns the key's
`torch.backends.cuda.matmul.fp32_precision` from "none" to "ieee". On an H200 (2026-11-28,
benchmarks/README.md) the decoder's child compiled in 71 s and the parent's compile after it still
ran Inductor's compile workers for 34 s, the engine near idle meanwhile: a miss (that setting is the
likely cause; tests/test_compile_settings.py reproduces it on a CPU). So the parent hands the child
its settings (`parent_compile_settings`, in the child's environment), each child takes them before
it compiles (`begin_child_compile`, at a lower CPU priority), and the parent's engine line counts
its own compile's cache hits and misses (`fx_cache_counts`), so the next run shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

STOP_SECONDS = 10.0  # after a terminate, how long the child gets before it is killed
SETTINGS_ENV = "TERRA_COMPILE_SETTINGS"  # the parent's compile settings, JSON, in the child's environment
_PLAIN = (bool, int, float, str, type(None))  # option values that travel as JSON unchanged


class CompileApart:
    """A child process (`command` + [request_json]) filling Inductor's cache. `wait()` blocks
    (without the interpreter lock) until it ends; `stop()` ends it early (the run ended first).

    Its output goes to files, not pipes, and a thread stamps the moment it ends: a parent may first
    wait long after the child is done (`--videos-at-end` waits once the engine is done). With a pipe
    read only at that wait, a child that wrote more than a pipe holds would hang on it meanwhile, its
    seconds would be counted to the wait, and a child done long before a wait past `timeout` was
    reported as still compiling (on 2026-12-06 three runs read 223-344 s: their engines' seconds, not
    the child's; benchmarks/README.md)."""

    def __init__(self, request_json: str, command: Sequence[str]):
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the child's wall time, once it ended
        self.result: dict | None = None  # its JSON line, when it succeeded
        self.error: str | None = None  # why it did not, in one line
        self._output = tempfile.TemporaryFile()
        self._errors = tempfile.TemporaryFile()
        self.process = subprocess.Popen([*command, request_json], stdin=subprocess.DEVNULL,
                                        stdout=self._output, stderr=self._errors,
                                        env={**child_environment(), SETTINGS_ENV: json.dumps(parent_compile_settings())})
        self._ended_at: float | None = None
        self._reaper = threading.Thread(target=self._reap, name="compile-apart-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        self.process.wait()
        self._ended_at = time.perf_counter()

    def wait(self, timeout: float | None = None) -> dict | None:
        """The child's result (its JSON line), or None with `error` set. A child still running after
        `timeout` seconds from its start is ended (a hung compile must not hold its parent forever);
        one that ended before, however long ago, is read."""
        if self.seconds is not None:
            return self.result
        left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - self.started))
        self._reaper.join(left)
        if self._reaper.is_alive():
            self.stop()
            self._reaper.join()
            self.error = f"still compiling after {timeout:g} s: ended"
        self.seconds = self._ended_at - self.started
        if self.error is None:
            self._read_result()
        self._output.close()
        self._errors.close()
        return self.result

    def _read_result(self) -> None:
        self._output.seek(0)
        lines = [line for line in self._output.read().decode(errors="replace").splitlines() if line.strip()]
        if self.process.returncode == 0 and lines:
            try:
                self.result = json.loads(lines[-1])
            except ValueError:
                self.error = f"its last line is no JSON: {lines[-1][:200]!r}"
        else:
            self.error = f"exit {self.process.returncode}: {self._last_error_line()}"

    @property
    def succeeded_seconds(self) -> float | None:
        """The child's seconds (2 decimals) if it compiled; None while it runs, or if it failed."""
        return round(self.seconds, 2) if self.result is not None else None

    def settings_note(self) -> str:
        """What the child took of this process's compile settings (`adopt_parent_compile_settings`),
        for the parent's log line: the names that differed in a fresh interpreter, and any refused."""
        report = (self.result or {}).get("parent_settings") or {}
        taken, refused = report.get("adopted", []), report.get("refused", {})
        note = f"{len(taken)} compile setting(s) of this process taken" + (
            f" ({', '.join(taken[:6])}{', ...' if len(taken) > 6 else ''})" if taken else "")
        if refused:
            note += f", {len(refused)} refused ({'; '.join(f'{name}: {why}' for name, why in refused.items())})"
        return note

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


def parent_compile_settings() -> dict:
    """This process's state that enters Inductor's FX-graph cache key and can travel as JSON:
    Inductor's options with plain values (those its key ignores left out, `compile_threads` kept:
    it sets how fast the child compiles), and the torch globals the key reads."""
    import torch
    from torch._inductor import config

    try:
        options = config.save_config_portable(ignore_private_configs=False)
    except TypeError:  # a torch whose save_config_portable has no such argument
        options = config.save_config_portable()
    options = {name: value for name, value in options.items() if type(value) in _PLAIN}
    options["compile_threads"] = config.compile_threads
    matmul = torch.backends.cuda.matmul
    return {
        "inductor": options,
        "matmul": {name: getattr(matmul, name) for name in
                   ("fp32_precision", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
                   if hasattr(matmul, name)},
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
    }


CHILD_NICENESS = 10  # a child's CPU priority below the engine's; its compile workers inherit it


def begin_child_compile() -> dict:
    """In a child, before it compiles: yield the CPU to the engine's threads (the parent's compile
    threads setting, which the child takes, may start a compile worker per core), then take the
    parent's compile settings. Returns `adopt_parent_compile_settings`'s report."""
    try:
        os.nice(CHILD_NICENESS)
    except OSError:  # not allowed here: the compile still runs, at the parent's priority
        pass
    return adopt_parent_compile_settings()


def adopt_parent_compile_settings(environ=None) -> dict:
    """In a child: take the parent's settings (SETTINGS_ENV) where they differ from this process's.
    Returns {"adopted": names, "refused": {name: why}} for the child's JSON line; none set: both empty."""
    import torch
    from torch._inductor import config

    environ = os.environ if environ is None else environ
    report: dict = {"adopted": [], "refused": {}}
    if not environ.get(SETTINGS_ENV):
        return report
    wanted = json.loads(environ[SETTINGS_ENV])
    mine = parent_compile_settings()

    def adopt(name: str, apply) -> None:
        try:
            apply()
            report["adopted"].append(name)
        except Exception as error:  # noqa: BLE001 - one setting refused leaves the others (the key may still match)
            report["refused"][name] = f"{type(error).__name__}: {error}"[:200]

    for name, value in wanted.get("inductor", {}).items():
        if mine["inductor"].get(name, value) != value or name not in mine["inductor"]:
            adopt(f"inductor.{name}", lambda name=name, value=value: setattr(config, name, value))
    for name, value in wanted.get("matmul", {}).items():
        if mine["matmul"].get(name) != value:
            adopt(f"matmul.{name}", lambda name=name, value=value: setattr(torch.backends.cuda.matmul, name, value))
    if wanted.get("default_dtype", mine["default_dtype"]) != mine["default_dtype"]:
        adopt("default_dtype", lambda: torch.set_default_dtype(getattr(torch, wanted["default_dtype"])))
    if wanted.get("deterministic", mine["deterministic"]) != mine["deterministic"]:
        enabled, warn_only = wanted["deterministic"]
        adopt("deterministic", lambda: torch.use_deterministic_algorithms(enabled, warn_only=warn_only))
    return report


def fx_cache_counts() -> tuple[int, int]:
    """Inductor's FX-graph cache (hits, misses) in this process so far: a parent's compile after its
    child should add hits only. (0, 0) while Dynamo was never imported: nothing compiled yet, and an
    eager decoder's process need not import it."""
    import sys

    if "torch._dynamo.utils" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
