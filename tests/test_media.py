"""terra_cli.media: reading folders / images / videos, writing videos and PNG frames, errors."""

import numpy as np
import pytest
from PIL import Image

from terra_cli.errors import TerraError
from terra_cli.media.frames import (
    MediaError,
    count_frames,
    iter_frames,
    list_images,
    natural_key,
    read_frames,
    write_frames,
    write_video,
)


def solid(value, h=32, w=48):
    frame = np.zeros((h, w, 3), dtype=np.uint8)
    frame[..., 0] = value
    frame[..., 1] = 255 - value
    return frame


def test_natural_sort_order_of_a_folder(tmp_path):
    names = ["frame10.png", "frame2.png", "frame1.jpg", "Frame3.png", "frame20.PNG"]
    for i, name in enumerate(names):
        Image.fromarray(solid(10 * i)).save(tmp_path / name, format="PNG" if "png" in name.lower() else "JPEG")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden.png").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    order = [p.name for p in list_images(tmp_path)]
    assert order == ["frame1.jpg", "frame2.png", "Frame3.png", "frame10.png", "frame20.PNG"]
    assert sorted(["a10", "a2", "a1"], key=natural_key) == ["a1", "a2", "a10"]
    frames = read_frames(tmp_path)
    assert len(frames) == 5 and all(f.shape == (32, 48, 3) and f.dtype == np.uint8 for f in frames)
    assert frames[1][0, 0, 0] == 10  # frame2.png was saved second (value 10)
    assert frames[3][0, 0, 0] == 0  # frame10.png first (value 0)
    assert len(read_frames(tmp_path, max_frames=2)) == 2
    assert count_frames(tmp_path) == 5 and count_frames(tmp_path, max_frames=3) == 3


def test_single_image_becomes_rgb(tmp_path):
    Image.fromarray(solid(99)).convert("L").save(tmp_path / "gray.png")
    Image.fromarray(np.dstack([solid(5), np.full((32, 48), 128, np.uint8)])).save(tmp_path / "rgba.png")
    (gray,) = read_frames(tmp_path / "gray.png")
    (rgba,) = read_frames(tmp_path / "rgba.png")
    assert gray.shape == rgba.shape == (32, 48, 3)
    assert rgba[0, 0].tolist() == [5, 250, 0]


def test_mp4_written_and_read_back(tmp_path):
    frames = [solid(v, 64, 96) for v in (0, 60, 120, 180, 240)]
    path = write_video(tmp_path / "out" / "clip.mp4", frames, fps=10)
    assert path.is_file() and path.stat().st_size > 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["clip.mp4"]  # no temporary left behind
    back = read_frames(path)
    assert len(back) == 5 and back[0].shape == (64, 96, 3) and back[0].dtype == np.uint8
    assert abs(int(back[2][..., 0].mean()) - 120) < 8  # lossy, but close
    assert len(read_frames(path, max_frames=3)) == 3
    assert count_frames(path) == 5
    # What write_video's check reads: a file cut short (its trailer lost) or not a video counts no frame.
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (tmp_path / "text.mp4").write_text("not a video")
    assert count_frames(cut) is None and count_frames(tmp_path / "text.mp4") is None


def test_write_video_replaces_nothing_unless_told(tmp_path):
    """Issue 38: write_video replaced by default, unlike every other writer."""
    from terra_cli.errors import OutputError

    path = write_video(tmp_path / "clip.mp4", [solid(v, 32, 48) for v in (0, 120)], fps=10)
    before = path.read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        write_video(path, [solid(v, 32, 48) for v in (60, 180, 240)], fps=10)
    assert path.read_bytes() == before
    write_video(path, [solid(v, 32, 48) for v in (60, 180, 240)], fps=10, overwrite=True)
    assert len(read_frames(path)) == 3


def test_write_frames_pngs(tmp_path):
    frames = [solid(v) for v in (1, 2, 3)]
    paths = write_frames(tmp_path / "pngs", frames)
    assert [p.name for p in paths] == ["frame_0000.png", "frame_0001.png", "frame_0002.png"]
    assert np.array_equal(np.asarray(Image.open(paths[2])), frames[2])
    more = write_frames(tmp_path / "pngs", frames[:1], start=3)
    assert more[0].name == "frame_0003.png"
    assert [f[0, 0, 0] for f in read_frames(tmp_path / "pngs")] == [1, 2, 3, 1]


def test_errors_name_the_file(tmp_path):
    assert issubclass(MediaError, TerraError)
    with pytest.raises(MediaError, match="missing.mp4 does not exist"):
        read_frames(tmp_path / "missing.mp4")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MediaError, match="empty has no images"):
        read_frames(tmp_path / "empty")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(MediaError, match="corrupt.png") as err:
        read_frames(tmp_path / "corrupt.png")
    assert "\n" not in str(err.value)
    folder = tmp_path / "mixed"
    folder.mkdir()
    Image.fromarray(solid(1)).save(folder / "a1.png")
    (folder / "a2.png").write_bytes(b"nope")
    with pytest.raises(MediaError, match="a2.png"):
        read_frames(folder)
    (tmp_path / "broken.mp4").write_bytes(b"definitely not a video")
    with pytest.raises(MediaError, match="broken.mp4"):
        read_frames(tmp_path / "broken.mp4")
    with pytest.raises(MediaError, match="no frames"):
        write_video(tmp_path / "x.mp4", [])
    with pytest.raises(MediaError, match="frame 1"):
        write_video(tmp_path / "x.mp4", [solid(1), solid(2, 16, 16)])
    assert not (tmp_path / "x.mp4").exists()
    with pytest.raises(MediaError):
        list(iter_frames(tmp_path / "empty", max_frames=0))


def test_named_pipes_and_devices_are_refused_before_any_open(tmp_path):
    import os

    for name in ("f.png", "f.mp4", "f"):
        os.mkfifo(tmp_path / name)
        with pytest.raises(MediaError, match="is a named pipe"):
            read_frames(tmp_path / name)  # open() (PIL, ffmpeg) would block until a writer came
    from terra_cli.media.frames import read_image

    with pytest.raises(MediaError, match="is a named pipe"):
        read_image(tmp_path / "f.png")
    with pytest.raises(MediaError, match="is a character device"):
        read_frames("/dev/zero")
    # in a folder, a pipe is not an image and is skipped
    Image.fromarray(solid(3)).save(tmp_path / "a.png")
    assert [p.name for p in list_images(tmp_path)] == ["a.png"]


def test_npy_headers_are_checked_before_loading(tmp_path):
    from terra_cli.errors import InputError
    from terra_cli.media.files import read_npy

    np.save(tmp_path / "ok.npy", np.arange(6).reshape(2, 3))
    assert read_npy(tmp_path / "ok.npy", "tokens").tolist() == [[0, 1, 2], [3, 4, 5]]
    with open(tmp_path / "huge.npy", "wb") as f:  # np.load would try to allocate 116 TiB
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**12, 16)})
        f.write(b"\0" * 64)
    (tmp_path / "garbage.npy").write_bytes(b"\x93NUMPY\x01\x00" + (70).to_bytes(2, "little") + b"(" * 69 + b"\n")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "empty.npy").write_bytes(b"")
    np.savez(tmp_path / "archive.npz", tokens=np.arange(6))
    (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")
    cases = {"huge.npy": "is truncated", "garbage.npy": "header is damaged", "objects.npy": "Python objects",
             "empty.npy": "is empty", "ok.npy": "more than terra reads", "archive.npy": "it is an .npz archive"}
    for name, message in cases.items():
        with pytest.raises(InputError, match=message):
            read_npy(tmp_path / name, "tokens", max_items=None if name == "huge.npy" else 5)


def test_npy_arrays_read_in_any_layout_and_byte_order_and_headers_parsed_one_at_a_time(tmp_path, monkeypatch):
    """The data is read after the one header parse, so every layout numpy writes must come back equal;
    and the header parses take turns: numpy's ast parse is not thread-safe on CPython 3.11 before
    3.11.8 ("AST constructor recursion depth mismatch" in this project's CI, from the read-ahead
    threads)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from terra_cli.media import files

    arrays = {"c.npy": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
              "fortran.npy": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
              "big-endian.npy": np.arange(6, dtype=">u2").reshape(2, 3),
              "no-rows.npy": np.zeros((0, 576), dtype=np.uint16)}
    for name, array in arrays.items():
        np.save(tmp_path / name, array)
        got = files.read_npy(tmp_path / name, "tokens")
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array), name

    inside, most = [0], [0]
    parse = np.lib.format.read_array_header_1_0

    def slow_parse(f, *args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # room for another thread to come in
        inside[0] -= 1
        return parse(f, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", slow_parse)
    with ThreadPoolExecutor(8) as pool:
        read = list(pool.map(lambda _: files.read_npy(tmp_path / "c.npy", "tokens"), range(32)))
    assert all(np.array_equal(r, arrays["c.npy"]) for r in read)
    assert most[0] == 1, f"{most[0]} header parses ran at once"


def test_a_placed_video_is_synced_to_disk_and_a_scratch_video_for_bytes_is_not(tmp_path, monkeypatch):
    """video_bytes' file is read back at once and removed (the process that places the bytes syncs
    its own file): syncing it only added disk writes while a wave of videos finished at once."""
    import os

    from terra_cli.media import frames as media_frames

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(media_frames.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    clip = [solid(v, 32, 48) for v in (0, 120, 240)]
    write_video(tmp_path / "placed.mp4", clip, fps=10)
    assert len(synced) == 1
    data = media_frames.video_bytes(clip, 10, folder=tmp_path)
    assert len(synced) == 1  # no second sync
    (tmp_path / "back.mp4").write_bytes(data)
    assert count_frames(tmp_path / "back.mp4") == 3  # still checked whole before its bytes are returned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back.mp4", "placed.mp4"]  # scratch folder gone


def test_ffmpeg_is_spawned_without_a_python_pre_exec_hook_and_in_its_own_process_group(tmp_path, monkeypatch):
    """imageio's writer starts ffmpeg with preexec_fn=os.setpgrp, which makes CPython fork the whole
    calling process: in a vLLM engine's process, a copy of its page tables for every video."""
    import subprocess

    started = []
    real_popen = subprocess.Popen

    def recording_popen(cmd, **kwargs):
        started.append(kwargs)
        return real_popen(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    path = write_video(tmp_path / "clip.mp4", [solid(v, 32, 48) for v in (0, 120, 240)], fps=10)
    assert count_frames(path) == 3
    encoder = started[0]
    assert encoder.get("preexec_fn") is None and encoder.get("process_group") == 0


def test_an_encoder_that_fails_leaves_no_file_and_says_so_in_one_line(tmp_path, monkeypatch):
    import imageio_ffmpeg

    from terra_cli.media.frames import MediaError

    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: "false")  # exits 1 at once
    with pytest.raises(MediaError, match=r"cannot write video .*clip\.mp4: ffmpeg exited with status 1"):
        write_video(tmp_path / "clip.mp4", [solid(v, 32, 48) for v in (0, 120)], fps=10)
    assert list(tmp_path.iterdir()) == []


def test_ffmpeg_runs_niced_with_a_fixed_thread_count(tmp_path, monkeypatch):
    """The encoder gets a fixed x264 thread count (the same bytes on any host) and a lower CPU
    priority than the engine's process: a stand-in ffmpeg records its niceness and its arguments."""
    import os
    import shutil
    import sys

    import imageio_ffmpeg

    from terra_cli.media import frames

    if shutil.which("nice") is None:
        pytest.skip("no `nice` on this host")
    record = tmp_path / "seen.txt"
    fake = tmp_path / "ffmpeg"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\nsys.stdin.buffer.read()\n"
                    f"open({str(record)!r}, 'w').write(str(os.nice(0)) + ' ' + ' '.join(sys.argv[1:]))\n")
    fake.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(fake))
    frames._encode_h264(tmp_path / "clip.mp4", [solid(v, 32, 48) for v in (0, 120)], fps=10)
    niceness, *args = record.read_text().split()
    assert int(niceness) >= os.nice(0) + frames.ENCODER_NICENESS or int(niceness) == 19
    assert args[args.index("-threads") + 1] == str(frames.H264_THREADS) and args[-1].endswith("clip.mp4")
