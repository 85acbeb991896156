"""Compiling the refiner in a process of its own while the engine generates (`CompileApart`).

Why: a scenario run refines beside vLLM in the engine's process (`refiner.stage`). Compiling the
UNet and the VAE decoder there means minutes of Dynamo's tracing and Inductor's lowering on a cold
cache, all Python, and that thread takes the interpreter lock from the engine's loop thread every
time the loop lets go of it (at each blocking CUDA call): on an H200 (2026-11-28, benchmarks/README.md)
the engine made 1 frame in the 149 s of a cold compile (166 s UNet, 62 s VAE decoder) beside it,
the whole process on one core. A child process compiles the same graphs (same weights file, options,
device, dtype and lab switches, so the same Inductor cache keys) into Inductor's on-disk cache
while the engine runs at its own pace; the stage's thread then compiles from that cache (a UNet
variant: 18.9 s from the cache against 87.6 s cold, H100, 2026-11-27), still beside the engine.

GPU memory: the stage keeps its own copy of the weights on the CPU until the child has ended, so the
child has the refiner's share of the card beside vLLM (`decoder.REFINER_GPU_RESERVE_BYTES`, 16 GiB;
a compiled 4-window call peaked at 7.4 GiB with the weights, `terra bench --refiner`, H200, 2026-11-27).

The child is a plain subprocess (`python -m terra_cli.refiner.compile_apart REQUEST_JSON`), with
the parent's environment (CUDA_VISIBLE_DEVICES, TERRA_CACHE, the TERRA_REFINER_* switches); it
prints one JSON line of what it did. Its failure costs nothing but the time: the stage compiles in
its own thread as before, and says why in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from terra_cli.refiner.compiled import resolve_compile_mode
from terra_cli.refiner.refiner import RefinerOptions

STOP_SECONDS = 10.0  # after a terminate, how long the child gets before it is killed


@dataclass(frozen=True)
class CompileRequest:
    """What the child loads and compiles: the refiner's weights file, the device and dtype it runs
    on (`torch.bfloat16` -> "bfloat16"), and the run's options (windows per call, compile mode)."""

    weights: str
    device: str
    dtype: str
    options: RefinerOptions

    def to_json(self) -> str:
        return json.dumps({"weights": self.weights, "device": self.device, "dtype": self.dtype,
                           "options": dataclasses.asdict(self.options)})

    @classmethod
    def from_json(cls, text: str) -> "CompileRequest":
        fields = json.loads(text)
        return cls(str(fields["weights"]), str(fields["device"]), str(fields["dtype"]),
                   RefinerOptions(**fields["options"]))


def compile_request(refiner) -> CompileRequest | None:
    """The request for `refiner` (a `VideoRefiner` loaded by `decoder.load_refiner`), or None when
    there is nothing to compile apart: an eager run (`none`, or `auto` on a CPU), or weights that are
    no file (random weights built in memory)."""
    device = str(refiner.target_device)
    if resolve_compile_mode(refiner.options.compile, device) == "none":
        return None
    if not Path(str(refiner.source)).is_file():
        return None
    return CompileRequest(str(refiner.source), device, str(refiner.dtype).removeprefix("torch."), refiner.options)


class CompileApart:
    """A child process filling Inductor's cache for `request`. `wait()` blocks (without the
    interpreter lock) until it ends; `stop()` ends it early (the run ended first)."""

    def __init__(self, request: CompileRequest, command: Sequence[str] | None = None):
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the child's wall time, once it ended
        self.result: dict | None = None  # its JSON line, when it succeeded
        self.error: str | None = None  # why it did not, in one line
        self._errors = tempfile.TemporaryFile()
        command = list(command or [sys.executable, "-m", "terra_cli.refiner.compile_apart"])
        self.process = subprocess.Popen([*command, request.to_json()], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=self._errors, env=child_environment())

    def wait(self) -> dict | None:
        """The child's result (its JSON line), or None with `error` set."""
        if self.seconds is not None:
            return self.result
        out, _ = self.process.communicate()
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
    root = Path(__file__).resolve().parents[2]
    if not {"site-packages", "dist-packages"} & set(root.parts):
        environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [environ.get("PYTHONPATH")])])
    return environ


def start_compile_apart(refiner, command: Sequence[str] | None = None) -> CompileApart | None:
    """A child compiling `refiner`'s graphs, or None when there is nothing to compile apart."""
    request = compile_request(refiner)
    return None if request is None else CompileApart(request, command)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: load the weights on the device, compile the UNet and the VAE decoder (one call
    each on zeros, as the stage's thread will), print one JSON line."""
    from terra_cli.refiner.compiled import inductor_cache_dir
    from terra_cli.refiner.refiner import VideoRefiner

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m terra_cli.refiner.compile_apart REQUEST_JSON", file=sys.stderr)
        return 2
    request = CompileRequest.from_json(args[0])
    refiner = VideoRefiner.from_checkpoint(request.weights, device=request.device, dtype=request.dtype,
                                           options=request.options)
    unet_s = refiner.prepare()
    refiner.prepare_vae_decoder()
    print(json.dumps({"compile_mode": refiner.compile_mode, "unet_s": round(unet_s, 2),
                      "vae_decoder_s": round(refiner.vae_decoder_compile_seconds, 2),
                      "vae_decoder_error": refiner.vae_decoder_error, "inductor_cache": str(inductor_cache_dir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
