"""`terra generate --scenarios` keeps the user's data (issue #30): bad lines listed with their line
numbers before any model loads, two scenarios never share a file, a user's file in --out-dir is
never replaced without --overwrite, one run per --out-dir, a broken results log ends the run
within seconds, SIGTERM ends a run, and a changed line is not silently resumed."""

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.backends.base import MAX_SEED
from terra_cli.backends.hf import HfBackend
from terra_cli.cli import app
from terra_cli.errors import OutputError
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.scenarios.outdir import LOCK_NAME, OutDirLock
from terra_cli.scenarios.runner import RESULTS_NAME, completed_ids, read_results, run_scenarios
from terra_cli.scenarios.spec import Defaults, read_scenarios

TOKENS = 16
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("safety_model"), tiny_config(image_tokens=TOKENS, layers=1))


@pytest.fixture(scope="module")
def backend(model):
    return HfBackend(model, device="cpu", dtype="float32")


def write_lines(folder: Path, lines, name="s.jsonl") -> Path:
    np.save(folder / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, TOKENS)))
    path = folder / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def line(sid, **extra):
    return {"id": sid, "context": "ctx.npy", "actions": "left", "frames": 3, **extra}


def bounded(fn, seconds=120):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds} s (hung)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def cli(*args):
    return bounded(lambda: CliRunner().invoke(app, [str(a) for a in args]))


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG that only claims its size: enough for a header check, no gigabytes to make it."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def test_every_bad_line_is_listed_with_its_number_before_any_model_loads(tmp_path):
    png_header(tmp_path / "huge.png", 20000, 20000)  # above PIL's own bomb limit
    png_header(tmp_path / "big.png", 9000, 9000)  # below PIL's limit, above terra's 8192x8192
    os.mkfifo(tmp_path / "pipe.png")
    os.mkfifo(tmp_path / "pipe.npy")
    os.mkfifo(tmp_path / "acts.npy")
    wide = [[[0.0, 1.0, 0.45]] * 6] * 10_001
    bad = {
        2: line("huge", context="huge.png"),
        3: line("big", context="big.png"),
        4: '{"id": "digits", "actions": "left", "seed": ' + "9" * 5000 + "}",
        5: '{"id": "deep", "actions": ' + "[" * 100_000 + "]" * 100_000 + "}",
        6: line("newline\n"),
        7: line("inf39", actions=[[[1e39, 1.0, 0.45]] * 6] * 2),
        8: line("inf308", actions=[[[0.0, 1e308, 0.45]] * 6] * 2),
        9: line("seed", seed=MAX_SEED + 1),
        10: line("wide", actions=wide),
        11: line("fifo_image", context="pipe.png"),
        12: line("fifo_tokens", context="pipe.npy"),
        13: line("fifo_actions", actions="acts.npy"),
        14: line("../up"),
    }
    path = write_lines(tmp_path, [line("ok"), *bad.values(), line("OK")])
    out = tmp_path / "out"
    result = cli("generate", "--scenarios", path, "--out-dir", out, "--model", tmp_path / "no-such-model")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output
    for number in [*bad, 15]:
        assert f"line {number}:" in result.output, (number, result.output)
    assert "line 1:" not in result.output
    assert "differs only in case" in result.output  # OK vs ok: one file on macOS
    assert not out.exists()  # nothing written; the (missing) model was never looked at


def test_truncated_or_damaged_context_images_are_caught_at_line_validation(tmp_path):
    """Issue 38: a truncated PNG passed the header-only check and failed after the model loaded,
    with no line number and an empty out/ left behind."""
    from PIL import Image

    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (144, 256, 3), dtype=np.uint8))
    picture.save(tmp_path / "good.png")
    picture.save(tmp_path / "good.jpg", quality=90)
    png, jpg = (tmp_path / "good.png").read_bytes(), (tmp_path / "good.jpg").read_bytes()
    (tmp_path / "cut.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "cut.jpg").write_bytes(jpg[: len(jpg) // 2])
    flipped = bytearray(png)
    flipped[len(png) // 2] ^= 0xFF  # one byte of the image data: its chunk's checksum no longer matches
    (tmp_path / "flipped.png").write_bytes(bytes(flipped))
    lines = [line("a", context="good.png"), line("b", context="cut.png"), line("c", context="good.jpg"),
             line("d", context="cut.jpg"), line("e", context="flipped.png")]
    out = tmp_path / "out"
    result = cli("generate", "--scenarios", write_lines(tmp_path, lines), "--out-dir", out,
                 "--model", tmp_path / "no-such-model")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output
    for number in (2, 4, 5):
        assert f"line {number}:" in result.output, (number, result.output)
    assert "line 1:" not in result.output and "line 3:" not in result.output
    assert not out.exists()


def test_seed_plus_rollouts_past_the_maximum_is_refused(tmp_path):
    path = write_lines(tmp_path, [line("a", seed=MAX_SEED), line("b", seed=MAX_SEED - 1)])
    assert not read_scenarios(path, Defaults()).problems
    file = read_scenarios(path, Defaults(), rollouts=3)
    assert [(p.line, "above the maximum seed" in p.message) for p in file.problems] == [(1, True), (2, True)]


def act_bench(sample_id, images):
    return {"sample_id": sample_id, "context_frames": images,
            "instruction_trajs": [[[0.4 * i, 0.0] for i in range(60)]] * 47}


def test_two_scenarios_that_map_to_one_file_are_refused(tmp_path):
    from PIL import Image

    images = []
    for i in range(3):
        Image.new("RGB", (64, 36)).save(tmp_path / f"{i}.png")
        images.append(f"{i}.png")
    path = write_lines(tmp_path, [act_bench(1, images), act_bench("01", images), act_bench("000001", images),
                                  act_bench(7, images), line("NUSCENES_ACTION_000007"), line("Run"), line("run")])
    file = read_scenarios(path, Defaults())
    assert [s.id for s in file.scenarios] == ["1", "7", "Run"]
    messages = {p.line: p.message for p in file.problems}
    assert sorted(messages) == [2, 3, 5, 7]
    assert "NUSCENES_ACTION_000001.*" in messages[2] and "line 1" in messages[2] and "line 1" in messages[3]
    assert "line 4" in messages[5] and "differs only in case" in messages[7]
    out = tmp_path / "out"
    result = cli("generate", "--scenarios", path, "--out-dir", out, "--model", tmp_path / "no-such-model")
    assert result.exit_code == 2 and "line 2:" in result.output and "line 5:" in result.output, result.output
    assert not out.exists()


def test_tokens_outside_the_models_codes_are_listed_before_its_weights_load(tmp_path, model):
    np.save(tmp_path / "high.npy", np.full((2, TOKENS), 512))  # the tiny model's codes are 0..511
    np.save(tmp_path / "narrow.npy", np.zeros((2, 8), dtype=np.int64))
    path = write_lines(tmp_path, [line("a"), line("b", context="high.npy"), line("c", context="narrow.npy")])
    result = cli("generate", "--scenarios", path, "--out-dir", tmp_path / "out", "--model", model,
                 "--backend", "hf", "--no-decode")
    assert result.exit_code == 2, result.output
    assert "line 2:" in result.output and "0..511" in result.output and "line 3:" in result.output
    assert not (tmp_path / "out").exists()


def test_a_users_file_in_out_dir_survives_without_overwrite(tmp_path, model):
    path = write_lines(tmp_path, [line("s1"), line("s2")])
    out = tmp_path / "out"
    out.mkdir()
    (out / "s1.npy").write_text("precious")
    common = ["generate", "--scenarios", path, "--out-dir", out, "--model", model, "--backend", "hf", "--no-decode"]
    result = cli(*common)
    assert result.exit_code == 2, result.output
    assert "s1.npy (line 1)" in result.output and "--overwrite" in result.output
    assert (out / "s1.npy").read_text() == "precious" and not (out / "s2.npy").exists()
    assert not (out / RESULTS_NAME).exists()
    result = cli(*common, "--overwrite")
    assert result.exit_code == 0, result.output
    assert np.load(out / "s1.npy").shape == (3, TOKENS)
    assert completed_ids(out) == {"s1", "s2"}
    assert not (out / LOCK_NAME).exists()


def test_no_output_or_results_log_replaces_an_input_or_a_users_log_even_with_overwrite(tmp_path, model):
    """--out-dir the scenario file's own folder: a line whose id names its own context or actions
    file, the scenario file named results.jsonl, a results.jsonl of the user's own lines."""
    def digests(folder):
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    common = ["--model", model, "--backend", "hf", "--no-decode", "--overwrite"]
    path = write_lines(tmp_path, [line("ctx")])  # writes ctx.npy, the line's own context
    np.save(tmp_path / "acts.npy", np.zeros((3, 6, 3), dtype=np.float32))
    actions = write_lines(tmp_path, [line("acts", actions="acts.npy")], "a.jsonl")
    for scenarios, name in ((path, "ctx.npy"), (actions, "acts.npy")):
        before = digests(tmp_path)
        result = cli("generate", "--scenarios", scenarios, "--out-dir", tmp_path, *common)
        assert result.exit_code == 2 and f"{name} (line 1) is an input of this run" in result.output, result.output
        assert digests(tmp_path) == before
    (tmp_path / "own").mkdir()
    log_is_input = write_lines(tmp_path / "own", [line("x")], RESULTS_NAME)
    result = cli("generate", "--scenarios", log_is_input, "--out-dir", tmp_path / "own", *common)
    assert result.exit_code == 2 and "results.jsonl is an input of this run" in result.output, result.output
    users = tmp_path / "users"
    users.mkdir()
    (users / RESULTS_NAME).write_text("my own notes line\n")
    result = cli("generate", "--scenarios", path, "--out-dir", users, *common)
    assert result.exit_code == 2 and "results.jsonl is not a terra results log" in result.output, result.output
    assert (users / RESULTS_NAME).read_text() == "my own notes line\n" and not (users / "ctx.npy").exists()
    (users / RESULTS_NAME).write_text('{"digest": "sha256:0", "id": "ctx", "line": 1, "pa')  # a crash's cut line: terra's
    resumed = cli("generate", "--scenarios", path, "--out-dir", users, *common)
    assert resumed.exit_code == 0, resumed.output
    ours = cli("generate", "--scenarios", path, "--out-dir", tmp_path / "out", *common)
    assert ours.exit_code == 0, ours.output
    again = cli("generate", "--scenarios", path, "--out-dir", tmp_path / "out", *common)  # terra's own log: resumes
    assert again.exit_code == 0 and "already done" in again.output, again.output


def test_a_changed_line_with_the_same_id_is_refused_on_resume(tmp_path, model):
    out = tmp_path / "out"
    common = ["--out-dir", out, "--model", model, "--backend", "hf", "--no-decode"]
    first = cli("generate", "--scenarios", write_lines(tmp_path, [line("a"), line("b")]), *common)
    assert first.exit_code == 0, first.output
    changed = write_lines(tmp_path, [line("a"), line("b", frames=4)])
    result = cli("generate", "--scenarios", changed, *common)
    assert result.exit_code == 2, result.output
    assert "'b' (line 2)" in result.output and "changed" in result.output
    assert np.load(out / "b.npy").shape[0] == 3  # the old video is kept, not claimed as the new one
    result = cli("generate", "--scenarios", changed, *common, "--overwrite")
    assert result.exit_code == 0 and "1 scenario(s) written, 1 already done" in result.output, result.output
    assert np.load(out / "b.npy").shape[0] == 4
    again = cli("generate", "--scenarios", changed, *common)
    assert again.exit_code == 0 and "0 scenario(s) written, 2 already done" in again.output, again.output


def test_one_run_per_out_dir_and_a_stale_lock_is_taken_over(tmp_path, model):
    path = write_lines(tmp_path, [line("a")])
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom terra_cli.scenarios.outdir import OutDirLock\n"
         "with OutDirLock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n", str(out)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        result = cli("generate", "--scenarios", path, "--out-dir", out, "--model", model, "--backend", "hf",
                     "--no-decode")
        assert result.exit_code == 2, result.output
        assert "in use by another terra run" in result.output and f"pid {holder.pid}" in result.output
        assert not (out / "a.npy").exists() and not (out / RESULTS_NAME).exists()
    finally:
        holder.kill()  # as a crash would: the lock file stays, the lock goes with the process
        holder.wait()
    assert (out / LOCK_NAME).exists()
    result = cli("generate", "--scenarios", path, "--out-dir", out, "--model", model, "--backend", "hf", "--no-decode")
    assert result.exit_code == 0, result.output
    assert completed_ids(out) == {"a"} and not (out / LOCK_NAME).exists()
    with OutDirLock(out), OutDirLock(out):  # re-entrant in one process (the CLI around run_scenarios)
        assert (out / LOCK_NAME).exists()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("count", [2, 70])
@pytest.mark.parametrize("broken", ["folder", "dev-full"])
def test_a_results_log_that_cannot_be_appended_is_refused_up_front(tmp_path, count, broken):
    path = write_lines(tmp_path, [line(f"v{i}") for i in range(count)])
    out = tmp_path / "out"
    out.mkdir()
    if broken == "folder":
        (out / RESULTS_NAME).mkdir()
    else:
        (out / RESULTS_NAME).symlink_to("/dev/full")
    result = cli("generate", "--scenarios", path, "--out-dir", out, "--model", tmp_path / "no-such-model")
    assert result.exit_code == 2, result.output
    assert "results.jsonl is not a regular file" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("count", [2, 70])
def test_a_results_log_failing_mid_run_ends_it_within_seconds(tmp_path, backend, count):
    """The log breaks after the first record (a full disk, here /dev/full): the run ends with one
    error naming the log, never hangs on the writer's full queue (70 > its 64 slots), keeps the
    recorded scenario, and leaves no file that results.jsonl does not account for."""
    file = read_scenarios(write_lines(tmp_path, [line(f"v{i}") for i in range(count)]), Defaults())
    out = tmp_path / "out"
    log = out / RESULTS_NAME

    def break_the_log(record):
        if record["id"] == "v0":
            log.rename(out / "kept.jsonl")
            log.symlink_to("/dev/full")

    with pytest.raises(OutputError, match=r"results\.jsonl.*no space left.*1 scenario\(s\) written and recorded"):
        bounded(lambda: run_scenarios(file, out, backend, None, max_rollouts=1, on_written=break_the_log), 120)
    log.unlink()
    (out / "kept.jsonl").rename(log)
    assert completed_ids(out) == {"v0"}
    assert sorted(p.name for p in out.iterdir()) == [RESULTS_NAME, "v0.npy"]  # v1's unrecorded files removed
    rerun = bounded(lambda: run_scenarios(file, out, backend, None, max_rollouts=1), 120)
    assert (rerun.resumed, rerun.done) == (1, count - 1)


def test_sigterm_ends_a_run_and_every_done_record_is_true(tmp_path, model):
    path = write_lines(tmp_path, [line(f"v{i}", frames=25) for i in range(70)])  # long enough to stop midway
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "generate", "--scenarios", str(path), "--out-dir", str(out),
         "--model", str(model), "--backend", "hf", "--device", "cpu", "--no-decode"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 180
        while not read_results(out / RESULTS_NAME) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process.poll() is None, process.stdout.read()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, output
    done = [r for r in read_results(out / RESULTS_NAME) if r["status"] == "done"]
    assert 1 <= len(done) < 70
    assert f"interrupted: {len(done)} scenario(s) written and recorded" in output
    assert sorted(p.name for p in out.iterdir()) == sorted([RESULTS_NAME, *(f"{r['id']}.npy" for r in done)])
    assert all(r["digest"].startswith("sha256:") for r in done)


def test_out_dirs_that_cannot_be_written_are_one_line(tmp_path):
    path = write_lines(tmp_path, [line("a")])
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out_dir, expected in ((Path("/proc/terra-out"), "is not writable"),
                              (tmp_path / "dangling", "which does not exist"),
                              (path, "is a file")):
        result = cli("generate", "--scenarios", path, "--out-dir", out_dir, "--model", tmp_path / "no-such-model")
        assert result.exit_code == 2 and expected in result.output, (out_dir, result.output)


def test_the_same_line_read_through_another_path_resumes(tmp_path, model, monkeypatch):
    """The digest names context files as the line does, so cd-ing elsewhere is not a change."""
    path = write_lines(tmp_path, [line("a"), line("b", seed=3)])
    common = ["--model", model, "--backend", "hf", "--no-decode"]
    first = cli("generate", "--scenarios", path, "--out-dir", tmp_path / "out", *common)
    assert first.exit_code == 0, first.output
    monkeypatch.chdir(tmp_path)
    again = cli("generate", "--scenarios", "s.jsonl", "--out-dir", "out", *common)
    assert again.exit_code == 0 and "0 scenario(s) written, 2 already done" in again.output, again.output
    samples = read_scenarios(path, Defaults(), rollouts=2).scenarios
    assert len({s.digest for s in samples}) == 4


def test_outputs_blocked_by_a_folder_or_a_file_are_refused_up_front(tmp_path):
    from terra_cli.scenarios.outdir import plan_outputs

    file = read_scenarios(write_lines(tmp_path, [line("a"), line("b")]), Defaults())
    out = tmp_path / "out"
    (out / "a.npy").mkdir(parents=True)
    with pytest.raises(OutputError, match=r"cannot be written: a\.npy \(line 1\) is a folder"):
        plan_outputs(file.scenarios, out, decode=False, overwrite=True)
    from PIL import Image

    Image.new("RGB", (64, 36)).save(tmp_path / "0.png")
    act = read_scenarios(write_lines(tmp_path, [act_bench(3, ["0.png"] * 3)], "act.jsonl"), Defaults(frames=5),
                         rollouts=2)
    assert [s.output_stem for s in act.scenarios] == ["s0/NUSCENES_ACTION_000003", "s1/NUSCENES_ACTION_000003"]
    (out / "s1").write_text("mine")  # where the second sample's folder goes
    with pytest.raises(OutputError, match=r"s1 \(line 1\) is a file where a folder goes"):
        plan_outputs(act.scenarios, out, decode=True, overwrite=True)


def test_two_threads_of_one_process_do_not_share_an_out_dir(tmp_path):
    """A server running two jobs in threads gets the same exclusion as two processes."""
    out = tmp_path / "out"
    with OutDirLock(out):
        with pytest.raises(OutputError, match=f"in use by another terra run \\(pid {os.getpid()}"):
            bounded(lambda: OutDirLock(out).__enter__(), 30)
    with OutDirLock(out):  # let go: free again
        pass
