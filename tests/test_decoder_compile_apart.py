"""Issue 37: the tokenizer's decoder compiled in a child process while the engine generates
(scenarios.decoder_compile_apart), and the in-process writer waiting for it before its first decode.

The children here are real processes. On a CPU the decode-ahead does not compile (the child then
decodes eagerly, and says so), so what is real is the request, the child loading the same tokenizer
folder with the same batch size and frame size, its JSON line, and the writer's waiting on it; the
compile itself, and its cache hit in the parent, are what `benchmarks/scripts/cpu_compile_apart.py`
checks for the refiner and a GPU lease measures.
"""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import counted_decodes, logger_lines
from terra_cli.compile_apart import CompileApart, child_environment
from terra_cli.scenarios.decoder_compile_apart import decoder_request
from terra_cli.scenarios.local_writer import InProcessWriter
from terra_cli.scenarios.writer_process import DecoderSpec
from test_scenario_writers import SIZE, TOKENS, load, own_tmp, tokenizer_dir  # noqa: F401

CHILD = [sys.executable, "-m", "terra_cli.scenarios.decoder_compile_apart"]


def cpu_request(tokenizer) -> str:
    """What `decoder_request` makes for a CUDA decoder, for this CPU one (whose decode-ahead does not compile)."""
    spec = DecoderSpec.of(tokenizer)
    return json.dumps({**spec, "image_size": list(spec["image_size"])})


@pytest.fixture
def writer_lines():
    """terra.writer's lines (conftest.logger_lines)."""
    with logger_lines("terra.writer") as lines:
        yield lines


def test_a_decoder_on_a_card_with_a_folder_gets_a_child_and_the_switches_say_no(tokenizer_dir, monkeypatch):
    tokenizer = load(tokenizer_dir)
    assert decoder_request(tokenizer) is None  # on a CPU the decode-ahead does not compile: nothing to do apart
    tokenizer.device = torch.device("cuda", 0)  # (only what the request reads)
    request = json.loads(decoder_request(tokenizer))
    assert request == {"source": str(tokenizer.source), "device": "cuda:0", "batch_size": tokenizer.batch_size,
                       "image_size": list(SIZE)}
    monkeypatch.setenv("TERRA_DECODER_COMPILE_APART", "0")
    assert decoder_request(tokenizer) is None  # compiled in the writer's thread, as before
    monkeypatch.delenv("TERRA_DECODER_COMPILE_APART")
    monkeypatch.setenv("TERRA_DECODER_COMPILE", "0")
    assert decoder_request(tokenizer) is None  # an eager decoder: no compile anywhere
    tokenizer.source = None
    monkeypatch.delenv("TERRA_DECODER_COMPILE")
    assert decoder_request(tokenizer) is None  # weights in memory only: no folder for a child to load


def test_the_child_loads_the_same_tokenizer_and_decodes_one_full_batch(tokenizer_dir):
    tokenizer = load(tokenizer_dir)
    done = subprocess.run([*CHILD, cpu_request(tokenizer)], capture_output=True, text=True, timeout=120,
                          env=child_environment())
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["compiled"] is False and line["decoder_compile_error"] is None and line["seconds"] >= 0
    usage = subprocess.run(CHILD, capture_output=True, text=True, timeout=120, env=child_environment())
    assert usage.returncode == 2 and "usage:" in usage.stderr


class GatedChild(CompileApart):
    """A compile apart whose end the test decides, with no process (the real one's is `CompileApart`'s)."""

    def __init__(self, seconds=12.5, error=None):  # (no child process started)
        self.gate, self.seconds, self.error, self.stopped = threading.Event(), seconds, error, 0
        self.result = None

    def wait(self, timeout=None):
        self.gate.wait(30)
        self.result = None if self.error else {"compiled": True}
        return self.result

    def stop(self):
        self.stopped += 1
        if not self.gate.is_set():  # as a process ended early: its wait returns with an error
            self.error = "exit -15: no message"
            self.gate.set()


def streamed_to_a_gated_child(tokenizer_dir, key: str, seed: int, frames: int):
    """An in-process writer (batches of 4, its decodes counted) whose decoder's child is a `GatedChild`,
    and the video `key` of `frames` random frames streamed to it as an engine makes them, not yet
    submitted: (the writer, the child, the decodes' sizes, the tokens)."""
    tokenizer = load(tokenizer_dir)
    tokenizer.batch_size = 4
    calls = counted_decodes(tokenizer)
    child = GatedChild()
    writer = InProcessWriter(tokenizer, fps=10, compile_apart=lambda decoder: child)
    tokens = np.random.default_rng(seed).integers(0, 512, size=(frames, TOKENS))
    writer.open(key, tokens[:2])
    for index in range(2, frames):
        writer.frame(key, index, tokens[index])
    return writer, child, calls, tokens


def one_video_with_a_child(tokenizer_dir, command: list[str], seed: int, frames: int):
    """An in-process writer whose decoder's child runs `command` (a real process), one video of
    `frames` random frames through it, the writer closed: (the writer, the mp4's bytes)."""
    tokenizer = load(tokenizer_dir)
    writer = InProcessWriter(tokenizer, fps=10, compile_apart=lambda decoder: CompileApart(cpu_request(decoder), command))
    tokens = np.random.default_rng(seed).integers(0, 512, size=(frames, TOKENS))
    try:
        return writer, writer.submit(f"v{seed}", tokens).result(timeout=120)
    finally:
        writer.close()


def test_the_writer_decodes_nothing_until_the_decoders_child_has_ended(tokenizer_dir, writer_lines):
    """Frames keep arriving while the child compiles; the writer's thread decodes none of them until
    the child ends (its compile is then a cache hit), then decodes them all ahead and makes the mp4."""
    writer, child, calls, tokens = streamed_to_a_gated_child(tokenizer_dir, "a", seed=2, frames=9)
    try:
        time.sleep(0.5)  # two full batches wait: a writer that did not wait for the child would have decoded them
        assert calls == [] and writer.decode_stats()["decoder_compiled_apart_s"] is None
        child.gate.set()
        deadline = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert calls == [4, 4]  # both full batches, ahead of the video's end
        video = writer.submit("a", tokens).result(timeout=60)
    finally:
        writer.close()
    assert video.startswith(b"\x00\x00\x00") and writer.frames_decoded_late == 1  # the ninth frame, at the end
    assert writer.decode_stats()["decoder_compiled_apart_s"] == 12.5 and child.stopped == 1
    assert writer_lines == ["INFO: the tokenizer's decoder: compiled apart in 12.5 s (0 compile setting(s) of this "
                            "process taken); compiling here from Inductor's cache"]


def test_a_failed_child_is_one_line_and_the_writer_compiles_itself(tokenizer_dir, writer_lines):
    """A real child process that fails (as a compile would): one warning line with its last line,
    and the writer decodes as it would have without it."""
    failing = [sys.executable, "-c", "import sys; sys.exit('RuntimeError: no C++ compiler here')"]
    writer, video = one_video_with_a_child(tokenizer_dir, failing, seed=3, frames=4)
    assert video and writer.decode_stats()["decoder_compiled_apart_s"] is None
    assert len(writer_lines) == 1 and writer_lines[0].startswith("WARNING: the tokenizer's decoder: compiling apart failed after ")
    assert writer_lines[0].endswith("s (exit 1: RuntimeError: no C++ compiler here); compiling here, beside the engine")


def test_a_real_child_is_waited_for_and_its_seconds_reported(tokenizer_dir, writer_lines):
    writer, video = one_video_with_a_child(tokenizer_dir, CHILD, seed=4, frames=3)
    seconds = writer.decode_stats()["decoder_compiled_apart_s"]
    assert video and seconds > 0 and writer.apart.result["compiled"] is False
    settings = writer.apart.result["parent_settings"]  # what differed from a fresh interpreter (this test
    assert settings["refused"] == {}                    # process's imports decide which)
    assert writer_lines == [f"INFO: the tokenizer's decoder: compiled apart in {writer.apart.seconds:.1f} s "
                            f"({writer.apart.settings_note()}); compiling here from Inductor's cache"]
    assert writer.apart.settings_note().startswith(f"{len(settings['adopted'])} compile setting(s) of this process taken")


def test_a_child_that_hangs_is_ended_and_the_writer_compiles_itself(tokenizer_dir, writer_lines, monkeypatch):
    """Frames wait while the child compiles: one still running after DECODER_APART_TIMEOUT_S is ended
    (a real process here), one line says so, and the writer decodes as it would have without it."""
    from terra_cli.scenarios import local_writer

    hanging = [sys.executable, "-c", "import time; time.sleep(120)"]
    child = CompileApart("{}", hanging)
    assert child.wait(timeout=0.5) is None and child.error == "still compiling after 0.5 s: ended"
    assert child.process.poll() is not None and 0.5 <= child.seconds < 60  # ended, not waited out
    monkeypatch.setattr(local_writer, "DECODER_APART_TIMEOUT_S", 1.0)
    writer, video = one_video_with_a_child(tokenizer_dir, hanging, seed=5, frames=3)
    assert video and writer.apart.process.poll() is not None
    assert len(writer_lines) == 1 and writer_lines[0].endswith(
        "s (still compiling after 1 s: ended); compiling here, beside the engine")


def test_closing_the_writer_ends_a_child_still_compiling_without_a_word(tokenizer_dir, writer_lines):
    """A run that ends (an interrupt) while the child still compiles: close() ends the child first,
    so the writer's thread, waiting on it, goes on and ends at once; no line about a failure."""
    writer, child, calls, _ = streamed_to_a_gated_child(tokenizer_dir, "e", seed=6, frames=6)
    time.sleep(0.3)  # the thread is waiting on the child, a full batch in hand
    started = time.perf_counter()
    writer.close()
    assert time.perf_counter() - started < 5 and not writer.thread.is_alive()
    assert child.stopped == 1 and writer_lines == [] and calls == []  # nothing compiled or decoded at the close


def test_videos_at_end_read_a_child_done_long_before_the_engine_ends(tokenizer_dir, writer_lines, monkeypatch):
    """--videos-at-end first waits on the child once the engine is done, long after the child's limit
    counted from its start: a child that has ended is read, with its own seconds, not ended as still
    compiling (the misreading of 2026-12-06's runs, benchmarks/README.md)."""
    from terra_cli.scenarios import local_writer

    monkeypatch.setattr(local_writer, "DECODER_APART_TIMEOUT_S", 1.0)
    tokenizer = load(tokenizer_dir)
    writer = InProcessWriter(tokenizer, fps=10, decode_after=True,
                             compile_apart=lambda decoder: CompileApart(cpu_request(decoder), CHILD))
    try:
        tokens = np.random.default_rng(8).integers(0, 512, size=(3, TOKENS))
        video = writer.submit("v8", tokens)
        writer.apart.process.wait(60)  # the child is done (a CPU takes seconds to import torch: past its limit)
        time.sleep(1.0)  # and the engine goes on a while
        writer.engine_done()
        assert video.result(timeout=120)
    finally:
        writer.close()
    seconds = writer.decode_stats()["decoder_compiled_apart_s"]
    assert seconds is not None and seconds < time.perf_counter() - writer.apart.started - 0.5
    assert len(writer_lines) == 1 and writer_lines[0].startswith("INFO: the tokenizer's decoder: compiled apart in ")
