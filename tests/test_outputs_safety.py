"""Full disks, concurrent writers and failures half-way: one error line, nothing half-written, and
an existing good output never lost."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import run_terra
from terra_cli.cli import app
from terra_cli.errors import OutputError
from terra_cli.media.atomic import MANIFEST_NAME, atomic_path, atomic_save_npy
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

TOKENS = 16


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("safety_model"), tiny_config(image_tokens=TOKENS, layers=1))


def _generate_tokens(model, folder: Path, target: Path, *extra):
    return CliRunner().invoke(app, ["generate", "--model", str(model), "--context-tokens", str(folder / "ctx.npy"),
                                    "--actions", "left", "--frames", "4", "--backend", "hf", "--device", "cpu",
                                    "--no-decode", "--save-tokens", str(target), *extra])


def test_full_disk_while_saving_tokens_keeps_the_old_file(tmp_path, model, monkeypatch):
    target = tmp_path / "out.npy"
    np.save(target, np.arange(3))
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, TOKENS)))
    good = target.read_bytes()
    monkeypatch.setattr(np, "save", _no_space)
    result = _generate_tokens(model, tmp_path, target, "--overwrite")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left" in errors[0] and str(target) in errors[0]
    assert "Traceback" not in result.output
    assert target.read_bytes() == good
    assert _listing(tmp_path) == ["ctx.npy", "out.npy"]  # no hidden .partial file


def test_full_disk_while_encoding_a_video_places_nothing(tmp_path, monkeypatch):
    import imageio_ffmpeg

    from terra_cli.media import frames as media_frames

    frames = [np.zeros((32, 32, 3), np.uint8)] * 3
    target = tmp_path / "v.mp4"
    # an ffmpeg whose output disk is full: it reads its input, says so and exits 1
    full_disk = tmp_path.parent / f"{tmp_path.name}-ffmpeg-full-disk"
    full_disk.write_text("#!/bin/sh\ncat > /dev/null\necho \"$0: No space left on device\" >&2\nexit 1\n")
    full_disk.chmod(0o755)
    real_ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(full_disk))
    with pytest.raises(OutputError, match="no space left"):
        media_frames.write_video(target, frames)
    assert _listing(tmp_path) == []
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: real_ffmpeg)
    # ffmpeg failing late (no trailer) still exits 0 and leaves a file: the read-back catches it
    monkeypatch.setattr(media_frames, "_video_frame_count", lambda path: 1)
    with pytest.raises(media_frames.MediaError, match="1 readable frame"):
        media_frames.write_video(target, frames)
    assert _listing(tmp_path) == []


def test_a_real_full_tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "old.npy").write_bytes(b"old")
        with pytest.raises(OutputError, match="no space left"):
            atomic_save_npy(mount / "old.npy", np.zeros(1_000_000, np.int64), overwrite=True)
        assert _listing(mount) == ["old.npy"] and (mount / "old.npy").read_bytes() == b"old"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_the_second_writer_gets_one_clear_error(tmp_path):
    target = tmp_path / "t.npy"
    with pytest.raises(OutputError, match="appeared while this run was writing"):
        with atomic_path(target, overwrite=False) as mine:
            mine.write_bytes(b"mine")
            with atomic_path(target, overwrite=False) as theirs:
                theirs.write_bytes(b"theirs")
    assert target.read_bytes() == b"theirs"
    assert _listing(tmp_path) == ["t.npy"]
    # with overwrite, the last complete file wins
    with atomic_path(target, overwrite=True) as a, atomic_path(target, overwrite=True) as b:
        a.write_bytes(b"a" * 1000)
        b.write_bytes(b"b" * 10)
    assert target.read_bytes() == b"a" * 1000


def test_a_failed_reconstruct_keeps_the_old_folder_whole(tmp_path, monkeypatch, frame_tokenizer):
    from PIL import Image

    from tokenizer_decoder import ImageTokenizer

    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.fromarray(np.full((288, 512, 3), 40 * i, np.uint8)).save(frames / f"f{i}.png")
    recon = tmp_path / "recon"
    recon.mkdir()
    (recon / "frame_0000.png").write_bytes(b"old frame")
    real_decode = ImageTokenizer.decode_tokens
    calls = []

    def decode_then_fail(self, tokens):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_decode(self, tokens)

    monkeypatch.setattr(ImageTokenizer, "decode_tokens", decode_then_fail)
    args = ["tokenize", str(frames), "--out", str(tmp_path / "t.npy"), "--reconstruct", str(recon),
            "--batch-size", "1", "--overwrite", "--tokenizer", frame_tokenizer, "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "no space left" in result.output and "Traceback" not in result.output
    assert _listing(recon) == ["frame_0000.png"] and (recon / "frame_0000.png").read_bytes() == b"old frame"
    assert _listing(tmp_path) == ["frames", "recon"]  # no tokens, no partial folder
    monkeypatch.setattr(ImageTokenizer, "decode_tokens", real_decode)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert _listing(recon) == [MANIFEST_NAME, "frame_0000.png", "frame_0001.png", "frame_0002.png"]
    assert (recon / "frame_0000.png").read_bytes() != b"old frame"


def test_without_ffmpeg_a_video_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import sys

    import terra_cli.models.resolve as resolve

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # `import imageio_ffmpeg` now fails

    def no_model_expected(*args, **kwargs):
        raise AssertionError("a model was resolved before the video writer was checked")

    monkeypatch.setattr(resolve, "resolve_model", no_model_expected)
    scenarios = tmp_path / "s.jsonl"
    scenarios.write_text('{"id": "a", "actions": "left"}\n')
    for args in (["generate", str(tmp_path / "out.mp4"), "--actions", "left", "--frames", "4", "--backend", "hf"],
                 ["generate", "--scenarios", str(scenarios), "--out-dir", str(tmp_path / "videos"), "--backend", "hf"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "pip install imageio-ffmpeg" in errors[0] and "--no-decode" in errors[0], result.output
    assert _listing(tmp_path) == ["s.jsonl"]


# --- issue 30: outputs that must never delete the working directory, the input or other files ---


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _one_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def _no_model(monkeypatch):
    import terra_cli.models.resolve as resolve

    def no_model_expected(*args, **kwargs):
        raise AssertionError("a model was resolved before the outputs were checked")

    monkeypatch.setattr(resolve, "resolve_model", no_model_expected)


def _images(folder: Path, count: int) -> Path:
    from PIL import Image

    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(np.full((36, 64, 3), 60 * i, np.uint8)).save(folder / f"in{i}.png")
    return folder


@pytest.mark.parametrize("frames_dir", ["$PWD", ".", ".."])
def test_save_frames_never_takes_the_working_directory(tmp_path, monkeypatch, frames_dir):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("the user's files")
    (work / "frame_0000.png").write_bytes(b"the user's picture")
    monkeypatch.chdir(work)
    _no_model(monkeypatch)
    before = _snapshot(tmp_path)
    target = str(work) if frames_dir == "$PWD" else frames_dir
    result = CliRunner().invoke(app, ["generate", "o.mp4", "--frames", "4", "--actions", "left", "--backend", "hf",
                                      "--save-frames", target, "--overwrite"])
    assert "contains the working directory" in _one_error(result)
    assert _snapshot(tmp_path) == before


def test_reconstruct_never_takes_the_input(tmp_path, monkeypatch):
    inputs = _images(tmp_path / "in", 2)
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    before = _snapshot(tmp_path)
    for target, message in ((inputs, "is also the input INPUT"), (tmp_path / "in" / ".." / "in", "is also the input"),
                            (tmp_path / "in" / "in0.png", "is a file")):
        result = CliRunner().invoke(app, ["tokenize", str(inputs), "--out", str(tmp_path / "t.npy"),
                                          "--reconstruct", str(target), "--overwrite"])
        assert message in _one_error(result)
    outer = tmp_path / "outer"
    _images(outer / "clip", 1)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(app, ["tokenize", str(outer / "clip"), "--out", str(tmp_path / "t.npy"),
                                      "--reconstruct", str(outer), "--overwrite"])
    assert "holds the input INPUT" in _one_error(result)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["generate", "tokenize"])
def test_an_output_inside_an_output_folder_is_refused_before_any_model(tmp_path, monkeypatch, command):
    folder = tmp_path / "fr"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    monkeypatch.chdir(tmp_path)
    _no_model(monkeypatch)
    _images(tmp_path / "in", 1)
    before = _snapshot(tmp_path)
    for overwrite in ([], ["--overwrite"]):
        if command == "generate":
            args = ["generate", "o.mp4", "--frames", "4", "--actions", "left", "--backend", "hf",
                    "--save-tokens", "fr/t.npy", "--save-frames", "fr", *overwrite]
        else:
            args = ["tokenize", "in", "--out", "fr/t.npy", "--reconstruct", "fr", *overwrite]
        error = _one_error(CliRunner().invoke(app, args))
        assert "fr/t.npy lies inside" in error, error
    assert _snapshot(tmp_path) == before


def test_overwriting_a_frames_folder_replaces_frame_files_only(tmp_path, frame_tokenizer):
    """The CLI end to end: unrelated files and frames no terra run made survive --overwrite; frames
    an earlier run made and this one does not write again are removed. (conftest's frame_tokenizer:
    Terra's frame size, a third of the embedded tokenizer's time; files are the point.)"""
    inputs = _images(tmp_path / "in", 2)
    recon = tmp_path / "recon"
    recon.mkdir()
    (recon / "notes.txt").write_text("unrelated")
    (recon / "frame_0000.png").write_bytes(b"the user's frame 0")
    (recon / "frame_0007.png").write_bytes(b"the user's frame 7")

    def tokenize(*extra):
        return CliRunner().invoke(app, ["tokenize", str(inputs), "--out", str(tmp_path / "t.npy"), "--reconstruct",
                                        str(recon), "--tokenizer", frame_tokenizer, "--device", "cpu",
                                        *extra])

    assert "is not empty" in _one_error(tokenize())
    result = tokenize("--overwrite")
    assert result.exit_code == 0, result.output
    assert _listing(recon) == [MANIFEST_NAME, "frame_0000.png", "frame_0001.png", "frame_0007.png", "notes.txt"]
    assert (recon / "notes.txt").read_text() == "unrelated"
    assert (recon / "frame_0007.png").read_bytes() == b"the user's frame 7"
    assert (recon / "frame_0000.png").read_bytes().startswith(b"\x89PNG")
    result = tokenize("--overwrite", "--max-frames", "1")
    assert result.exit_code == 0, result.output
    # frame_0001 was this command's own, unchanged since: gone; the rest stays
    assert _listing(recon) == [MANIFEST_NAME, "frame_0000.png", "frame_0007.png", "notes.txt"]


def test_a_frames_folder_is_placed_whole_and_only_terra_made_files_go(tmp_path):
    from terra_cli.media.frames import write_frame_folder

    frames = [np.full((8, 8, 3), v, np.uint8) for v in (10, 20, 30)]
    target = tmp_path / "a" / "frames"
    write_frame_folder(target, frames)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((target / "frame_0000.png").stat().st_mode) == 0o666 & ~umask
    assert _listing(target) == [MANIFEST_NAME, "frame_0000.png", "frame_0001.png", "frame_0002.png"]
    # Without overwrite a folder that is not empty is never written into.
    with pytest.raises(OutputError, match="was filled while this run was writing"):
        write_frame_folder(target, frames[:1])
    (target / "frame_0001.png").write_bytes(b"edited by the user")  # no longer what terra made
    same_size = bytes(len((target / "frame_0002.png").read_bytes()))  # an edit the size check cannot see
    (target / "frame_0002.png").write_bytes(same_size)
    made = (target / "frame_0002.png").stat()
    os.utime(target / "frame_0002.png", ns=(made.st_atime_ns, made.st_mtime_ns + 10**9))
    (target / "mine.txt").write_text("mine")
    write_frame_folder(target, frames[:1], overwrite=True)
    assert _listing(target) == [MANIFEST_NAME, "frame_0000.png", "frame_0001.png", "frame_0002.png", "mine.txt"]
    assert (target / "frame_0001.png").read_bytes() == b"edited by the user"
    assert (target / "frame_0002.png").read_bytes() == same_size
    # A manifest naming files outside the folder, or the user's files, deletes nothing of theirs.
    (target / MANIFEST_NAME).write_text(json.dumps({"written_by": "terra", "files": {
        "../outside.txt": [3, 0], "mine.txt": [1, 0], "/etc/passwd": [1, 0]}}))
    (tmp_path / "a" / "outside.txt").write_text("out")
    write_frame_folder(target, frames[:1], overwrite=True)
    assert (target / "mine.txt").read_text() == "mine" and (tmp_path / "a" / "outside.txt").read_text() == "out"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["frames", "outside.txt"]  # no temporary left


def test_writers_refuse_to_replace_unless_told(tmp_path):
    from terra_cli.evaluation.report import save_json
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.pipeline.outputs import OutputPlan

    target = tmp_path / "r.json"
    target.write_text("the user's")
    for write in (lambda: save_json({"a": 1}, target), lambda: atomic_write_json(target, {"a": 1}),
                  lambda: atomic_save_npy(target, np.zeros(2))):
        with pytest.raises(OutputError, match="appeared while this run was writing"):
            write()
    assert target.read_text() == "the user's"
    plan = OutputPlan(overwrite=False)
    fresh = plan.file("--out", tmp_path / "new.json")
    assert not plan.may_replace(fresh)
    atomic_write_json(fresh, {"partial": 1}, overwrite=plan.may_replace(fresh))
    plan.made(fresh)
    assert plan.may_replace(fresh)  # a run may replace what it made itself (a bench's partial results)
    atomic_write_json(fresh, {"final": 1}, overwrite=plan.may_replace(fresh))
    assert json.loads(fresh.read_text()) == {"final": 1}


@pytest.mark.parametrize("case", ["generate --context", "generate --context-tokens", "tokenize"])
def test_a_named_pipe_as_input_is_refused_within_seconds(tmp_path, case):
    fifo = tmp_path / ("in.npy" if case.endswith("tokens") else "in.png")
    os.mkfifo(fifo)
    if case == "tokenize":
        args = ["tokenize", fifo, "--out", tmp_path / "t.npy"]
    else:
        args = ["generate", tmp_path / "o.mp4", "--actions", "left", "--frames", "4", "--backend", "hf",
                case.split()[1], fifo]
    result = run_terra(*args, timeout=120)  # a blocked open() would end in TimeoutExpired
    assert result.returncode == 2, result.stderr
    assert "is a named pipe (FIFO)" in result.stderr and "Traceback" not in result.stderr
    assert _listing(tmp_path) == [fifo.name]


def test_no_output_lands_inside_a_checkpoint_folder_even_with_overwrite(tmp_path):
    """`eval --out model/config.json --overwrite` replaced the checkpoint's config with the eval's JSON."""
    from conftest import invoke_terra

    model = write_tiny_checkpoint(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in Path(model).iterdir()}
    cases = [
        ["eval", "--model", model, "--out", Path(model) / "config.json", "--overwrite"],
        ["generate", "--model", model, "--context-tokens", tmp_path / "c.npy", "--actions", "left", "--frames", 4,
         "--no-decode", "--save-tokens", Path(model) / "t.npy", "--overwrite", "--backend", "hf"],
        ["bench", "--scenarios", 2, "--model", model, "--out", Path(model) / "config.json", "--overwrite"],
    ]
    np.save(tmp_path / "c.npy", np.zeros((2, 576), np.int64))
    for args in cases:
        result = invoke_terra(*args)
        assert result.returncode == 2 and "lies inside the checkpoint --model" in result.stderr, (args, result.stderr)
    assert {p.name: p.read_bytes() for p in Path(model).iterdir()} == before
