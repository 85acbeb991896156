"""Malformed inputs across every command, in process: each must end in exactly one `error:` line,
exit code 2, no traceback, and no file created or changed. Every case fails during validation,
before a model runs, so the whole file stays fast."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.cli import app
from terra_cli.models.default import default_tokenizer_dir
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

TOKENS = 16


def _png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header for a huge image with almost no data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _damaged(arena: Path, good: Path, name: str, config_edit=None, config_bytes: bytes | None = None,
             weights: bytes | None = None, index: dict | None = None) -> Path:
    target = arena / name
    target.mkdir()
    config = json.loads((good / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (target / "config.json").write_bytes(config_bytes if config_bytes is not None else json.dumps(config).encode())
    if index is not None:
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        (target / "model.safetensors").write_bytes(weights if weights is not None else
                                                   (good / "model.safetensors").read_bytes())
    return target


@pytest.fixture(scope="module")
def arena(tmp_path_factory) -> Path:
    arena = tmp_path_factory.mktemp("fuzz")
    good = write_tiny_checkpoint(arena / "good", tiny_config(image_tokens=TOKENS, layers=1))
    weights = (good / "model.safetensors").read_bytes()
    rng = np.random.default_rng(0)
    np.save(arena / "ctx.npy", rng.integers(0, 512, size=(2, TOKENS)))
    np.save(arena / "ctx_wide.npy", rng.integers(0, 512, size=(2, TOKENS + 1)))
    np.save(arena / "ctx_float.npy", rng.random((2, TOKENS)))
    np.save(arena / "ctx_3d.npy", rng.integers(0, 512, size=(2, 2, TOKENS)))
    np.save(arena / "ctx_out_of_vocab.npy", np.full((2, TOKENS), 10**6))
    np.save(arena / "acts.npy", np.zeros((30, 6, 3), dtype=np.float32))
    acts_nan = np.zeros((30, 6, 3), dtype=np.float32)
    acts_nan[3, 2, 1] = np.nan
    np.save(arena / "acts_nan.npy", acts_nan)
    np.save(arena / "acts_shape.npy", np.zeros((5, 4), dtype=np.float32))
    np.save(arena / "acts_empty.npy", np.zeros((0, 6, 3), dtype=np.float32))
    np.save(arena / "acts_object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (arena / "acts_text.npy").write_text("not an array")
    (arena / "acts_bad.json").write_text("{not json")
    (arena / "acts_list.json").write_text("[1, 2, 3]")
    (arena / "acts_deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (arena / "acts_huge_number.json").write_text('{"instruction_trajs": [[[1e999, 0]]]}')
    (arena / "acts_latin1.json").write_bytes(b'{"instruction_trajs": "\xff\xfe"}')
    (arena / "acts_short_traj.json").write_text(json.dumps({"instruction_trajs": [[[0.0, 0.0]] * 10] * 5}))
    (arena / "not_image.png").write_text("this is text")
    from PIL import Image

    Image.new("RGB", (64, 36)).save(arena / "frame.png")
    (arena / "nested").mkdir()
    Image.new("RGB", (64, 36)).save(arena / "nested" / "frame.png")
    (arena / "bomb.png").write_bytes(_png_claiming(100_000, 100_000))
    (arena / "images").mkdir()
    (arena / "empty_dir").mkdir()
    (arena / "a_folder.npy").mkdir()
    (arena / "existing.npy").write_bytes(b"keep me")
    (arena / "existing.json").write_bytes(b"keep me")
    bad_jsonl = ['{"id": "a", "actions": "sideways"}', "not json", '{"id": "../x", "actions": "left"}']
    (arena / "bad.jsonl").write_text("\n".join(bad_jsonl) + "\n")
    (arena / "empty.jsonl").write_text("\n# only a comment\n")
    (arena / "dup.jsonl").write_text('{"id": "a", "actions": "left"}\n{"id": "a", "actions": "left"}\n')
    (arena / "nan.jsonl").write_text('{"id": "a", "actions": "left", "speed": NaN}\n')
    (arena / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (arena / "act_missing_images.jsonl").write_text(json.dumps(
        {"sample_id": 1, "context_frames": ["nope.jpg"], "instruction_trajs": [[[0.0, 0.0]] * 60] * 47}) + "\n")

    # Inputs that are not regular files: a named pipe blocks open() forever, so every reader must
    # refuse it from os.stat first.
    for name in ("fifo.png", "fifo.npy", "fifo.mp4", "fifo.json"):
        os.mkfifo(arena / name)
    (arena / "fifo_config").mkdir()
    os.mkfifo(arena / "fifo_config" / "config.json")
    (arena / "fifo_config" / "model.safetensors").write_bytes(weights)
    # .npy files whose header numpy cannot parse, or that promise more data than they hold.
    (arena / "garbage_header.npy").write_bytes(b"\x93NUMPY\x01\x00" + (70).to_bytes(2, "little")
                                               + b"(" * 69 + b"\n" + b"\0" * 64)
    with open(arena / "huge_header.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**12, TOKENS)})
        f.write(b"\0" * 64)
    with open(arena / "truncated.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (1000, TOKENS)})
        f.write(b"\0" * 64)
    np.save(arena / "acts_beyond_float32.npy", np.full((30, 6, 3), 1e39))
    (arena / "$\\foo$.npy").write_bytes((arena / "acts.npy").read_bytes())
    (arena / "a_file").write_text("a file, not a folder")
    from safetensors.numpy import load_file, save_file

    int_weights = arena / "int_weights"
    int_weights.mkdir()
    (int_weights / "config.json").write_bytes((good / "config.json").read_bytes())
    save_file({k: v.astype(np.int32) for k, v in load_file(good / "model.safetensors").items()},
              str(int_weights / "model.safetensors"))
    _damaged(arena, good, "garbage_weights", weights=bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))
    _damaged(arena, good, "truncated_weights", weights=weights[:100])
    _damaged(arena, good, "absurd_header", weights=struct.pack("<Q", 2**62) + b"{}")
    _damaged(arena, good, "config_list", config_bytes=b"[1, 2]")
    _damaged(arena, good, "config_latin1", config_bytes=b'{"model_type": "\xff"}')
    _damaged(arena, good, "config_not_json", config_bytes=b"{model_type")
    _damaged(arena, good, "heads_string", lambda c: c.update(num_attention_heads="two"))
    _damaged(arena, good, "heads_zero", lambda c: c.update(num_attention_heads=0))
    _damaged(arena, good, "heads_mismatch", lambda c: c.update(num_key_value_heads=3))
    _damaged(arena, good, "dtype_unknown", lambda c: c.update(torch_dtype="float7"))
    _damaged(arena, good, "rope_unknown", lambda c: c.update(rope_scaling={"rope_type": "warp-drive", "factor": 2.0}))
    _damaged(arena, good, "layers_huge", lambda c: c.update(num_hidden_layers=10**9))
    _damaged(arena, good, "vocab_negative", lambda c: c.update(vocab_size=-5))
    _damaged(arena, good, "shard_escapes", index={"weight_map": {"lm_head.weight": "../good/model.safetensors"}})
    _damaged(arena, good, "shard_absolute", index={"weight_map": {"lm_head.weight": "/etc/passwd"}})
    _damaged(arena, good, "index_not_object", index=["model.safetensors"])  # type: ignore[arg-type]
    (arena / "no_config").mkdir()
    (arena / "m[/x]").mkdir(parents=True)
    np.save(arena / "tokens25.npy", rng.integers(0, 1024, size=(25, 576)))
    _refiner_config_only(arena / "refiner_window0.pt", window=0)
    _refiner_config_only(arena / "refiner_heads0.pt", head_channels=0)
    _refiner_config_only(arena / "refiner_steps_negative.pt", steps=-1)
    _refiner_config_only(arena / "refiner_width_string.pt", model_channels="32")
    (arena / "refiner_empty.pt").write_bytes(b"")
    (arena / "loop_a.png").symlink_to(arena / "loop_b.png")
    (arena / "loop_b.png").symlink_to(arena / "loop_a.png")  # the folder "x]" inside "m[": rich markup in a path
    return arena


def _refiner_config_only(path: Path, **changes) -> None:
    """A refiner file whose config is damaged: refused before any tensor is looked at."""
    import torch

    from terra_cli.refiner.checkpoint import CONFIG_KEY
    from terra_cli.refiner.config import tiny_refiner_config

    torch.save({"module": {}, CONFIG_KEY: json.dumps({**tiny_refiner_config().to_dict(), **changes})}, path)


def _refine(arena: Path, refiner: str) -> list[str]:
    return ["refine", str(arena / "tokens25.npy"), str(arena / "r.mp4"), "--refiner", str(arena / refiner),
            "--device", "cpu"]


def _generate(arena: Path, *extra, model: str = "good") -> list[str]:
    base = {"--model": str(arena / model), "--context-tokens": str(arena / "ctx.npy"), "--actions": str(arena / "acts.npy"),
            "--frames": "4", "--backend": "hf", "--device": "cpu", "--save-tokens": str(arena / "out.npy")}
    args = list(extra)
    if "--context" in args:
        del base["--context-tokens"]
    for key in list(base):
        if key in args:
            del base[key]
    return ["generate", "--no-decode", *[x for pair in base.items() for x in pair], *args]


def _scenarios(arena: Path, file: str, *extra) -> list[str]:
    return ["generate", "--scenarios", str(arena / file), "--out-dir", str(arena / "scen_out"),
            "--model", str(arena / "good"), "--backend", "hf", "--no-decode", *extra]


CASES = {
    # generate: numbers at the edges
    "temperature nan": lambda a: _generate(a, "--temperature", "nan"),
    "temperature inf": lambda a: _generate(a, "--temperature", "inf"),
    "temperature negative": lambda a: _generate(a, "--temperature", "-1"),
    "top-k negative": lambda a: _generate(a, "--top-k", "-3"),
    "top-p zero": lambda a: _generate(a, "--top-p", "0"),
    "top-p above one": lambda a: _generate(a, "--top-p", "1.5"),
    "top-p nan": lambda a: _generate(a, "--top-p", "nan"),
    "seed beyond 64 bits": lambda a: _generate(a, "--seed", str(2**70)),
    "seed negative": lambda a: _generate(a, "--seed", "-1"),
    "frames huge": lambda a: _generate(a, "--frames", str(10**12)),
    "frames one": lambda a: _generate(a, "--frames", "1"),
    "threads beyond the OS": lambda a: _generate(a, "--threads", str(10**7)),
    "speed nan": lambda a: _generate(a, "--actions", "left", "--speed", "nan"),
    "speed negative": lambda a: _generate(a, "--actions", "left", "--speed", "-10"),
    "dtype unknown": lambda a: _generate(a, "--dtype", "float7"),
    "device unknown": lambda a: _generate(a, "--device", "tpu"),
    "device absent gpu": lambda a: _generate(a, "--device", "cuda:3"),
    "backend unknown": lambda a: _generate(a, "--backend", "onnx"),
    "quantization unknown": lambda a: _generate(a, "--quantization", "int3"),
    "kv cache dtype unknown": lambda a: _generate(a, "--kv-cache-dtype", "int2"),
    "attention unknown": lambda a: _generate(a, "--attention", "flashinfer"),
    "attention terra with a draft": lambda a: _generate(a, "--attention", "terra", "--draft", "previous-frame"),
    "vllm option with the hf backend": lambda a: _generate(a, "--no-torch-compile"),
    "scenario option without scenarios": lambda a: _generate(a, "--data-parallel", "2"),
    # generate: inputs
    "context tokens too wide": lambda a: _generate(a, "--context-tokens", str(a / "ctx_wide.npy")),
    "context tokens float": lambda a: _generate(a, "--context-tokens", str(a / "ctx_float.npy")),
    "context tokens 3d": lambda a: _generate(a, "--context-tokens", str(a / "ctx_3d.npy")),
    "context tokens out of vocabulary": lambda a: _generate(a, "--context-tokens", str(a / "ctx_out_of_vocab.npy")),
    "context tokens missing": lambda a: _generate(a, "--context-tokens", str(a / "nope.npy")),
    "context image not an image": lambda a: _generate(a, "--context", str(a / "not_image.png")),
    "context image bomb": lambda a: _generate(a, "--context", str(a / "bomb.png")),
    "context folder empty": lambda a: _generate(a, "--context", str(a / "empty_dir")),
    "context and tokens both": lambda a: _generate(a, "--context", str(a / "not_image.png"), "--context-tokens",
                                                   str(a / "ctx.npy")),
    "actions nan": lambda a: _generate(a, "--actions", str(a / "acts_nan.npy")),
    "actions wrong shape": lambda a: _generate(a, "--actions", str(a / "acts_shape.npy")),
    "actions empty": lambda a: _generate(a, "--actions", str(a / "acts_empty.npy")),
    "actions pickled objects": lambda a: _generate(a, "--actions", str(a / "acts_object.npy")),
    "actions npy is text": lambda a: _generate(a, "--actions", str(a / "acts_text.npy")),
    "actions json broken": lambda a: _generate(a, "--actions", str(a / "acts_bad.json")),
    "actions json list": lambda a: _generate(a, "--actions", str(a / "acts_list.json")),
    "actions json deeply nested": lambda a: _generate(a, "--actions", str(a / "acts_deep.json")),
    "actions json huge number": lambda a: _generate(a, "--actions", str(a / "acts_huge_number.json")),
    "actions json not utf-8": lambda a: _generate(a, "--actions", str(a / "acts_latin1.json")),
    "actions trajectory too short": lambda a: _generate(a, "--actions", str(a / "acts_short_traj.json")),
    "actions unknown preset": lambda a: _generate(a, "--actions", "sideways"),
    "actions too few frames": lambda a: _generate(a, "--actions", str(a / "acts.npy"), "--frames", "40"),
    # generate: outputs
    "output under /proc": lambda a: _generate(a, "--save-tokens", "/proc/terra-fuzz.npy"),
    "output name too long": lambda a: _generate(a, "--save-tokens", str(a / ("x" * 300 + ".npy"))),
    "output exists": lambda a: _generate(a, "--save-tokens", str(a / "existing.npy")),
    "overwrite onto a folder": lambda a: _generate(a, "--save-tokens", str(a / "a_folder.npy"), "--overwrite"),
    "output wrong suffix": lambda a: _generate(a, "--save-tokens", str(a / "out.txt")),
    "no decode without save tokens": lambda a: [x for x in _generate(a) if x not in ("--save-tokens", str(a / "out.npy"))],
    # generate: damaged or hostile checkpoints
    **{f"checkpoint {name}": (lambda name: lambda a: _generate(a, model=name))(name) for name in (
        "garbage_weights", "truncated_weights", "absurd_header", "config_list", "config_latin1", "config_not_json",
        "heads_string", "heads_zero", "heads_mismatch", "dtype_unknown", "rope_unknown", "layers_huge",
        "vocab_negative", "shard_escapes", "shard_absolute", "index_not_object", "no_config")},
    "model missing": lambda a: _generate(a, model="nowhere"),
    "model path with markup": lambda a: _generate(a, model="m[/x]"),
    # generate --scenarios
    "scenarios bad lines": lambda a: _scenarios(a, "bad.jsonl"),
    "scenarios none": lambda a: _scenarios(a, "empty.jsonl"),
    "scenarios duplicate id": lambda a: _scenarios(a, "dup.jsonl"),
    "scenarios nan speed": lambda a: _scenarios(a, "nan.jsonl"),
    "scenarios binary file": lambda a: _scenarios(a, "binary.jsonl"),
    "scenarios missing file": lambda a: _scenarios(a, "nope.jsonl"),
    "scenarios act-bench images missing": lambda a: _scenarios(a, "act_missing_images.jsonl"),
    "scenarios image root missing": lambda a: _scenarios(a, "dup.jsonl", "--image-root", str(a / "nope")),
    "scenarios out-dir is a file": lambda a: _scenarios(a, "dup.jsonl", "--out-dir", str(a / "existing.npy")),
    "scenarios with output": lambda a: _scenarios(a, "dup.jsonl") + [str(a / "x.mp4")],
    # tokenize
    "tokenize missing input": lambda a: ["tokenize", str(a / "nope"), "--out", str(a / "t.npy")],
    "tokenize not an image": lambda a: ["tokenize", str(a / "not_image.png"), "--out", str(a / "t.npy")],
    "tokenize bomb": lambda a: ["tokenize", str(a / "bomb.png"), "--out", str(a / "t.npy")],
    "tokenize empty folder": lambda a: ["tokenize", str(a / "empty_dir"), "--out", str(a / "t.npy")],
    "tokenize output exists": lambda a: ["tokenize", str(a / "ctx.npy"), "--out", str(a / "existing.npy")],
    "tokenize device unknown": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.npy"), "--device", "qpu"],
    "tokenize output wrong suffix": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.png")],
    "tokenize tokenizer missing": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.npy"), "--tokenizer",
                                             str(a / "no_tokenizer")],
    "tokenize tokenizer is a world model": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.npy"),
                                                      "--tokenizer", str(a / "good")],
    "tokenize reconstruct onto a file": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.npy"),
                                                   "--reconstruct", str(a / "existing.npy")],
    # actions
    "actions convert no frames": lambda a: ["actions", "convert", "left", str(a / "c.npy")],
    "actions convert huge frames": lambda a: ["actions", "convert", "left", str(a / "c.npy"), "--frames", str(10**9)],
    "actions convert nan": lambda a: ["actions", "convert", str(a / "acts_nan.npy"), str(a / "c.npy")],
    "actions convert wrong suffix": lambda a: ["actions", "convert", "left", str(a / "c.txt"), "--frames", "3"],
    "actions convert exists": lambda a: ["actions", "convert", "left", str(a / "existing.npy"), "--frames", "3"],
    "actions convert deep json": lambda a: ["actions", "convert", str(a / "acts_deep.json"), str(a / "c.npy")],
    "actions plot wrong shape": lambda a: ["actions", "plot", str(a / "acts_shape.npy"), str(a / "p.png")],
    "actions plot negative speed": lambda a: ["actions", "plot", "stop", str(a / "p.png"), "--frames", "3", "--speed", "-5"],
    "actions plot under /proc": lambda a: ["actions", "plot", "left", "/proc/terra.png", "--frames", "3"],
    # eval, bench, info
    "eval tokenizer is a world model": lambda a: ["eval", "--model", str(a / "good"), "--tokenizer", str(a / "good"),
                                                  "--out", str(a / "e.json")],
    "eval damaged checkpoint": lambda a: ["eval", "--model", str(a / "config_list"), "--tokenizer",
                                          str(default_tokenizer_dir()), "--out", str(a / "e.json")],
    "eval frames below context": lambda a: ["eval", "--frames", "2", "--context-frames", "3", "--out", str(a / "e.json")],
    "eval temperature nan": lambda a: ["eval", "--temperature", "nan", "--out", str(a / "e.json")],
    "eval dtype unknown": lambda a: ["eval", "--dtype", "int4", "--out", str(a / "e.json")],
    "bench nothing to measure": lambda a: ["bench"],
    "bench two things": lambda a: ["bench", "--hf-vs-vllm", "--scenarios", "3"],
    "bench bad batch list": lambda a: ["bench", "--hf-vs-vllm", "--batch", "1,x", "--model", str(a / "good")],
    "bench vllm arg without value": lambda a: ["bench", "--hf-vs-vllm", "--vllm-arg", "novalue", "--model", str(a / "good")],
    "bench frames below context": lambda a: ["bench", "--hf-vs-vllm", "--frames", "2", "--context-frames", "3"],
    "bench temperatures nan": lambda a: ["bench", "--draft-acceptance", "--temperatures", "nan"],
    "bench kv cache dtype unknown": lambda a: ["bench", "--scenarios", "3", "--kv-cache-dtype", "fp9"],
    "bench output exists": lambda a: ["bench", "--hf-vs-vllm", "--out", str(a / "existing.json"), "--model", str(a / "good")],
    "bench out not json": lambda a: ["bench", "--hf-vs-vllm", "--out", str(a / "existing.npy"), "--model", str(a / "good")],
    # issue 30: named pipes and other non-files as inputs
    "context image is a fifo": lambda a: _generate(a, "--context", str(a / "fifo.png")),
    "context video is a fifo": lambda a: _generate(a, "--context", str(a / "fifo.mp4")),
    "context tokens are a fifo": lambda a: _generate(a, "--context-tokens", str(a / "fifo.npy")),
    "actions npy is a fifo": lambda a: _generate(a, "--actions", str(a / "fifo.npy")),
    "actions json is a fifo": lambda a: _generate(a, "--actions", str(a / "fifo.json")),
    "actions device": lambda a: _generate(a, "--actions", "/dev/zero"),
    "checkpoint config is a fifo": lambda a: _generate(a, model="fifo_config"),
    "tokenize fifo": lambda a: ["tokenize", str(a / "fifo.png"), "--out", str(a / "t.npy")],
    "tokenize device": lambda a: ["tokenize", "/dev/zero", "--out", str(a / "t.npy")],
    "actions convert fifo": lambda a: ["actions", "convert", str(a / "fifo.npy"), str(a / "c.npy")],
    # issue 30: two outputs on one path, an output that is an input or holds one
    # --out must end in .json, --plot and --strip in .png: one path cannot be both (the suffix says so first)
    "eval out and plot one path": lambda a: ["eval", "--out", str(a / "r.png"), "--plot", str(a / "r.png")],
    "eval out and strip one path": lambda a: ["eval", "--out", str(a / "r.png"), "--strip", str(a / "r.png")],
    "eval plot and strip one path": lambda a: ["eval", "--plot", str(a / "r.png"), "--strip", str(a / "r.png")],
    "tokenize out and reconstruct one path": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "r.npy"),
                                                        "--reconstruct", str(a / "r.npy")],
    "tokenize out inside reconstruct": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "rec" / "t.npy"),
                                                  "--reconstruct", str(a / "rec"), "--overwrite"],
    "tokenize reconstruct onto the input": lambda a: ["tokenize", str(a / "images"), "--out", str(a / "t.npy"),
                                                      "--reconstruct", str(a / "images"), "--overwrite"],
    "tokenize reconstruct above the input": lambda a: ["tokenize", str(a / "nested" / "frame.png"), "--out",
                                                       str(a / "t.npy"), "--reconstruct", str(a / "nested"), "--overwrite"],
    "tokenize reconstruct holds the input": lambda a: ["tokenize", str(a / "frame.png"), "--out", str(a / "t.npy"),
                                                       "--reconstruct", str(a), "--overwrite"],
    "save tokens inside save frames": lambda a: [x for x in _generate(a, "--save-tokens", str(a / "fr" / "t.npy"),
                                                                      "--save-frames", str(a / "fr"), "--overwrite")
                                                 if x != "--no-decode"] + [str(a / "o.mp4")],
    "save frames holds the working directory": lambda a: [x for x in _generate(a, "--save-frames", str(a), "--overwrite")
                                                         if x != "--no-decode"] + [str(a / "o.mp4")],
    "save frames is the context": lambda a: [x for x in _generate(a, "--context", str(a / "images"), "--save-frames",
                                                                  str(a / "images"), "--overwrite")
                                             if x != "--no-decode"] + [str(a / "o.mp4")],
    "video inside save frames": lambda a: [x for x in _generate(a, "--save-frames", str(a / "fr"))
                                           if x != "--no-decode"] + [str(a / "fr" / "o.mp4")],
    "save tokens onto context tokens": lambda a: _generate(a, "--save-tokens", str(a / "ctx.npy"), "--overwrite"),
    "actions convert onto its input": lambda a: ["actions", "convert", str(a / "acts.npy"), str(a / "acts.npy"),
                                                 "--overwrite"],
    "bench out and plot one path": lambda a: ["bench", "--hf-vs-vllm", "--out", str(a / "b.png"), "--plot",
                                              str(a / "b.png"), "--model", str(a / "good")],
    # issue 30: expected bad inputs that were exit 1
    "bench keep outputs is a file": lambda a: ["bench", "--scenarios", "2", "--keep-outputs", str(a / "a_file"),
                                               "--backend", "hf", "--model", str(a / "good")],
    "bench seed negative": lambda a: ["bench", "--hf-vs-vllm", "--seed", "-1", "--model", str(a / "good")],
    "context tokens garbage header": lambda a: _generate(a, "--context-tokens", str(a / "garbage_header.npy")),
    "context tokens huge header": lambda a: _generate(a, "--context-tokens", str(a / "huge_header.npy")),
    "context tokens truncated": lambda a: _generate(a, "--context-tokens", str(a / "truncated.npy")),
    "actions garbage header": lambda a: _generate(a, "--actions", str(a / "garbage_header.npy")),
    "checkpoint int32 weights": lambda a: _generate(a, model="int_weights"),
    "info int32 weights": lambda a: ["info", str(a / "int_weights")],
    # issue 30: numbers beyond float32, and eval without a frame cap
    "actions plot beyond float32": lambda a: ["actions", "plot", str(a / "acts_beyond_float32.npy"), str(a / "p.png")],
    "actions convert beyond float32": lambda a: ["actions", "convert", str(a / "acts_beyond_float32.npy"),
                                                 str(a / "c.npy")],
    "actions beyond float32": lambda a: _generate(a, "--actions", str(a / "acts_beyond_float32.npy")),
    "eval frames huge": lambda a: ["eval", "--frames", "1000", "--out", str(a / "e.json")],
    "eval frames above the model": lambda a: ["eval", "--frames", "26", "--seeds", "1", "--out", str(a / "e.json")],
    "eval seeds times frames huge": lambda a: ["eval", "--frames", "20", "--seeds", "1000", "--out", str(a / "e.json")],
    "info damaged checkpoint": lambda a: ["info", str(a / "absurd_header")],
    "info config not json": lambda a: ["info", str(a / "config_not_json")],
    "info missing": lambda a: ["info", str(a / "nowhere")],
    # issue 38: a refiner checkpoint's config and file are checked before anything is built
    "refine config window zero": lambda a: _refine(a, "refiner_window0.pt"),
    "refine config heads zero": lambda a: _refine(a, "refiner_heads0.pt"),
    "refine config steps negative": lambda a: _refine(a, "refiner_steps_negative.pt"),
    "refine config width string": lambda a: _refine(a, "refiner_width_string.pt"),
    "refine empty checkpoint": lambda a: _refine(a, "refiner_empty.pt"),
    # issue 38: paths that are not plain names (a NUL byte cannot reach argv: tests/test_server.py)
    "tokenize symlink loop": lambda a: ["tokenize", str(a / "loop_a.png"), "--out", str(a / "t.npy")],
    "context symlink loop": lambda a: _generate(a, "--context", str(a / "loop_a.png")),
    "actions name 5000 characters": lambda a: _generate(a, "--actions", str(a / ("x" * 5000 + ".npy"))),
    "context name 5000 characters": lambda a: _generate(a, "--context", str(a / ("x" * 5000 + ".png"))),
    "save tokens name 5000 characters": lambda a: _generate(a, "--save-tokens", str(a / ("x" * 5000 + ".npy"))),
    "tokenize path 300 folders deep": lambda a: ["tokenize", str(a / ("d/" * 3000 + "f.png")), "--out", str(a / "t.npy")],
}


class Hung(BaseException):
    """Raised by the watchdog; a BaseException so that no `except Exception` turns it into an exit code."""


@contextlib.contextmanager
def _no_hang(seconds: int):
    """Interrupt a case that blocks (open() on a named pipe would wait forever) with `Hung`."""
    def hung(signum, frame):
        raise Hung(f"still running after {seconds} s (blocked on a named pipe?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _snapshot(folder: Path) -> dict:
    state = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            stat = path.lstat()
            state[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return state


def test_there_are_many_cases_across_all_commands():
    commands = {case(Path("/a"))[0] if case(Path("/a"))[0] != "actions" else "actions " + case(Path("/a"))[1]
                for case in CASES.values()}
    assert len(CASES) >= 60
    assert {"generate", "tokenize", "actions convert", "actions plot", "eval", "bench", "info"} <= commands


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_is_one_error_line_and_touches_nothing(name, arena, monkeypatch):
    monkeypatch.chdir(arena)
    args = CASES[name](arena)
    before = _snapshot(arena)
    with _no_hang(60):
        result = CliRunner().invoke(app, args)
    output = result.output
    assert result.exit_code == 2, f"{name}: exit {result.exit_code}\n{output}\n{result.exception!r}"
    assert "Traceback" not in output, f"{name}:\n{output}"
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, f"{name}: expected one error line:\n{output}"
    assert EXPECTED[name] in error_lines[0], f"{name}: {error_lines[0]}"
    assert _snapshot(arena) == before, f"{name}: files changed"

# What each error must say: the case fails for the reason it was written for, not an earlier one.
EXPECTED = {
    "temperature nan": "--temperature must be", "temperature inf": "--temperature must be",
    "temperature negative": "--temperature must be", "top-k negative": "--top-k must be",
    "top-p zero": "--top-p must be", "top-p above one": "--top-p must be", "top-p nan": "--top-p must be",
    "seed beyond 64 bits": "--seed must be", "seed negative": "--seed must be",
    "frames huge": "above the supported maximum", "frames one": "--frames must be at least 2",
    "threads beyond the OS": "--threads", "speed nan": "--speed must be", "speed negative": "--speed must be",
    "dtype unknown": "is not a dtype", "device unknown": "is not a device", "device absent gpu": "no CUDA GPU",
    "backend unknown": "--backend must be", "quantization unknown": "--quantization must be",
    "kv cache dtype unknown": "--kv-cache-dtype must be",
    "attention unknown": "--attention must be auto, terra or vllm", "attention terra with a draft": "does not run --draft",
    "vllm option with the hf backend": "--no-torch-compile: vLLM engine option(s), not for the hf backend",
    "bench kv cache dtype unknown": "--kv-cache-dtype must be", "scenario option without scenarios": "works with --scenarios",
    "context tokens too wide": "shape (frames, 16)", "context tokens float": "must be an int array",
    "context tokens 3d": "must be an int array", "context tokens out of vocabulary": "image codes in [0, 511]",
    "context tokens missing": "does not exist", "context image not an image": "cannot identify image",
    "context image bomb": "too large to decode safely", "context folder empty": "has no images",
    "context and tokens both": "not both", "actions nan": "NaN or inf", "actions wrong shape": "got (5, 4)",
    "actions empty": "actions are empty", "actions pickled objects": "cannot read", "actions npy is text": "cannot read",
    "actions json broken": "as JSON", "actions json list": "must be points", "actions json deeply nested": "nested too deeply",
    "actions json huge number": "need 60", "actions json not utf-8": "utf-8", "actions trajectory too short": "has 10 points",
    "actions unknown preset": "name a preset", "actions too few frames": "at least 39 frames",
    "output under /proc": "/proc is not writable", "output name too long": "longer than 200 bytes",
    "output exists": "already exists", "overwrite onto a folder": "is a directory", "output wrong suffix": "must end in .npy",
    "no decode without save tokens": "--no-decode needs --save-tokens",
    "checkpoint garbage_weights": "is damaged", "checkpoint truncated_weights": "is damaged",
    "checkpoint absurd_header": "is damaged", "checkpoint config_list": "must hold a JSON object",
    "checkpoint config_latin1": "not UTF-8", "checkpoint config_not_json": "not valid JSON",
    "checkpoint heads_string": "num_attention_heads is 'two'", "checkpoint heads_zero": "num_attention_heads is 0",
    "checkpoint heads_mismatch": "num_key_value_heads is 3", "checkpoint dtype_unknown": "torch_dtype is 'float7'",
    "checkpoint rope_unknown": "rope_type is 'warp-drive'", "checkpoint layers_huge": "num_hidden_layers is 1000000000",
    "checkpoint vocab_negative": "vocab_size is -5", "checkpoint shard_escapes": "shards must be plain file names",
    "checkpoint shard_absolute": "shards must be plain file names", "checkpoint index_not_object": "must hold a JSON object",
    "checkpoint no_config": "has no config.json", "model missing": "does not exist",
    "model path with markup": "m[/x]", "scenarios bad lines": "3 invalid scenario line(s)", "scenarios none": "holds no scenarios",
    "scenarios duplicate id": "duplicate id 'a'", "scenarios nan speed": "'speed' must be", "scenarios binary file": "cannot read",
    "scenarios missing file": "does not exist", "scenarios act-bench images missing": "not found: nope.jpg",
    "scenarios image root missing": "--image-root", "scenarios out-dir is a file": "is a file",
    "scenarios with output": "drop OUTPUT", "tokenize missing input": "does not exist",
    "tokenize not an image": "cannot identify image", "tokenize bomb": "too large to decode safely",
    "tokenize empty folder": "has no images", "tokenize output exists": "already exists",
    "tokenize device unknown": "is not a device", "tokenize output wrong suffix": "must end in .npy",
    "tokenize tokenizer missing": "does not exist", "tokenize tokenizer is a world model": "not an image tokenizer",
    "tokenize reconstruct onto a file": "is a file", "actions convert no frames": "--frames",
    "actions convert huge frames": "at most 10000", "actions convert nan": "NaN or inf",
    "actions convert wrong suffix": "must be a .npy", "actions convert exists": "already exists",
    "actions convert deep json": "nested too deeply", "actions plot wrong shape": "got (5, 4)",
    "actions plot negative speed": "--speed must be", "actions plot under /proc": "/proc is not writable",
    "eval tokenizer is a world model": "not an image tokenizer", "eval damaged checkpoint": "must hold a JSON object",
    "eval frames below context": "must be more than", "eval temperature nan": "--temperature must be",
    "eval dtype unknown": "is not a dtype", "bench nothing to measure": "say what to measure",
    "bench two things": "one thing per run", "bench bad batch list": "--batch takes", "bench vllm arg without value": "key=value",
    "bench frames below context": "must be more than", "bench temperatures nan": "--temperatures must be",
    "bench output exists": "already exists", "bench out not json": "must end in .json", "info damaged checkpoint": "is damaged", "info config not json": "not valid JSON",
    "info missing": "does not exist",
    "context image is a fifo": "is a named pipe (FIFO)", "context video is a fifo": "is a named pipe (FIFO)",
    "context tokens are a fifo": "is a named pipe (FIFO)", "actions npy is a fifo": "is a named pipe (FIFO)",
    "actions json is a fifo": "is a named pipe (FIFO)", "actions device": "is a character device",
    "checkpoint config is a fifo": "has no config.json", "tokenize fifo": "is a named pipe (FIFO)",
    "tokenize device": "is a character device", "actions convert fifo": "is a named pipe (FIFO)",
    "eval out and plot one path": "must end in .json", "eval out and strip one path": "must end in .json",
    "eval plot and strip one path": "are the same path", "tokenize out and reconstruct one path": "are the same path",
    "tokenize out inside reconstruct": "lies inside --reconstruct",
    "tokenize reconstruct onto the input": "is also the input INPUT",
    "tokenize reconstruct above the input": "holds the input INPUT",
    "tokenize reconstruct holds the input": "contains the working directory",
    "save tokens inside save frames": "lies inside --save-frames",
    "save frames holds the working directory": "contains the working directory",
    "save frames is the context": "is also the input --context", "video inside save frames": "lies inside --save-frames",
    "save tokens onto context tokens": "is also the input --context-tokens",
    "actions convert onto its input": "is also the input INPUT", "bench out and plot one path": "must end in .json",
    "bench keep outputs is a file": "is a file", "bench seed negative": "--seed must be",
    "context tokens garbage header": "header is damaged", "context tokens huge header": "more than terra reads",
    "context tokens truncated": "is truncated",
    "actions garbage header": "header is damaged", "checkpoint int32 weights": "has dtype I32",
    "info int32 weights": "has dtype I32", "actions plot beyond float32": "beyond float32",
    "actions convert beyond float32": "beyond float32", "actions beyond float32": "beyond float32",
    "eval frames huge": "--frames 1000 is above the maximum", "eval frames above the model": "frames per round",
    "eval seeds times frames huge": "frames per preset",
    "refine config window zero": "window is 0", "refine config heads zero": "head_channels is 0",
    "refine config steps negative": "steps is -1", "refine config width string": "model_channels is '32'",
    "refine empty checkpoint": "is empty",
    "tokenize symlink loop": "symbolic link loop", "context symlink loop": "symbolic link loop",
    "actions name 5000 characters": "too long", "context name 5000 characters": "too long",
    "save tokens name 5000 characters": "longer than 200 bytes", "tokenize path 300 folders deep": "too long",
}


def test_every_case_names_what_it_expects():
    assert set(EXPECTED) == set(CASES)
