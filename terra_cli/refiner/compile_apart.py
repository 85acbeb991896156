"""The refiner compiled in a process of its own while the engine generates (`start_compile_apart`;
why: `terra_cli/compile_apart.py`).

A scenario run refines beside vLLM in the engine's process (`refiner.stage`): on an H200 (2026-11-28,
benchmarks/README.md) a cold compile there (166 s UNet, 62 s VAE decoder) left the engine 1 frame in
149 s. The child loads the same weights file with the run's options, device and dtype and compiles
the UNet and the VAE decoder by one call each on zeros, as the stage's thread will; the stage then
compiles from the cache (a UNet variant: 18.9 s from the cache against 87.6 s cold, H100, 2026-11-27).

GPU memory: the stage keeps its own copy of the weights on the CPU until the child has ended, so the
child has the refiner's share of the card beside vLLM (`decoder.REFINER_GPU_RESERVE_BYTES`, 16 GiB;
a compiled 4-window call peaked at 7.4 GiB with the weights, `terra bench --refiner`, H200, 2026-11-27).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from terra_cli.compile_apart import CompileApart
from terra_cli.refiner.compiled import resolve_compile_mode
from terra_cli.refiner.refiner import RefinerOptions


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


def start_compile_apart(refiner, command: Sequence[str] | None = None) -> CompileApart | None:
    """A child compiling `refiner`'s graphs (`command`: the child's program, this module's `main` by
    default), or None when there is nothing to compile apart."""
    request = compile_request(refiner)
    if request is None:
        return None
    return CompileApart(request.to_json(), command or [sys.executable, "-m", "terra_cli.refiner.compile_apart"])


def main(argv: Sequence[str] | None = None) -> int:
    """The child: load the weights on the device, compile the UNet and the VAE decoder (one call
    each on zeros, as the stage's thread will), print one JSON line."""
    from terra_cli.compile_apart import begin_child_compile
    from terra_cli.refiner.compiled import inductor_cache_dir
    from terra_cli.refiner.refiner import VideoRefiner

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m terra_cli.refiner.compile_apart REQUEST_JSON", file=sys.stderr)
        return 2
    request = CompileRequest.from_json(args[0])
    refiner = VideoRefiner.from_checkpoint(request.weights, device=request.device, dtype=request.dtype,
                                           options=request.options)
    settings = begin_child_compile()  # after the load: the parent's default dtype must not change it
    unet_s = refiner.prepare()
    refiner.prepare_vae_decoder()
    print(json.dumps({"compile_mode": refiner.compile_mode, "unet_s": round(unet_s, 2),
                      "vae_decoder_s": round(refiner.vae_decoder_compile_seconds, 2),
                      "vae_decoder_error": refiner.vae_decoder_error, "inductor_cache": str(inductor_cache_dir()),
                      "parent_settings": settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
