"""Issue 40: the refiner compiled in a child process while the engine generates (refiner.compile_apart).

Inductor on the CPU compiles a UNet in minutes, so the children here run `compile_apart.main` with
the two compile functions stood in for (eager modules that record their calls, as test_refiner's
`force_compiled_run` does in-process): what is real is the process, the request it gets, the loading
of the weights, the calls on zeros in the run's shapes, its JSON line, and the stage's waiting on it.
"""

import json
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from terra_cli.refiner.compile_apart import CompileRequest, compile_request, start_compile_apart  # noqa: E402
from terra_cli.refiner.compiled import inductor_cache_dir  # noqa: E402
from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner  # noqa: E402
from terra_cli.refiner.stage import RefineStage  # noqa: E402
from test_refiner import PixelTokens, force_compiled_run, refiner_lines, tiny_pt  # noqa: E402, F401

# The child: compile_apart.main with eager stand-ins for the compiles, which append what they were
# given to RECORD; GATE (when set) must exist before it answers; FAIL makes it fail as a compile would.
CHILD = '''
import json, os, sys, time
from terra_cli.refiner import compile_apart, refiner as refiner_module
from terra_cli.refiner.autoencoder import one_frame_clips

record = os.environ["RECORD"]

def note(**fields):
    with open(record, "a") as f:
        f.write(json.dumps(fields) + "\\n")

def unet_stand_in(unet, mode):
    def call(sample, *args, **kwargs):
        note(what="unet", mode=mode, shape=list(sample.shape), dtype=str(sample.dtype))
        return unet(sample, *args, **kwargs)
    return call

def vae_stand_in(vae, mode="default"):
    decode = one_frame_clips(vae)
    def call(latents):
        note(what="vae", mode=mode, shape=list(latents.shape))
        return decode(latents)
    return call

refiner_module.compile_unet = unet_stand_in
refiner_module.compile_vae_decoder = vae_stand_in
if os.environ.get("FAIL"):
    sys.exit("RuntimeError: " + os.environ["FAIL"])
while os.environ.get("GATE") and not os.path.exists(os.environ["GATE"]):
    time.sleep(0.05)
sys.exit(compile_apart.main())
'''


@pytest.fixture
def child(tmp_path, monkeypatch):
    """The child's command, and the file its stand-ins write to."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RECORD", str(record))
    monkeypatch.setenv("TERRA_CACHE", str(tmp_path / "cache"))
    return [sys.executable, str(script)], record


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def loaded(tiny_pt, **options) -> VideoRefiner:
    """As `decoder.load_refiner` leaves it: on the CPU, its target device named."""
    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(**options))
    refiner.target_device = "cpu"
    return refiner


def test_a_request_names_the_weights_device_dtype_and_options_and_none_when_eager(tiny_pt):
    options = dict(compile="default", batch_windows=2, vae_chunk=3, dtype="auto")
    request = compile_request(loaded(tiny_pt, **options))
    assert request == CompileRequest(str(tiny_pt), "cpu", "float32", RefinerOptions(**options))
    assert CompileRequest.from_json(request.to_json()) == request
    assert compile_request(loaded(tiny_pt, compile="auto")) is None  # auto on a CPU: eager, nothing to compile
    assert compile_request(loaded(tiny_pt, compile="none")) is None
    on_gpu = loaded(tiny_pt, compile="auto")
    on_gpu.target_device = "cuda:1"  # auto compiles on a GPU (no GPU needed to ask)
    assert compile_request(on_gpu).device == "cuda:1"
    random = VideoRefiner.random(on_gpu.config, options=RefinerOptions(compile="default"))
    assert compile_request(random) is None  # weights in memory only: a child could not load them


def test_the_child_loads_the_weights_and_makes_the_stages_compiling_calls(tiny_pt, child):
    command, record = child
    apart = start_compile_apart(loaded(tiny_pt, compile="max-autotune-no-cudagraphs", batch_windows=2, vae_chunk=3),
                                command)
    result = apart.wait()
    assert apart.error is None and result is not None and apart.seconds > 0
    assert result["compile_mode"] == "max-autotune-no-cudagraphs" and result["vae_decoder_error"] is None
    assert result["inductor_cache"] == str(inductor_cache_dir())  # the parent's folder: its compile reads what this wrote
    config = loaded(tiny_pt).config
    h, w = config.latent_hw
    assert records(record) == [
        {"what": "unet", "mode": "max-autotune-no-cudagraphs", "shape": [2, config.window, config.in_channels, h, w],
         "dtype": "torch.float32"},
        {"what": "vae", "mode": "default", "shape": [3, config.latent_channels, h, w]}]
    assert apart.wait() is result  # a second wait answers at once


def test_a_child_that_fails_says_why_in_one_line(tiny_pt, child, monkeypatch):
    command, _ = child
    monkeypatch.setenv("FAIL", "out of memory\nsecond line")
    apart = start_compile_apart(loaded(tiny_pt, compile="default"), command)
    assert apart.wait() is None
    assert apart.error == "exit 1: second line"


def test_the_stage_compiles_only_after_the_child_and_refines_as_eager(tiny_pt, child, tmp_path, monkeypatch,
                                                                     refiner_lines):
    command, record = child
    gate = tmp_path / "gate"
    monkeypatch.setenv("GATE", str(gate))
    stand_in = force_compiled_run(monkeypatch)  # the stage's own compiles, stood in for
    refiner = loaded(tiny_pt, compile="default", batch_windows=1, vae_chunk=5)
    video = (torch.rand(25, 3, 36, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1).numpy()
    stage = RefineStage(PixelTokens(refiner), compile_apart=lambda r: start_compile_apart(r, command))
    try:
        future = stage.submit("a", video, 4)
        time.sleep(2.0)
        assert stand_in.compiled == [] and refiner.forward is None and not future.done()  # waits on the child
        gate.touch()
        refined = future.result(timeout=300)
        assert refiner.forward is not None and stand_in.compiled == [(refiner.vae, "default")]
        assert [r["what"] for r in records(record)] == ["unet", "vae"]
        stats = stage.decode_stats()
        assert stats["refiner_compiled_apart_s"] >= 2.0 and stats["refiner_compile_mode"] == "default"
    finally:
        stage.close()
    assert [line for line in refiner_lines if "apart" in line] == [
        next(line for line in refiner_lines if line.startswith("INFO: refiner: compiled apart in "))]
    eager = VideoRefiner(refiner.unet, refiner.vae, refiner.config, device="cpu", dtype=torch.float32, source="x")
    assert np.abs(refined.astype(int) - eager.refine_pixels([torch.from_numpy(video)], [4])[0].astype(int)).max() <= 1


def refine_one_video(tiny_pt, command, monkeypatch, seed: int):
    """A compiled run's stage (the compiles stood in for) whose child runs `command`, one 25-frame video
    refined through it, the stage closed: (the stage, its refiner, the compile stand-in)."""
    stand_in = force_compiled_run(monkeypatch)
    refiner = loaded(tiny_pt, compile="default")
    video = (torch.rand(25, 3, 36, 64, generator=torch.Generator().manual_seed(seed)) * 2 - 1).numpy()
    stage = RefineStage(PixelTokens(refiner), compile_apart=lambda r: start_compile_apart(r, command))
    try:
        assert stage.submit("a", video, 1).result(timeout=300).shape == (25, refiner.config.height, refiner.config.width, 3)
        return stage, refiner, stand_in
    finally:
        stage.close()


def test_a_failed_child_leaves_the_stage_compiling_itself(tiny_pt, child, monkeypatch, refiner_lines):
    command, _ = child
    monkeypatch.setenv("FAIL", "no compiler")
    stage, refiner, stand_in = refine_one_video(tiny_pt, command, monkeypatch, seed=3)
    assert refiner.forward is not None and stand_in.compiled == [(refiner.vae, "default")]
    assert stage.decode_stats()["refiner_compiled_apart_s"] is None
    warning = [line for line in refiner_lines if "apart" in line]
    assert len(warning) == 1 and warning[0].startswith("WARNING: refiner: compiling apart failed after ")
    assert warning[0].endswith("(exit 1: RuntimeError: no compiler); compiling here, beside the engine")


def test_a_child_still_compiling_after_the_stages_limit_is_ended_and_the_stage_compiles_itself(
        tiny_pt, child, tmp_path, monkeypatch, refiner_lines):
    from terra_cli.refiner import stage as stage_module

    command, _ = child
    monkeypatch.setenv("GATE", str(tmp_path / "never"))  # a child that never ends by itself
    monkeypatch.setattr(stage_module, "REFINER_APART_TIMEOUT_S", 2.0)
    stage, refiner, stand_in = refine_one_video(tiny_pt, command, monkeypatch, seed=4)
    assert stage.apart.process.poll() is not None and stand_in.compiled == [(refiner.vae, "default")]
    warning = [line for line in refiner_lines if "apart" in line]
    assert len(warning) == 1 and warning[0].endswith("(still compiling after 2 s: ended); compiling here, beside the engine")


def test_closing_the_stage_ends_a_child_still_compiling(tiny_pt, child, tmp_path, monkeypatch):
    command, _ = child
    monkeypatch.setenv("GATE", str(tmp_path / "never"))
    stand_in = force_compiled_run(monkeypatch)
    made = []

    def start(refiner):
        made.append(start_compile_apart(refiner, command))
        return made[0]

    refiner = loaded(tiny_pt, compile="default")
    stage = RefineStage(PixelTokens(refiner), compile_apart=start)
    time.sleep(1.0)
    started = time.perf_counter()
    stage.close()
    assert time.perf_counter() - started < 15
    assert made[0].process.poll() is not None  # ended
    assert refiner.forward is None and stand_in.compiled == []  # and nothing compiled here
    assert not stage.thread.is_alive()
