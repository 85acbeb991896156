"""Full disks, concurrent writers and failures half-way: one error line, nothing half-written, and
an existing good output never lost."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.cli import app
from terra_cli.errors import OutputError
from terra_cli.media.atomic import atomic_path, atomic_save_npy
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
    import imageio.v2 as iio

    from terra_cli.media import frames as media_frames

    frames = [np.zeros((32, 32, 3), np.uint8)] * 3
    target = tmp_path / "v.mp4"
    real_get_writer = iio.get_writer

    class FailingWriter:
        def __init__(self, *args, **kwargs):
            self.inner = real_get_writer(*args, **kwargs)
            self.count = 0

        def append_data(self, frame):
            self.count += 1
            if self.count == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.inner.append_data(frame)

        def close(self):
            self.inner.close()

    monkeypatch.setattr(iio, "get_writer", FailingWriter)
    with pytest.raises(OutputError, match="no space left"):
        media_frames.write_video(target, frames)
    assert _listing(tmp_path) == []
    monkeypatch.setattr(iio, "get_writer", real_get_writer)
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


def test_a_failed_reconstruct_keeps_the_old_folder_whole(tmp_path, monkeypatch):
    from PIL import Image

    from terra_cli.models.default import default_tokenizer_dir
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
            "--batch-size", "1", "--overwrite", "--tokenizer", str(default_tokenizer_dir()), "--device", "cpu"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "no space left" in result.output and "Traceback" not in result.output
    assert _listing(recon) == ["frame_0000.png"] and (recon / "frame_0000.png").read_bytes() == b"old frame"
    assert _listing(tmp_path) == ["frames", "recon"]  # no tokens, no partial folder
    monkeypatch.setattr(ImageTokenizer, "decode_tokens", real_decode)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert _listing(recon) == ["frame_0000.png", "frame_0001.png", "frame_0002.png"]
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
