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
