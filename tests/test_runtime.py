"""runtime.py: the host's share of cores bounds what a run may ask for."""

import pytest

from terra_cli import runtime, streams
from terra_cli.errors import InputError


def test_threads_are_bounded_by_the_cores_this_process_may_use_not_the_hosts(monkeypatch):
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 64)
    assert runtime.host_cores() == 2
    assert runtime.generation_threads(8, 2048, "vllm", "cuda") == 8
    with pytest.raises(InputError, match="more than 4x the 2 CPU cores here; use at most 8"):
        runtime.generation_threads(9, 2048, "vllm", "cuda")


def test_a_runs_tokenizer_takes_its_batch_size_from_the_lab_switch_and_refuses_a_bad_one(monkeypatch):
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.models.resolve import TokenizerSpec, load_tokenizer

    spec = TokenizerSpec(str(default_tokenizer_dir()), None)
    monkeypatch.delenv(runtime.TOKENIZER_BATCH_ENV, raising=False)
    default = load_tokenizer(spec, "cpu").batch_size
    monkeypatch.setenv(runtime.TOKENIZER_BATCH_ENV, str(2 * default))
    assert load_tokenizer(spec, "cpu").batch_size == 2 * default
    for bad in ("0", "sixteen", "-4", "1000"):
        monkeypatch.setenv(runtime.TOKENIZER_BATCH_ENV, bad)
        with pytest.raises(InputError, match="TERRA_TOKENIZER_BATCH"):
            load_tokenizer(spec, "cpu")


def test_the_decode_aheads_compile_mode_comes_from_its_lab_switch_and_reaches_torch_compile(monkeypatch):
    """TERRA_DECODER_COMPILE_MODE: unset or `default` is torch.compile's default; the autotuning mode
    reaches the compiled tokenizer decoder; a bad value is one line (exit 2)."""
    import types

    import torch

    from terra_cli.scenarios import frame_store
    from tokenizer_decoder.tokenizer import ImageTokenizer

    assert runtime.decoder_compile_mode_asked({}) is None
    assert runtime.decoder_compile_mode_asked({"TERRA_DECODER_COMPILE_MODE": " default "}) is None
    assert runtime.decoder_compile_mode_asked(
        {"TERRA_DECODER_COMPILE_MODE": "max-autotune-no-cudagraphs"}) == "max-autotune-no-cudagraphs"
    assert runtime.decoder_compile_mode_asked({"TERRA_DECODER_COMPILE_MODE": "reduce-overhead"}) == "reduce-overhead"
    with pytest.raises(InputError, match=r"TERRA_DECODER_COMPILE_MODE='max-autotune': use default or "
                                         r"max-autotune-no-cudagraphs or reduce-overhead"):
        runtime.decoder_compile_mode_asked({"TERRA_DECODER_COMPILE_MODE": "max-autotune"})

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, mode: compiled.append((dynamic, mode)) or fn)
    decoder = ImageTokenizer.__new__(ImageTokenizer)  # a decoder that says it is on a card; nothing runs
    decoder.device, decoder._compiled_decode = torch.device("cuda", 0), None
    decoder.model = types.SimpleNamespace(decode=lambda codes: codes)
    monkeypatch.setenv("TERRA_DECODER_COMPILE_MODE", "max-autotune-no-cudagraphs")
    assert frame_store.compile_decoder(decoder) is True
    assert compiled == [(False, "max-autotune-no-cudagraphs")]


def test_cuda_index_gives_set_device_an_index_even_for_a_bare_cuda(monkeypatch):
    """The Ray refiner run of 2026-11-28 stopped every engine's refiner with "Expected a torch.device
    with a specified index": an actor's device is a bare 'cuda', and torch.cuda.set_device refuses it."""
    import threading

    import torch

    from terra_cli.refiner.stage import RefineStage
    from terra_cli.runtime import cuda_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the making thread's GPU
    assert cuda_index("cuda") == 3 and cuda_index("cuda:1") == 1 and cuda_index(torch.device("cuda", 2)) == 2
    assert cuda_index("cpu") is None and cuda_index(torch.device("cpu")) is None

    class OnCuda:  # what the stage needs of a refiner, on a GPU that is not there (eager: no compile apart)
        device = target_device = torch.device("cuda")
        options = type("Options", (), {"batch_windows": 1, "compile": "none"})()
        prepared = threading.Event()

        def to(self, device):
            return self

        def prepare(self):
            self.prepared.set()

        def prepare_vae_decoder(self):
            pass

    refiner, set_to = OnCuda(), []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: set_to.append((index, threading.current_thread().name)))
    stage = RefineStage(type("Decoder", (), {"refiner": refiner})())
    try:
        assert refiner.prepared.wait(30) and stage.failure is None
        assert set_to == [(3, "terra-refiner")]  # the making thread's GPU, set in the stage's own thread
    finally:
        stage.close()


def test_the_light_parts_of_backends_do_not_import_transformers():
    """Every command imports backends.vllm_startup first (configure_vllm_env) and builds a Sampling
    before it checks its inputs; transformers' import is seconds on a small CPU, so a refused input
    (a named pipe, a bad flag) must not wait for it."""
    import subprocess
    import sys

    probe = ("import sys\nimport terra_cli.backends.vllm_startup\nfrom terra_cli.backends import Sampling\n"
             "Sampling(temperature=1.0)\nprint('transformers' in sys.modules)\n"
             "from terra_cli.backends import WorldModelBackend, check_generation_inputs\nprint(callable(check_generation_inputs))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


def test_the_servers_picture_stream_is_a_checked_lab_switch():
    """TERRA_PICTURE_STREAM: unset is a stream of normal priority (the fastest measured); high and shared
    (the engine's own stream) are asked by name; a bad value is one line, read when the server's engine is made."""
    assert streams.picture_stream_asked({}) == "normal"
    assert streams.picture_stream_asked({"TERRA_PICTURE_STREAM": "high"}) == "high"
    assert streams.picture_stream_asked({"TERRA_PICTURE_STREAM": " Shared "}) == "shared"
    assert streams.picture_stream_asked({"TERRA_PICTURE_STREAM": "normal"}) == "normal"
    with pytest.raises(InputError, match=r"TERRA_PICTURE_STREAM='low': use high, normal, shared"):
        streams.picture_stream_asked({"TERRA_PICTURE_STREAM": "low"})
