"""A Ray driver reads the contexts it ships in threads, ahead of the hand-out (encoding.ReadAhead)."""

import threading
import time

import pytest

from terra_cli.scenarios.encoding import ReadAhead


class Line:
    def __init__(self, id):
        self.id = id


def test_reads_run_side_by_side_ahead_of_the_takes_and_each_take_gets_its_own_read():
    lock, running, most = threading.Lock(), [0], [0]
    started = []

    def read(s):
        with lock:
            started.append(s.id)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)  # a JPEG being decoded
        with lock:
            running[0] -= 1
        return f"context of {s.id}"

    lines = [Line(f"s{i}") for i in range(10)]
    reader = ReadAhead(read, ahead=6, threads=3)
    reader.want(lines)
    time.sleep(0.05)
    assert sorted(reader.reading) == sorted(f"s{i}" for i in range(6))  # at most `ahead` not yet taken
    assert reader.take(lines[0]) == "context of s0"
    reader.want(lines[1:])  # (the driver passes what is still pending) one place freed: the next in line starts
    assert "s6" in reader.reading and "s7" not in reader.reading
    assert [reader.take(s) for s in lines[1:7]] == [f"context of s{i}" for i in range(1, 7)]
    assert reader.take(lines[9]) == "context of s9"  # never started ahead: read on the spot
    assert most[0] == 3  # three readers at once
    assert sorted(started) == sorted(f"s{i}" for i in (*range(7), 9))  # nothing read twice
    reader.close()


def test_a_failed_read_is_raised_by_its_own_take_alone():
    def read(s):
        if s.id == "bad":
            raise OSError("cannot identify image file")
        return s.id

    reader = ReadAhead(read, ahead=4, threads=2)
    good, bad = Line("good"), Line("bad")
    reader.want([bad, good])
    with pytest.raises(OSError, match="cannot identify"):
        reader.take(bad)
    assert reader.take(good) == "good"
    reader.close()


def test_a_ray_driver_reads_contexts_at_the_tokenizers_frame_size_and_the_pixels_it_encodes_do_not_change(tmp_path):
    """ACT-Bench's contexts are 1600x900 JPEGs: the driver resizes them as it reads (10x fewer bytes
    held and shipped), and the tokenizer, resizing again on the actor, sees exactly the pixels it
    would have made from the originals."""
    import numpy as np
    from PIL import Image

    from terra_cli.scenarios.ray_runner import read_work
    from terra_cli.scenarios.spec import Scenario
    from tokenizer_decoder.tokenizer import FRAME_HEIGHT, FRAME_WIDTH, resize_frames

    rng = np.random.default_rng(0)
    paths = []
    for i in range(3):
        path = tmp_path / f"cam{i}.jpg"
        Image.fromarray(rng.integers(0, 256, (900, 1600, 3), dtype=np.uint8)).save(path, quality=90)
        paths.append(path)
    scenario = Scenario(id="s0", line=1, actions=np.zeros((4, 6, 3), np.float32), frames=4, seed=0,
                        context_images=tuple(paths), context_frames=3)
    work = read_work(scenario)
    assert [f.shape for f in work.context_images] == [(FRAME_HEIGHT, FRAME_WIDTH, 3)] * 3
    originals = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    expected = resize_frames(originals)  # what the actor's tokenizer made of the full-size frames
    again = resize_frames(work.context_images)  # what it makes of the resized ones
    for got, want in zip(again, expected):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(resize_frames(originals, (FRAME_HEIGHT, FRAME_WIDTH - 16))[0][:, :-16], expected[0][:, :-16])


def test_a_single_engines_intake_reads_contexts_side_by_side_and_encodes_what_one_reader_would(tmp_path, monkeypatch):
    """`encoding.encoded` (EncodeAhead's thread) reads and resizes contexts in READ_THREADS threads
    ahead of the batch it encodes; the tokens, and their order, are those of reading one at a time
    at full size."""
    import numpy as np
    from PIL import Image

    import terra_cli.pipeline.inputs as inputs
    from terra_cli.scenarios import encoding
    from terra_cli.scenarios.spec import Scenario
    from tokenizer_decoder import ImageTokenizer, small_config

    rng = np.random.default_rng(1)
    scenarios = []
    for i in range(2 * encoding.ENCODE_BATCH + 3):
        paths = []
        for k in range(2):
            path = tmp_path / f"s{i}_{k}.jpg"
            Image.fromarray(rng.integers(0, 256, (90, 160, 3), dtype=np.uint8)).save(path, quality=90)
            paths.append(path)
        scenarios.append(Scenario(id=f"s{i}", line=i + 1, actions=np.zeros((4, 6, 3), np.float32), frames=4,
                                  seed=i, context_images=tuple(paths), context_frames=2))
    tokenizer = ImageTokenizer.from_config(small_config(ch=32, num_res_blocks=1, ch_mult=(1,) * 5), device="cpu",
                                           image_size=(64, 128))

    lock, running, most = threading.Lock(), [0], [0]
    read_frames = inputs.read_context_frames

    def slow_read(sources, count):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # a JPEG being decoded
        try:
            return read_frames(sources, count)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(inputs, "read_context_frames", slow_read)
    times = {}
    side_by_side = list(encoding.encoded(scenarios, tokenizer, threads=4, times=times))
    assert most[0] > 1
    assert times["intake_encode_s"] > 0 and times["intake_read_wait_s"] >= 0
    assert [s.id for s, _ in side_by_side] == [s.id for s in scenarios]
    for s, tokens in side_by_side:
        originals = [np.asarray(Image.open(p).convert("RGB")) for p in s.context_images]
        np.testing.assert_array_equal(tokens, tokenizer.tokenize(originals))
