"""The tokenizer's decoder compiled in a process of its own while the engine generates
(`start_decoder_compile_apart`; why: `terra_cli/compile_apart.py`).

A writer that decodes frames ahead in the engine's process (`local_writer.InProcessWriter`, the
default on one engine and on a Ray engine actor) compiles the decoder at its first batch. On a cold
cache that is ~31 s of Dynamo and Inductor in the engine's process, just as the first frames come:
on a fresh H200 the first frame came 40 s later with videos than without, the intake's encoding
taking 43.8 s against 14.8 s warm beside it (benchmarks/README.md, 2026-11-28). Here a child loads
the same tokenizer folder on the same device with the same batch size and compiles the decoder by
one full batch of zeros (the shapes every decode-ahead batch has); the writer's thread waits for
the child before its first batch (the frames wait meanwhile; the engine does not) and then
compiles from Inductor's cache.

Writer processes (`--writers N`) compile in their own processes already: they start no child.
TERRA_DECODER_COMPILE_APART=0 compiles in the writer's thread as before (to compare).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Sequence

from terra_cli.compile_apart import CompileApart

COMPILE_APART_ENV = "TERRA_DECODER_COMPILE_APART"


def decoder_request(decoder) -> str | None:
    """The child's request for `decoder` (a loaded `ImageTokenizer`) as JSON, or None when the
    decode-ahead will not compile it (not on CUDA, TERRA_DECODER_COMPILE=0), it cannot be loaded
    again from a folder (random weights in memory), or TERRA_DECODER_COMPILE_APART=0."""
    from terra_cli.runtime import switched_off
    from terra_cli.scenarios.frame_store import decoder_compiles
    from terra_cli.scenarios.writer_process import DecoderSpec

    if switched_off(COMPILE_APART_ENV) or not decoder_compiles(decoder):
        return None
    spec = DecoderSpec.of(decoder)
    return None if spec is None else json.dumps({**spec, "image_size": list(spec["image_size"])})


def start_decoder_compile_apart(decoder, command: Sequence[str] | None = None) -> CompileApart | None:
    """A child compiling `decoder` into Inductor's cache, or None when there is nothing to compile
    apart. `command`: the child's program (this module's `main` by default)."""
    request = decoder_request(decoder)
    if request is None:
        return None
    return CompileApart(request, command or [sys.executable, "-m", "terra_cli.scenarios.decoder_compile_apart"])


def main(argv: Sequence[str] | None = None) -> int:
    """The child: load the tokenizer as the parent has it, compile its decoder as the decode-ahead
    does (`frame_store.compile_decoder`), decode one full batch of zeros, print one JSON line."""
    import numpy as np

    from tokenizer_decoder import ImageTokenizer

    from terra_cli.compile_apart import begin_child_compile
    from terra_cli.refiner.compiled import inductor_cache_dir
    from terra_cli.scenarios.frame_store import compile_decoder

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m terra_cli.scenarios.decoder_compile_apart REQUEST_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    decoder = ImageTokenizer.from_pretrained(spec["source"], device=spec["device"], batch_size=spec["batch_size"],
                                             image_size=tuple(spec["image_size"]))
    settings = begin_child_compile()  # after the load: the parent's default dtype must not change it
    compiled = compile_decoder(decoder)
    began = time.perf_counter()
    decoder.decode_tokens(np.zeros((decoder.batch_size, decoder.tokens_per_frame), dtype=np.int64), full_batches=True)
    print(json.dumps({"compiled": compiled, "seconds": round(time.perf_counter() - began, 2),
                      "decoder_compile_error": decoder.decoder_compile_error,
                      "inductor_cache": str(inductor_cache_dir()), "parent_settings": settings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
