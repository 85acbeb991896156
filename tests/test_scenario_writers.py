"""Video writer processes for `--scenarios` (terra_cli/scenarios/writers.py, issue #28): the
engine's process only generates and places bytes, the processes decode and encode. Checked: the
same files and results.jsonl as the writer thread; a video that fails in a process is recorded
failed as before; a killed or unstartable process ends the run with one error, no partial file
and no hang; Ctrl-C keeps every finished scenario; the engine blocks when the writers fall behind."""

import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import counted_decodes, logger_lines, save_frame_tokenizer
from terra_cli.cli import app
from terra_cli.errors import InputError
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.scenarios.runner import RESULTS_NAME, ScenarioRun, _Writer, completed_ids, \
    read_results, run_scenarios
from terra_cli.scenarios.spec import Defaults, read_scenarios
from terra_cli.scenarios.writers import OPEN_PER_PROCESS, WriterDied, default_writers
# The same tiny model and reference engine (module fixtures, one per module) as the safety tests.
from test_scenarios_safety import REPO, TOKENS, backend, bounded, line, model, write_lines  # noqa: F401

SIZE = (64, 64)  # frames through a 16x-downsampling tokenizer: 4x4 codes, TOKENS of them


def save_tokenizer(folder: Path, codes_bits: int = 9) -> Path:
    from tokenizer_decoder import ImageTokenizer, small_config

    ImageTokenizer.from_config(small_config(z_channels=codes_bits), seed=0, device="cpu").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("writers_tokenizer"))  # 512 codes: the tiny model's


def load(folder: Path):
    from tokenizer_decoder import ImageTokenizer

    return ImageTokenizer.from_pretrained(folder, device="cpu", image_size=SIZE)


def load_counted(folder: Path):
    """The tokenizer in batches of 4, its own `decode_tokens`, and the rows each decode call of it receives
    (before padding; `counted_decodes`)."""
    tokenizer = load(folder)
    tokenizer.batch_size = 4
    original = tokenizer.decode_tokens
    return tokenizer, original, counted_decodes(tokenizer)


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch):
    """The pool's temporary folder goes under this test's tmp_path, so a leftover is seen."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    assert not list(folder.iterdir()), "a writer pool left temporary files"
    assert not multiprocessing.active_children(), "a writer process outlived its run"


def lines(count, **extra):
    return [line(f"v{i}", seed=i, frames=3 + i % 3, **extra) for i in range(count)]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_writer_processes_write_what_the_writer_thread_writes(tmp_path, backend, tokenizer_dir):
    file = read_scenarios(write_lines(tmp_path, lines(7)), Defaults())
    tokenizer = load(tokenizer_dir)
    runs = {writers: run_scenarios(file, tmp_path / f"w{writers}", backend, tokenizer, max_rollouts=1, writers=writers)
            for writers in (0, 2)}
    assert [(r.done, r.failed, r.writers) for r in runs.values()] == [(7, 0, 0), (7, 0, 2)]
    # Both count the videos they made and the time it took (the benches' writer pace).
    assert [r.videos_made for r in runs.values()] == [7, 7]
    # (from the finished scenario's hand-over to its mp4: up to OPEN_PER_PROCESS at once per process, and
    # as many as two processes' in the engine process's own writer threads)
    assert all(0 < r.video_seconds <= r.seconds * OPEN_PER_PROCESS * max(2, r.writers) for r in runs.values())
    thread, pool = tmp_path / "w0", tmp_path / "w2"
    assert files(thread) == files(pool) == sorted([RESULTS_NAME, *(f"v{i}.{x}" for i in range(7) for x in ("mp4", "npy"))])
    for i in range(7):
        np.testing.assert_array_equal(np.load(pool / f"v{i}.npy"), np.load(thread / f"v{i}.npy"))
        assert (pool / f"v{i}.mp4").read_bytes() == (thread / f"v{i}.mp4").read_bytes(), f"v{i}.mp4 differs"

    def lines_of(folder):  # everything but the timing, in the order written
        return [{k: v for k, v in r.items() if k != "seconds"} for r in read_results(folder / RESULTS_NAME)]

    assert lines_of(pool) == lines_of(thread)
    assert [r["id"] for r in lines_of(pool)] == [f"v{i}" for i in range(7)]  # the order they finished
    again = run_scenarios(file, pool, backend, tokenizer, max_rollouts=1, writers=2)
    assert (again.resumed, again.done, again.writers) == (7, 0, 0)  # nothing pending: no processes started


def test_decoding_after_the_engine_writes_every_video_at_the_end_and_the_same_files(tmp_path, backend, tokenizer_dir):
    """--videos-at-end: no frame is decoded while the engine generates, no video is written before the
    engine's last frame, and the files are those of a default run."""
    from terra_cli.bench.engine_report import describe_engine_loop

    file = read_scenarios(write_lines(tmp_path, lines(5)), Defaults())
    tokenizer = load(tokenizer_dir)
    with logger_lines("terra.scenarios") as quiet:
        default = run_scenarios(file, tmp_path / "default", backend, tokenizer, max_rollouts=2, writers=0)
    assert quiet == []
    frames_when_written = []
    seen = {}
    with logger_lines("terra.scenarios") as said:
        after = run_scenarios(file, tmp_path / "after", backend, tokenizer, max_rollouts=2, writers=0,
                              videos_at_end=True, on_progress=lambda run, total: seen.update(run=run),
                              on_written=lambda record: frames_when_written.append(seen["run"].generated_frames))
    assert said == ["INFO: every scenario's tokens are made: writing the 5 video(s) now (--videos-at-end)"]
    assert (after.done, after.failed) == (default.done, default.failed) == (5, 0)
    total = sum(s.frames - s.context_frames for s in file.scenarios)
    assert frames_when_written == [total] * 5  # each video written once every frame was made
    assert after.engine_loop["decode_ahead_frames"] == 0  # (the default's depends on when its batches fill)
    assert after.engine_loop["decode_after"] is True and "decode_after" not in default.engine_loop
    assert "; every video decoded once the engine was done (--videos-at-end); " in describe_engine_loop(
        after.engine_loop)
    assert after.frames_decoded_late == sum(s.frames for s in file.scenarios)  # all, at the end
    assert files(tmp_path / "after") == files(tmp_path / "default")
    for i in range(5):
        assert (tmp_path / "after" / f"v{i}.mp4").read_bytes() == (tmp_path / "default" / f"v{i}.mp4").read_bytes()
    with pytest.raises(ValueError, match="needs the engine's own writer threads, not writer processes"):
        run_scenarios(file, tmp_path / "processes", backend, tokenizer, max_rollouts=2, writers=1, videos_at_end=True)


def test_videos_at_end_through_the_scenario_job_the_same_files_and_its_refusals(tmp_path, tokenizer_dir):
    """`ScenarioJob.videos_at_end` (--videos-at-end) reaches the engine's writer: through the job's own load and run
    the files are a default run's; it is refused, each in one line, without videos, with writer processes, with
    the refiner, and on Ray (one engine's threads hold its videos); the CLI passes the flag to the job."""
    from dataclasses import replace

    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.job import ScenarioJob, prepare_job, run_scenario_job
    from terra_cli.scenarios.ray_cluster import ray_cluster

    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=512, layers=1, max_frames=4))
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, 576)))
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"id": f"v{i}", "context": "ctx.npy", "actions": "left",
                                                          "frames": 3, "seed": i}) + "\n" for i in range(2)))
    job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "default", model=ModelSpec(str(model), tokenizer=str(tokenizer_dir)),
                      engine=Engine("hf", "cpu", "float32"), writers=0, max_rollouts=2)
    default = bounded(lambda: run_scenario_job(prepare_job(job)), 120)
    at_end = replace(job, out_dir=tmp_path / "at_end", videos_at_end=True)
    after = bounded(lambda: run_scenario_job(prepare_job(at_end)), 120)
    assert (default.done, after.done) == (2, 2)
    assert after.engine_loop["decode_after"] is True and "decode_after" not in default.engine_loop
    assert files(tmp_path / "at_end") == files(tmp_path / "default")
    for name in ("v0.mp4", "v1.mp4"):
        assert (tmp_path / "at_end" / name).read_bytes() == (tmp_path / "default" / name).read_bytes()
    for changed, message in ((dict(decode=False), "--videos-at-end is about videos: drop it with --no-decode"),
                             (dict(writers=1), "--videos-at-end decodes in the engine's own writer threads: drop "
                                               "--writers 1"),
                             (dict(refiner=object()), "--decoder refiner refines beside the engine: drop "
                                                      "--videos-at-end")):
        with pytest.raises(InputError, match=message):
            prepare_job(replace(at_end, out_dir=tmp_path / "refused", **changed))
    with pytest.raises(InputError, match="--videos-at-end is for one engine without Ray: drop it with --ray or "
                                         "--data-parallel"):
        with ray_cluster(prepare_job(replace(at_end, out_dir=tmp_path / "ray")), engines=2):
            pass
    runner = CliRunner()
    for args, said in (
            (["generate", "--scenarios", str(tmp_path / "s.jsonl"), "--out-dir", str(tmp_path / "cli"), "--model",
              str(model), "--tokenizer", str(tokenizer_dir), "--backend", "hf", "--device", "cpu", "--videos-at-end",
              "--writers", "1"],
             "error: --videos-at-end decodes in the engine's own writer threads: drop --writers 1"),
            (["generate", str(tmp_path / "one.mp4"), "--actions", "left", "--videos-at-end"],
             "error: --videos-at-end works with --scenarios FILE"),
            (["bench", "--scenarios", "2", "--videos-at-end"],
             "error: --videos-at-end goes with --act-bench (the other measures write no videos)")):
        result = runner.invoke(app, args)
        assert (result.exit_code, result.output.strip().splitlines()) == (2, [said])
    assert not (tmp_path / "cli").exists() and not (tmp_path / "one.mp4").exists()


def test_a_video_that_fails_in_a_writer_process_is_recorded_failed_as_in_the_thread(tmp_path, backend):
    """A tokenizer of 256 codes cannot decode the tiny model's 512: each video fails, each
    scenario is recorded failed with its tokens kept, as when the thread decodes."""
    file = read_scenarios(write_lines(tmp_path, lines(2)), Defaults())
    tokenizer = load(save_tokenizer(tmp_path / "tok256", codes_bits=8))
    records = {}
    for writers in (0, 1):
        run = run_scenarios(file, tmp_path / f"w{writers}", backend, tokenizer, max_rollouts=1, writers=writers)
        assert (run.done, run.failed, len(run.errors)) == (0, 2, 2)
        records[writers] = [{k: v for k, v in r.items() if k != "seconds"}
                            for r in read_results(tmp_path / f"w{writers}" / RESULTS_NAME)]
        assert files(tmp_path / f"w{writers}") == [RESULTS_NAME, "v0.npy", "v1.npy"]
    assert records[1] == records[0]
    assert records[1][0]["status"] == "failed" and "token values must lie in [0, 256)" in records[1][0]["reason"]
    assert records[1][0]["paths"] == ["v0.npy"]


def test_a_killed_writer_process_ends_the_run_with_one_error_and_no_partial_file(tmp_path, backend, tokenizer_dir):
    file = read_scenarios(write_lines(tmp_path, lines(8)), Defaults())
    out = tmp_path / "out"
    killed = []

    def kill_the_writers(record):
        if not killed:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)

    with pytest.raises(WriterDied, match=r"video writer process \d+ was killed \(SIGKILL.*scenario\(s\) written and "
                                         r"recorded; run the same command again to resume"):
        bounded(lambda: run_scenarios(file, out, backend, load(tokenizer_dir), max_rollouts=1, writers=1,
                                      on_written=kill_the_writers), 120)
    assert len(killed) == 1
    done = [r for r in read_results(out / RESULTS_NAME) if r["status"] == "done"]
    assert 1 <= len(done) < 8 and completed_ids(out) == {r["id"] for r in done}
    # every file there is a recorded one: nothing half-written, nothing unaccounted for
    assert files(out) == sorted([RESULTS_NAME, *(p for r in done for p in r["paths"])])
    rerun = bounded(lambda: run_scenarios(file, out, backend, load(tokenizer_dir), max_rollouts=1, writers=1), 120)
    assert (rerun.resumed, rerun.done) == (len(done), 8 - len(done))


def test_a_writer_process_that_cannot_start_ends_the_run_with_one_error(tmp_path, backend, tokenizer_dir):
    file = read_scenarios(write_lines(tmp_path, lines(3)), Defaults())
    copy = tmp_path / "tok"
    tokenizer = load(save_tokenizer(copy))
    (copy / "model.safetensors").unlink()  # loaded here; gone for the processes
    with pytest.raises(WriterDied, match="a video writer process could not start: .*model.safetensors"):
        bounded(lambda: run_scenarios(file, tmp_path / "out", backend, tokenizer, max_rollouts=1, writers=1), 120)
    assert files(tmp_path / "out") == []  # not even a results line: nothing was written


@pytest.mark.parametrize("writers", ["processes", "threads decoding after the engine"])
def test_an_interrupt_writes_every_finished_scenario_through_the_processes(tmp_path, backend, tokenizer_dir, writers):
    """Also with --videos-at-end, whose threads hold every finished video until the engine is done:
    an interrupt ends the engine, and what finished is still written."""
    file = read_scenarios(write_lines(tmp_path, lines(4)), Defaults())  # v0: 1 generated frame, v1: 2, v2: 3
    out = tmp_path / "out"
    frames = []

    def stop_inside_v2(run, total):
        frames.append(1)
        if len(frames) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), logger_lines("terra.scenarios") as said:
        bounded(lambda: run_scenarios(file, out, backend, load(tokenizer_dir), max_rollouts=1,
                                      writers=1 if writers == "processes" else 0, videos_at_end=writers != "processes",
                                      on_progress=stop_inside_v2), 120)
    assert completed_ids(out) == {"v0", "v1"}
    if writers != "processes":  # nothing is written before the engine is done: both wait, and the user is told
        assert said == ["INFO: interrupted: writing the 2 finished scenario(s) first (Ctrl-C again stops at once; "
                        "a re-run makes the unwritten ones again)"]
    else:  # the processes may have written them before the interrupt; a line says only what is left
        assert len(said) <= 1 and all("finished scenario(s) first" in line for line in said)
    assert files(out) == [RESULTS_NAME, "v0.mp4", "v0.npy", "v1.mp4", "v1.npy"]


class StalledPool:
    """A pool whose videos come only once told (`deliver`, `stall`): what the writer hands it, and a way to break it."""

    size = 2

    def __init__(self):
        self.submitted, self.failure, self.delivering = [], None, False

    def submit(self, key, tokens, seed=None):
        future = Future()
        self.submitted.append(future)
        if self.failure is not None:
            future.set_exception(self.failure)
        elif self.delivering:
            future.set_result(b"mp4 bytes")
        return future

    def check(self):
        if self.failure is not None:
            raise self.failure

    def deliver(self):
        self.delivering = True
        for future in self.submitted:
            if not future.done():
                future.set_result(b"mp4 bytes")

    def stall(self):
        self.delivering = False

    def fail(self):
        self.failure = WriterDied("stalled pool stopped")
        for future in self.submitted:
            if not future.done():
                future.set_exception(self.failure)

    def close(self):
        pass


def wait_for_room(writer, limit: int) -> None:
    """What a held admission does (the job feed's hold): look again until fewer than `limit` wait."""
    while writer.behind(limit):
        time.sleep(0.05)


def test_a_writer_that_falls_behind_holds_back_admission_never_the_engine(tmp_path):
    """With the processes stalled, `put` (the engine loop's call) still returns at once however
    long the backlog; admission (`behind`, polled as the job feed's hold does) waits while the backlog is at its limit, goes
    on once the videos come and are written, and raises, as `put` and `close` do, once the
    writer failed."""
    from terra_cli.scenarios.runner import ResultsLog

    limit, count = 8, OPEN_PER_PROCESS * StalledPool.size + 3 * 8
    scenarios = read_scenarios(write_lines(tmp_path, lines(2 * count)), Defaults()).scenarios
    out = tmp_path / "out"
    out.mkdir()
    pool = StalledPool()
    writer = _Writer(out, None, ResultsLog(out), ScenarioRun(), lambda record: None, (), pool)
    tokens = np.zeros((3, TOKENS), dtype=np.int64)
    for scenario in scenarios[:count]:
        bounded(lambda: writer.put(scenario, tokens, 0.0), 2)
    assert writer.backlog == count
    bounded(lambda: wait_for_room(writer, count + 1), 2)  # below the limit: no wait
    raised = queue.Queue()

    def admit_one_more():
        try:
            wait_for_room(writer, limit)
        except BaseException as exc:  # noqa: BLE001 (looked at below)
            raised.put(exc)
        else:
            raised.put(None)

    held = threading.Thread(target=admit_one_more, daemon=True)
    held.start()
    held.join(1.0)
    assert held.is_alive(), "admission went on although the writer was far behind"
    pool.deliver()  # the videos come: written in order, the backlog drains, admission goes on
    held.join(10)
    assert not held.is_alive() and raised.get_nowait() is None
    bounded(lambda: wait_for_room(writer, 1), 10)
    assert len(list(out.glob("*.mp4"))) == count and writer.backlog == 0
    pool.stall()
    for scenario in scenarios[count:]:
        bounded(lambda: writer.put(scenario, tokens, 0.0), 2)
    held = threading.Thread(target=admit_one_more, daemon=True)
    held.start()
    held.join(0.5)
    assert held.is_alive()
    pool.fail()
    held.join(10)  # the held admission gives up once the writer has failed
    assert not held.is_alive()
    assert isinstance(raised.get_nowait(), WriterDied)
    with pytest.raises(WriterDied, match=f"stalled pool stopped; the run stopped with {count} scenario"):
        bounded(lambda: writer.put(scenarios[0], tokens, 0.0), 10)
    with pytest.raises(WriterDied):
        bounded(lambda: writer.close(), 10)
    assert len(list(out.glob("*.mp4"))) == count


def test_default_writers_and_the_option_checks(tmp_path, model):
    assert default_writers("cpu") == 0
    assert default_writers("cuda") == default_writers("cuda:1") == 0
    path = write_lines(tmp_path, lines(1))
    base = ["generate", "--scenarios", path, "--out-dir", tmp_path / "out", "--model", model, "--backend", "hf"]
    for extra, message in ((["--no-decode", "--writers", "2"], "--writers makes videos"),
                           (["--writers", "33"], "--writers must be 0 to 32"),
                           (["--decoder", "refiner", "--refiner", tmp_path / "r.pt", "--writers", "1"],
                            "--decoder refiner decodes in the engine's process")):
        result = CliRunner().invoke(app, [str(a) for a in base + extra])
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
    single = CliRunner().invoke(app, ["generate", "out.mp4", "--actions", "left", "--writers", "1"])
    assert single.exit_code == 2 and "--writers works with --scenarios FILE" in single.output
    assert not (tmp_path / "out").exists()


# -- through the CLI, in a process of its own ------------------------------------------------------

@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    """A model of Terra's 576 codes a frame and a small tokenizer of its 512 codes (what the CLI loads),
    32 channels at every level: the writer process decodes each scenario's 288x512 frames."""
    folder = tmp_path_factory.mktemp("writers_cli")
    return (write_tiny_checkpoint(folder / "model", tiny_config(layers=1)),
            save_frame_tokenizer(folder / "tokenizer", codes_bits=9))


# For the tests that act on a run once its first results line is written: the engine sleeps after each
# frame and takes no new scenario while two finished ones wait for the writer, so however slowly the writer
# process starts, at least 9 of the 12 scenarios (18 frames, 18 s) are still to run when that line appears.
# (Without them, on a loaded CI machine, the engine finished every scenario while the writer process was still
# starting, the writer then wrote all 12 in one burst, and the signal came after the run had ended.)
MID_RUN = {"TERRA_TEST_FRAME_DELAY": "1.0", "TERRA_TEST_WRITER_BACKLOG": "2"}


def start_cli(tmp_path, cli_model, count, *extra):
    model, tokenizer = cli_model
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, 576)))
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(line(f"v{i}", seed=i, frames=4)) + "\n" for i in range(count)))
    return subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "generate", "--scenarios", str(path), "--out-dir", str(tmp_path / "out"),
         "--model", str(model), "--tokenizer", str(tokenizer), "--backend", "hf", "--device", "cpu", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **MID_RUN})


def writer_pids(parent: int) -> list[int]:
    """The writer processes of a run: its spawned children (not multiprocessing's resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def wait_for_first_record(process, out: Path, seconds=180) -> list[int]:
    deadline = time.monotonic() + seconds
    while not read_results(out / RESULTS_NAME) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.poll() is None, process.stdout.read()
    return writer_pids(process.pid)


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_cli_ctrl_c_to_the_terminal_keeps_every_finished_video(tmp_path, cli_model):
    """Ctrl-C reaches every process of the terminal's group, the writer processes included: they
    ignore it and finish what the engine had finished; exit 130, every done line has its files."""
    process = start_cli(tmp_path, cli_model, 12, "--writers", "1")
    out = tmp_path / "out"
    try:
        pids = wait_for_first_record(process, out)
        assert len(pids) == 1
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    done = [r for r in read_results(out / RESULTS_NAME) if r["status"] == "done"]
    assert 1 <= len(done) < 12 and f"interrupted: {len(done)} scenario(s) written and recorded" in output
    assert files(out) == sorted([RESULTS_NAME, *(f"{r['id']}.{x}" for r in done for x in ("mp4", "npy"))])
    assert all(gone(pid) for pid in pids)


def test_cli_a_killed_writer_process_is_one_error_line(tmp_path, cli_model):
    process = start_cli(tmp_path, cli_model, 12, "--writers", "1")
    out = tmp_path / "out"
    try:
        pids = wait_for_first_record(process, out)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 2, output
    errors = [text for text in output.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and f"video writer process {pids[0]} was killed (SIGKILL" in errors[0], output
    assert "Traceback" not in output
    done = [r for r in read_results(out / RESULTS_NAME) if r["status"] == "done"]
    assert files(out) == sorted([RESULTS_NAME, *(f"{r['id']}.{x}" for r in done for x in ("mp4", "npy"))])


def test_a_ray_engine_actor_decodes_in_its_writer_process_and_dies_with_it(tmp_path):
    """The Ray actor's class, as plain Python: with --writers 1 its videos come from its own writer
    process (the same mp4 as the calling thread makes); once that process is killed, the call
    fails with WriterDied and the actor ends itself (here: `_die` recorded), for Ray to restart it
    with fresh writers instead of failing every later scenario."""
    from terra_cli.scenarios.job import ScenarioJob
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.ray_actor import EngineSpec, ScenarioEngine, ScenarioWork

    from tokenizer_decoder import ImageTokenizer, small_config

    file = read_scenarios(write_lines(tmp_path, lines(2)), Defaults())
    # a small tokenizer of Terra's frame size and codes (1024, 576 a frame) and a tiny model of its codes
    tokenizer = tmp_path / "tokenizer"
    ImageTokenizer.from_config(small_config(ch=32, ch_mult=(1,) * 5), seed=0, device="cpu").save_pretrained(tokenizer)
    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=1024, layers=1, max_frames=4))
    context = np.random.default_rng(0).integers(0, 1024, size=(file.scenarios[0].context_frames, 576))

    def engine(writers):
        job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "out", model=ModelSpec(str(model), tokenizer=str(tokenizer)),
                          engine=Engine("hf", "cpu", "float32"), writers=writers)
        return ScenarioEngine(EngineSpec(job, "hf", "cpu", needs_tokenizer=True))

    pooled, threaded = engine(1), engine(0)
    from terra_cli.scenarios.local_writer import InProcessWriter
    from terra_cli.scenarios.writers import WriterPool

    # --writers 1: a writer process; --writers 0: the actor's own threads
    assert isinstance(pooled.pool, WriterPool) and pooled.pool.size == 1 and isinstance(threaded.pool, InProcessWriter)
    first = pooled.generate(ScenarioWork(file.scenarios[0], context_tokens=context))
    same = threaded.generate(ScenarioWork(file.scenarios[0], context_tokens=context))
    np.testing.assert_array_equal(first.tokens, same.tokens)
    # generate returns with the tokens; the video is already on its way and `video` collects it, once
    assert first.video_follows and same.video_follows and set(pooled.videos) == {file.scenarios[0].id}
    video = pooled.video(first.id)
    assert video == threaded.video(same.id) and video[4:8] == b"ftyp" and not pooled.videos
    died = []
    pooled._die = died.append
    for w in pooled.pool.workers:
        os.kill(w.process.pid, signal.SIGKILL)
        w.process.join(10)
    second = pooled.generate(ScenarioWork(file.scenarios[1], context_tokens=context))
    with pytest.raises(WriterDied, match="video writer process"):
        pooled.video(second.id)
    deadline = time.monotonic() + 10
    while not died and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(died) == 1 and isinstance(died[0], WriterDied)
    pooled.pool.close()
    threaded.pool.close()


def test_frames_decoded_ahead_make_the_video_a_whole_decode_makes(tokenizer_dir):
    """FrameStore (in a writer process): frames decoded as they arrive, a few at a time, give the
    pixels a decode of the whole finished video gives; a frame whose tokens changed is decoded again;
    past the memory cap, frames wait for their video to finish."""
    from terra_cli.scenarios.frame_store import FrameStore

    tokenizer = load(tokenizer_dir)
    rng = np.random.default_rng(3)
    videos = {key: rng.integers(0, 512, size=(frames, TOKENS)) for key, frames in (("a", 7), ("b", 5))}
    store = FrameStore(tokenizer, held_frames=100)
    for index in range(7):  # interleaved, as rollouts of one batch finish their frames
        for key, tokens in videos.items():
            if index < len(tokens):
                store.add(key, index, tokens[index:index + 1])
        if index % 2:
            store.decode_waiting()
    whole = {key: tokenizer.decode_tokens(tokens, full_batches=True) for key, tokens in videos.items()}
    changed = videos["b"].copy()
    changed[4] = (changed[4] + 1) % 512  # the engine's final tokens win over what was streamed
    frames, late = store.take("b", changed)
    assert late >= 1
    np.testing.assert_array_equal(np.stack(frames)[:4], whole["b"][:4])
    np.testing.assert_array_equal(frames[4], tokenizer.decode_tokens(changed[4:5], full_batches=True)[0])
    while store.waiting:
        store.decode_waiting(partial=True)
    frames, late = store.take("a", videos["a"])
    assert late == 0 and store.count == 0 and not store.videos
    np.testing.assert_array_equal(np.stack(frames), whole["a"])
    # full batches: a frame's pixels do not depend on the frames decoded with it
    np.testing.assert_array_equal(tokenizer.decode_tokens(videos["a"][2:3], full_batches=True)[0], whole["a"][2])

    capped = FrameStore(tokenizer, held_frames=3)
    capped.add("a", 0, videos["a"])
    assert capped.count == 3 and sorted(capped.videos["a"]) == [0, 1, 2]
    frames, late = capped.take("a", videos["a"])
    assert late == 7 and capped.count == 0  # (none was decoded yet)
    np.testing.assert_array_equal(np.stack(frames), whole["a"])


def test_frames_arriving_one_at_a_time_are_decoded_ahead_only_in_full_batches(tokenizer_dir):
    """Rollouts whose frames end in different steps send one frame at a time. A writer (its loop,
    `writer_process.drive`, as both kinds of writer run it) decodes ahead only when a whole batch of
    the decoder's size waits: no batch is padded while videos are still generated, so the decoder
    needs its frames' GPU time only. The frames a video's end finds undecoded are decoded then, and
    the mp4 holds every frame."""
    import queue
    import threading

    from terra_cli.scenarios.writer_process import drive

    tokenizer, original, calls = load_counted(tokenizer_dir)
    from terra_cli.scenarios.frame_store import FrameStore

    store = FrameStore(tokenizer, held_frames=100)
    rng = np.random.default_rng(5)
    videos = {key: rng.integers(0, 512, size=(6, TOKENS)) for key in ("a", "b")}
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    folder = tempfile.mkdtemp()
    loop = threading.Thread(target=drive, args=(inbox, store, answers.put, 10.0, folder, 1), daemon=True)
    loop.start()
    sent = 0
    for index in range(6):
        for key, tokens in videos.items():
            inbox.put(("frames", key, index, tokens[index:index + 1]))
            sent += 1
            deadline = time.monotonic() + 10
            while len(calls) < sent // 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.02)  # a loop that decoded part batches would have started one by now
            assert len(calls) == sent // 4, (sent, calls)
    assert calls == [4, 4, 4] and not store.waiting  # 12 frames: three full batches, nothing padded
    for key, tokens in videos.items():
        inbox.put(("finish", key, tokens))
    done = {}
    for _ in videos:
        message = answers.get(timeout=60)
        assert message[0] == "done", message
        done[message[1]] = message
    inbox.put(None)
    loop.join(10)
    shutil.rmtree(folder)
    assert done["a"][3] == 0 and done["b"][3] == 0  # every frame was decoded ahead
    stats = store.stats()
    assert stats["decode_ahead_batches"] == 3 and stats["decode_ahead_frames"] == 12
    # the first batch's seconds are its compile's (apart); the other two batches' are timed
    assert stats["decode_ahead_timed_frames"] == 8 and stats["decode_ahead_s"] > 0 and stats["decode_late_frames"] == 0
    assert calls == [4, 4, 4]

    store = FrameStore(tokenizer, held_frames=100)  # a part batch waits for its video's end
    store.add("c", 0, videos["a"][:3])
    assert not store.full_batch_waiting() and not store.decode_waiting() and len(store.waiting) == 3
    frames, late = store.take("c", videos["a"][:3])
    assert late == 3 and calls[-1] == 3  # decoded at the end, in one call
    assert store.stats()["decode_late_frames"] == 3 and store.stats()["decode_late_s"] > 0
    np.testing.assert_array_equal(np.stack(frames), original(videos["a"][:3], full_batches=True))
    # nothing decoded before it: that first late decode (the compile's, on CUDA) is timed apart
    stats = store.stats()
    assert stats["decode_late_first_s"] == stats["decode_late_s"] and stats["decode_late_timed_frames"] == 0
    store.take("d", videos["b"][:2])
    stats = store.stats()
    assert stats["decode_late_first_s"] < stats["decode_late_s"] and stats["decode_late_timed_frames"] == 2
    assert stats["decode_late_timed_s"] == pytest.approx(stats["decode_late_s"] - stats["decode_late_first_s"], abs=2e-3)


def test_videos_ending_together_share_the_batches_of_their_last_frames(tokenizer_dir):
    """A wave of rollouts ends in one step: each video has its last frame still waiting (a part
    batch waits for more frames). The first video taken decodes its frame with the others' in the
    batch's padding, so the others find theirs decoded: one decode call for the wave's ends, not
    one a video (256 padded batches at a wave end, on a GPU beside the engine)."""
    from terra_cli.scenarios.frame_store import FrameStore

    tokenizer, original, calls = load_counted(tokenizer_dir)
    rng = np.random.default_rng(8)
    videos = {key: rng.integers(0, 512, size=(5, TOKENS)) for key in ("a", "b", "c")}
    store = FrameStore(tokenizer, held_frames=100)
    for index in range(4):
        for key, tokens in videos.items():
            store.add(key, index, tokens[index:index + 1])
            store.decode_waiting()
    assert calls == [4, 4, 4] and not store.waiting
    for key, tokens in videos.items():  # the wave's last frames: three, a part batch
        store.add(key, 4, tokens[4:5])
    assert not store.decode_waiting() and len(store.waiting) == 3
    taken = {key: store.take(key, tokens) for key, tokens in videos.items()}
    assert calls == [4, 4, 4, 3]  # one call: video a's last frame and b's and c's beside it
    assert [late for _, late in taken.values()] == [1, 0, 0]
    stats = store.stats()
    assert stats["decode_late_frames"] == 1 and stats["decode_filled_frames"] == 2
    assert store.count == 0 and not store.videos and not store.waiting
    for key, tokens in videos.items():  # the pixels a decode of the whole video gives
        np.testing.assert_array_equal(np.stack(taken[key][0]), original(tokens, full_batches=True))
    # A bad frame of another video in the padding fails neither this video nor its error message:
    # this video is decoded alone again, the other fails at its own end with its own codes
    bad = videos["b"][4:5].copy()
    bad[0, 0] = tokenizer.codebook_size + 9
    store.add("e", 0, bad)  # another video's frame, waiting, with a code past the codebook
    frames, late = store.take("d", videos["a"][4:5])  # video d's one frame, not decoded ahead
    assert late == 1 and calls[-2:] == [2, 1]  # the batch with e's frame failed; d's frame alone then
    np.testing.assert_array_equal(frames[0], original(videos["a"][4:5], full_batches=True)[0])
    with pytest.raises(ValueError, match=f"got 0?[0-9]*..{tokenizer.codebook_size + 9}"):
        store.take("e", bad)


def run_drain(tokenizer, videos: dict, encode=None):
    """`writer_process.drive` once the engine is done (--videos-at-end's drain) over `videos`, one
    encoder (`encode` in place of the mp4 encoder when given); returns (answers queue, inbox, thread, folder)."""
    from terra_cli.scenarios import writer_process
    from terra_cli.scenarios.frame_store import FrameStore

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    for key, tokens in videos.items():
        inbox.put(("finish", key, tokens))
    engine_done = threading.Event()
    engine_done.set()
    folder = tempfile.mkdtemp()
    loop = threading.Thread(target=writer_process.drive, daemon=True,
                            args=(inbox, FrameStore(tokenizer, held_frames=0), answers.put, 10.0, folder, 1),
                            kwargs={"engine_done": engine_done})
    loop.start()
    return answers, inbox, loop, folder


def test_the_drain_holds_few_decoded_videos_and_makes_each_videos_mp4(tokenizer_dir, monkeypatch):
    """--videos-at-end's drain: one finished video a decode call; no more are decoded while
    DRAIN_READY_PER_ENCODER decoded videos an encoder wait for one (20 MB each at 47 frames, every video
    of a run finished at once); the mp4s are those of each video decoded alone."""
    from terra_cli.media.frames import video_bytes
    from terra_cli.scenarios import writer_process

    assert writer_process.DRAIN_READY_PER_ENCODER == 2
    tokenizer, original, calls = load_counted(tokenizer_dir)
    rng = np.random.default_rng(9)
    videos = {f"v{i}": rng.integers(0, 512, size=(3, TOKENS)) for i in range(6)}
    release, encoding = threading.Event(), writer_process._encode

    def held_encode(*args):
        release.wait(30)
        encoding(*args)

    monkeypatch.setattr(writer_process, "_encode", held_encode)
    answers, inbox, loop, folder = run_drain(tokenizer, videos)
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a drain that decoded on while its one encoder is held would have by now
        assert calls == [3, 3, 3]  # one being encoded, two decoded waiting for it
        release.set()
        done = {}
        for _ in videos:
            message = answers.get(timeout=60)
            assert message[0] == "done", message
            done[message[1]] = message
        assert calls == [3] * 6
        for key, tokens in videos.items():
            assert done[key][3] == 3  # every frame decoded after the finish
            assert done[key][2] == video_bytes(list(original(tokens, full_batches=True)), 10.0, folder), key
    finally:
        release.set()
        inbox.put(None)
        loop.join(10)
        shutil.rmtree(folder)


def test_a_video_that_fails_in_the_drain_fails_alone(tokenizer_dir):
    """A finished video with a code past the codebook: the drain answers it with its own error and
    makes the others' mp4s."""
    tokenizer, _, _ = load_counted(tokenizer_dir)
    rng = np.random.default_rng(10)
    videos = {f"v{i}": rng.integers(0, 512, size=(3, TOKENS)) for i in range(3)}
    videos["v1"][2, 5] = tokenizer.codebook_size + 4
    answers, inbox, loop, folder = run_drain(tokenizer, videos)
    try:
        messages = {}
        for _ in videos:
            message = answers.get(timeout=60)
            messages[message[1]] = message
        assert [messages[key][0] for key in sorted(messages)] == ["done", "error", "done"]
        assert f"{tokenizer.codebook_size + 4}" in messages["v1"][2]
    finally:
        inbox.put(None)
        loop.join(10)
        shutil.rmtree(folder)


@pytest.mark.parametrize("where", ["processes", "threads"])
def test_a_writer_fed_frame_by_frame_makes_the_mp4_of_one_fed_at_the_end(tmp_path, tokenizer_dir, where):
    """Writer processes (`--writers 2`) and the engine process's own threads (`--writers 0`,
    local_writer.InProcessWriter): frames sent as they are made give the mp4 of the whole tokens."""
    from terra_cli.scenarios.local_writer import InProcessWriter
    from terra_cli.scenarios.writers import WriterPool

    tokenizer = load(tokenizer_dir)
    rng = np.random.default_rng(4)
    videos = {f"v{i}": rng.integers(0, 512, size=(4 + i, TOKENS)) for i in range(3)}
    made = {}
    for streamed in (True, False):
        # fed at the end, one process is enough (the mp4 to equal); each process start imports torch
        processes = 2 if streamed else 1
        pool = WriterPool(tokenizer, processes, fps=10) if where == "processes" else InProcessWriter(tokenizer, fps=10)
        try:
            if streamed:
                for key, tokens in videos.items():
                    pool.open(key, tokens[:2])
                for index in range(2, 6):
                    for key, tokens in videos.items():
                        if index < len(tokens):
                            pool.frame(key, index, tokens[index])
                pool.open("gone", videos["v0"][:2])
                pool.drop("gone")  # cancelled: never submitted, its frames freed
            futures = {key: pool.submit(key, tokens) for key, tokens in videos.items()}
            made[streamed] = {key: future.result(timeout=60) for key, future in futures.items()}
            late = pool.frames_decoded_late
        finally:
            pool.close()
        assert pool.videos == 3
        if not streamed:
            assert late == sum(len(t) for t in videos.values())
    assert made[True] == made[False]
    from terra_cli.media.frames import read_frames, video_bytes

    whole = {key: video_bytes(list(tokenizer.decode_tokens(tokens, full_batches=True)), 10) for key, tokens in videos.items()}
    assert made[True] == whole

    path = tmp_path / "v2.mp4"
    path.write_bytes(made[True]["v2"])
    assert len(read_frames(path)) == 6


class Counted:
    """Encodes that take 0.3 s each, counting how many ran at once (the peak, and the peak while `busy` was set)."""

    def __init__(self):
        self.lock, self.running, self.peak, self.peak_while_busy = threading.Lock(), 0, 0, 0
        self.busy = threading.Event()

    def __call__(self, frames, fps, folder=None):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            if self.busy.is_set():
                self.peak_while_busy = max(self.peak_while_busy, self.running)
        time.sleep(0.3)
        with self.lock:
            self.running -= 1
        return b"mp4 of %d frames" % len(frames)


class InstantDecoder:  # the encoders are what is counted: decoding takes no time here
    batch_size = 4

    def decode_tokens(self, tokens, full_batches=False):
        return np.zeros((len(tokens), 8, 8, 3), dtype=np.uint8)


class Scenario:
    def __init__(self, i):
        self.id, self.seed = f"s{i}", i


def test_the_engine_process_encodes_a_batch_that_ends_together_on_as_many_encoders_as_the_host_allows(monkeypatch):
    """A batch's videos end together; the threads of `--writers 0` encode on one ffmpeg per 4 cores of
    the host (4 at least, 16 at most) while videos are being generated, and on one per 2 cores (x264's
    threads, 16 at most) once none is, and write_in_order keeps enough of them open to use every encoder
    (the end of a 256-rollout run waited 43 s on 4 x H200 and 42 s on one H200 after the last frame,
    benchmarks/README.md, issue 37)."""
    import terra_cli.media.frames as frames_module
    from terra_cli.scenarios.local_writer import InProcessWriter, encoders_for_host, tail_encoders_for_host
    from terra_cli.scenarios.writers import write_in_order

    assert [encoders_for_host(cores) for cores in (2, 16, 32, 64, 256)] == [4, 4, 8, 16, 16]
    assert [tail_encoders_for_host(cores) for cores in (2, 16, 20, 32, 64)] == [4, 8, 10, 16, 16]
    monkeypatch.setattr("terra_cli.scenarios.local_writer.host_cores", lambda: 20)
    counted = Counted()
    monkeypatch.setattr(frames_module, "video_bytes", counted)
    rng = np.random.default_rng(5)
    pool = InProcessWriter(InstantDecoder(), fps=10)  # 20 cores: 5 encoders, 10 with nothing being generated
    assert (pool.encoders, pool.tail_encoders) == (5, 10)
    items: queue.Queue = queue.Queue()
    written = []
    try:
        pool.open("still-running", rng.integers(0, 512, size=(1, TOKENS)))  # a rollout the engine still makes
        counted.busy.set()
        for i in range(20):
            items.put((Scenario(i), rng.integers(0, 512, size=(2, TOKENS)), 0.0))
        for i in range(20, 40):  # the first 20 are written while it runs; the next 20 after it was dropped
            items.put((Scenario(i), rng.integers(0, 512, size=(2, TOKENS)), 0.0))
        items.put(None)

        def write(scenario, tokens, seconds, video):
            written.append((scenario.id, video))
            if len(written) == 20:
                counted.busy.clear()
                pool.drop("still-running")  # the engine has nothing in flight now

        write_in_order(pool, items, write)
    finally:
        pool.close()
    assert [key for key, _ in written] == [f"s{i}" for i in range(40)]  # in the order they finished
    assert all(video == b"mp4 of 2 frames" for _, video in written)
    assert counted.peak_while_busy == 5 and counted.peak == 10


def test_the_decode_stream_switch_is_checked_when_the_writer_starts(tokenizer_dir, monkeypatch):
    """TERRA_DECODE_STREAM (a lab switch: the decode-ahead's kernels on a stream of their own, or behind the
    engine's): a typo is one InputError when the writer is made, not a failed thread in the middle of a run."""
    from terra_cli.errors import InputError
    from terra_cli.streams import decode_stream_asked
    from terra_cli.scenarios.local_writer import InProcessWriter

    assert decode_stream_asked({}) == "own" and decode_stream_asked({"TERRA_DECODE_STREAM": " Engine"}) == "engine"
    monkeypatch.setenv("TERRA_DECODE_STREAM", "engnie")
    with pytest.raises(InputError, match="TERRA_DECODE_STREAM='engnie'"):
        InProcessWriter(load(tokenizer_dir), fps=10)
    monkeypatch.setenv("TERRA_DECODE_STREAM", "engine")
    pool = InProcessWriter(load(tokenizer_dir), fps=10)  # on the CPU there is no stream: it decodes as ever
    try:
        tokens = np.random.default_rng(6).integers(0, 512, size=(3, TOKENS))
        video = pool.submit("v", tokens).result(timeout=60)
    finally:
        pool.close()
    assert video.startswith(b"\x00\x00\x00") and b"ftyp" in video[:16]


def test_the_decoders_sm_share_is_checked_at_start_and_falls_back_to_an_own_stream_in_one_line(tokenizer_dir,
                                                                                                 monkeypatch):
    """TERRA_DECODE_SMS (a lab switch: the decode-ahead's kernels on a CUDA green context of N SMs): a bad
    value, or a clash with TERRA_DECODE_STREAM=engine, is one InputError when the writer is made; on a
    card the writer's stream is the green context's, and where torch or the driver has none the run goes
    on with a stream of its own and says why (here on the CPU with the CUDA calls stood in for)."""
    import types

    import torch

    from terra_cli.errors import InputError
    from terra_cli.streams import decode_sms_asked
    from terra_cli.scenarios import local_writer
    from terra_cli.scenarios.local_writer import InProcessWriter

    real_green_context_scope = local_writer.GreenContextScope
    assert decode_sms_asked({}) is None and decode_sms_asked({"TERRA_DECODE_SMS": " 16 "}) == 16
    for bad in ("0", "all", "-4", "16.5", "2000"):
        with pytest.raises(InputError, match="TERRA_DECODE_SMS="):
            decode_sms_asked({"TERRA_DECODE_SMS": bad})
    monkeypatch.setenv("TERRA_DECODE_SMS", "16")
    monkeypatch.setenv("TERRA_DECODE_STREAM", "engine")
    with pytest.raises(InputError, match="leave TERRA_DECODE_STREAM unset"):
        InProcessWriter(load(tokenizer_dir), fps=10)
    monkeypatch.delenv("TERRA_DECODE_STREAM")

    # The stream choice alone, on a decoder that says it is on a card (no writer thread started).
    writer = InProcessWriter.__new__(InProcessWriter)
    writer.decoder = types.SimpleNamespace(device=torch.device("cuda", 0))
    writer.decode_stream, writer.decode_sms, writer.decode_sms_error = "own", 16, None
    writer.store, writer.apart = types.SimpleNamespace(stats=lambda: {"decode_ahead_batches": 0}), None
    writer.engine_finished = None  # (decoding ahead, not after the engine)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: ("current", stream))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "a stream of its own")
    asked = []
    monkeypatch.setattr(local_writer, "GreenContextScope",
                        lambda device, sms: asked.append((device.index, sms)) or "the green context's scope")
    assert writer._own_stream() == "the green context's scope" and asked == [(0, 16)]
    assert writer.decode_stats() == {"decode_ahead_batches": 0, "decode_sms": 16, "decode_sms_error": None}

    def no_green_contexts(device, sms):
        raise RuntimeError("PyTorch was not built with Green Context support!")

    from torch.cuda import green_contexts  # a CPU build of torch has none: the real call fails as a card's would

    monkeypatch.setattr(local_writer, "GreenContextScope",
                        real_green_context_scope if not green_contexts.SUPPORTED else no_green_contexts)
    assert writer._own_stream() == ("current", "a stream of its own")
    assert writer.decode_stats()["decode_sms_error"] == "RuntimeError: PyTorch was not built with Green Context support!"


@pytest.mark.parametrize("has_stream_api", [True, False])
def test_a_green_context_scope_runs_the_block_on_a_stream_of_the_context(monkeypatch, has_stream_api):
    """GreenContextScope (TERRA_DECODE_SMS's writer thread): with torch 2.12's `Stream()` the block runs on
    the context's own stream; with torch 2.10/2.11 (none) on a stream the driver makes while the context
    is current (pooled torch streams are the primary context's), the context popped right after. The
    context object lives as long as the scope (destroying it would end its stream)."""
    import torch
    from torch.cuda import green_contexts

    from terra_cli.scenarios import local_writer

    calls = []

    class StoodInContext:
        def set_context(self):
            calls.append("set_context")

        def pop_context(self):
            calls.append("pop_context")

    if has_stream_api:
        StoodInContext.Stream = lambda self: calls.append("Stream") or "the context's stream"

    class Block:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            calls.append(("enter", self.stream))
            return self.stream

        def __exit__(self, *exc_info):
            calls.append(("exit", self.stream))
            return False

    created = []
    monkeypatch.setattr(green_contexts.GreenContext, "create",
                        staticmethod(lambda num_sms, device_id: created.append((num_sms, device_id)) or StoodInContext()))
    monkeypatch.setattr(local_writer, "driver_stream_of_current_context",
                        lambda index: calls.append(("driver stream", index)) or "a driver stream")
    monkeypatch.setattr(torch.cuda, "stream", Block)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    scope = local_writer.GreenContextScope(torch.device("cuda", 1), 16)
    assert created == [(16, 1)] and isinstance(scope.context, StoodInContext)
    with scope:
        calls.append("decoding")
    stream = "the context's stream" if has_stream_api else "a driver stream"
    made = [("set_device", 1)] + (["Stream"] if has_stream_api else ["set_context", ("driver stream", 1), "pop_context"])
    assert calls == made + [("enter", stream), "decoding", ("exit", stream)]


def test_a_writer_holds_every_frame_of_the_videos_in_flight_as_far_as_memory_allows(monkeypatch):
    """`held_frames_for`: a run of more rollouts than HELD_FRAMES covers (286 ACT-Bench rollouts an
    engine, `--max-rollouts even`) holds all their frames decoded ahead; never fewer than HELD_FRAMES;
    more only as far as a quarter of the host's available memory holds."""
    from terra_cli.runtime import available_memory_bytes
    from terra_cli.scenarios import held_frames
    from terra_cli.scenarios.held_frames import HELD_FRAMES, held_frames_for

    frame = (288, 512)
    gib = 1 << 30
    assert held_frames_for(256, 47, frame, available=0) == HELD_FRAMES  # 12,032 frames: within the floor
    assert held_frames_for(286, 47, frame, available=512 * gib) == 286 * 47
    # 25 GiB available: a quarter holds 15,170 frames of 288x512 RGB
    assert held_frames_for(400, 50, frame, available=25 * gib) == 25 * gib // 4 // (288 * 512 * 3) == 15170
    assert held_frames_for(400, 50, frame, available=8 * gib) == HELD_FRAMES  # less than the floor: the floor
    assert held_frames_for(400, 50, (64, 64), available=8 * gib) == 20000  # small frames: all of them
    monkeypatch.setattr(held_frames, "available_memory_bytes", lambda: None)  # no /proc/meminfo
    assert held_frames_for(400, 50, (64, 64)) == HELD_FRAMES
    monkeypatch.undo()
    assert available_memory_bytes() > 0  # this (Linux) host's MemAvailable


@pytest.mark.parametrize("where", ["runner", "ray"])
def test_the_run_sizes_its_writer_for_its_rollouts_in_flight(tmp_path, backend, tokenizer_dir, monkeypatch, where):
    """The scenario runner and a Ray engine actor (its class, as plain Python) start their writer for their
    in-flight count times the longest scenario (`writers.start_pool`): with the floor lowered to 4 frames,
    a run of 3 rollouts of up to 5 frames holds 15 (the bench's engine line reports the limit; the fixed
    limit gave 4, and every frame past it was decoded at its video's end)."""
    from terra_cli.scenarios import held_frames

    monkeypatch.setattr(held_frames, "HELD_FRAMES", 4)
    file = read_scenarios(write_lines(tmp_path, lines(4)), Defaults())
    assert max(s.frames for s in file.scenarios) == 5
    if where == "runner":
        run = run_scenarios(file, tmp_path / "out", backend, load(tokenizer_dir), max_rollouts=3, writers=0)
        assert run.done == 4 and run.engine_loop["decode_held_limit"] == 15
        return
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.job import ScenarioJob
    from terra_cli.scenarios.ray_actor import EngineSpec, ScenarioEngine

    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=512, layers=1, max_frames=4))
    job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "out", model=ModelSpec(str(model), tokenizer=str(tokenizer_dir)),
                      engine=Engine("hf", "cpu", "float32"), writers=0, max_rollouts=3)
    actor = ScenarioEngine(EngineSpec(job, "hf", "cpu", needs_tokenizer=True, longest_frames=5))
    try:
        assert actor.in_flight == 3 and actor.stats()["engine_loop"]["decode_held_limit"] == 15
    finally:
        actor.pool.close()


def test_a_ray_engine_actor_reports_its_intake_and_when_it_fed_its_first_batch(tmp_path, tokenizer_dir):
    """A Ray engine's intake thread (the actor's class, as plain Python) sums its encoding seconds and says
    when it had fed the engine's first in-flight count of jobs, from the engine's ready: the engine line
    then tells the encoder's share of the wait for a full batch from the calls' arrival."""
    from terra_cli.bench.engine_report import describe_engine_loop
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.job import ScenarioJob
    from terra_cli.scenarios.ray_actor import EngineSpec, ScenarioEngine, ScenarioWork

    file = read_scenarios(write_lines(tmp_path, lines(2)), Defaults())
    # the tokenizer at its own frame size: 576 tokens a frame, as the tiny model's
    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=512, layers=1, max_frames=4))
    job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "out", model=ModelSpec(str(model), tokenizer=str(tokenizer_dir)),
                      engine=Engine("hf", "cpu", "float32"), writers=0, max_rollouts=2)
    began = time.perf_counter()
    actor = ScenarioEngine(EngineSpec(job, "hf", "cpu", needs_tokenizer=True, longest_frames=5))
    try:
        before = actor.stats()["engine_loop"]
        assert before["intake_encode_s"] == 0 and "intake_first_batch_fed_s" not in before
        rng = np.random.default_rng(0)
        works = [ScenarioWork(s, context_tokens=rng.integers(0, 512, size=(s.context_frames, 576)))
                 for s in file.scenarios]
        first = bounded(lambda: actor.generate(works[0]))
        one = actor.stats()["engine_loop"]
        assert one["intake_encode_s"] > 0 and "intake_first_batch_fed_s" not in one  # 1 of 2 in flight fed
        bounded(lambda: actor.generate(works[1]))
        two = actor.stats()["engine_loop"]
        assert 0 < two["intake_first_batch_fed_s"] < time.perf_counter() - began
        assert two["intake_encode_s"] > one["intake_encode_s"]
        assert f"; the intake encoded {two['intake_encode_s']:.1f} s, its first batch of jobs fed " \
               f"{two['intake_first_batch_fed_s']:.1f} s after the engine was ready" in describe_engine_loop(two)
        assert first.id == file.scenarios[0].id
    finally:
        actor.pool.close()


def test_videos_at_end_show_a_bar_of_their_own(tmp_path, tokenizer_dir):
    """--videos-at-end writes every video after the last frame (minutes on a long run): the CLI shows
    them on a bar of their own, with its rate and ETA, that ends at the run's count."""
    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=512, layers=1, max_frames=4))
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, 576)))
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"id": f"v{i}", "context": "ctx.npy", "actions": "left",
                                                          "frames": 3, "seed": i}) + "\n" for i in range(2)))
    args = ["generate", "--scenarios", str(tmp_path / "s.jsonl"), "--model", str(model), "--tokenizer",
            str(tokenizer_dir), "--backend", "hf", "--device", "cpu", "--max-rollouts", "2"]
    at_end = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "at_end"), "--videos-at-end"])
    assert at_end.exit_code == 0, at_end.output
    bars = [line for line in at_end.output.splitlines() if line.startswith("videos")]
    assert len(bars) == 1 and "2/2 written" in bars[0], at_end.output
    plain = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "plain")])
    assert plain.exit_code == 0 and not any(line.startswith("videos") for line in plain.output.splitlines())
