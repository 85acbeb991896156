"""A server's session pictures (server/pictures.py): frames waiting together are decoded in one tokenizer
call on the media thread, each session gets its own picture, and a failure reaches every waiting session
without stopping the next pictures."""

import asyncio
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from terra_cli.server.pictures import PictureBatcher


def fake_decode(calls, fail=None):
    def decode(tokens):
        calls.append(tokens.shape[0])
        if fail is not None and fail(tokens):
            raise RuntimeError("the tokenizer failed")
        # a picture whose every pixel is the frame's first token: which frame it was stays readable
        return np.broadcast_to(tokens[:, :1, None, None].astype(np.uint8), (tokens.shape[0], 8, 8, 3)).copy()
    return decode


def pixel(png: bytes) -> int:
    return int(np.asarray(Image.open(io.BytesIO(png)))[0, 0, 0])


def test_frames_waiting_together_are_decoded_in_one_call():
    calls = []
    media = ThreadPoolExecutor(1)
    busy = threading.Event()
    media.submit(busy.wait)  # the media thread is busy while five sessions ask
    pictures = PictureBatcher(media, fake_decode(calls))

    async def ask():
        waiting = [asyncio.ensure_future(pictures.picture(np.full(4, 10 + i), "png")) for i in range(5)]
        await asyncio.sleep(0.05)
        busy.set()
        return await asyncio.gather(*waiting)

    got = asyncio.run(ask())
    assert calls == [5] and [pixel(png) for png in got] == [10, 11, 12, 13, 14]
    assert (pictures.pictures, pictures.calls) == (5, 1)
    media.shutdown()


def test_a_failed_decode_fails_its_sessions_and_the_next_pictures_still_come():
    calls = []
    media = ThreadPoolExecutor(1)
    pictures = PictureBatcher(media, fake_decode(calls, fail=lambda tokens: (tokens == 99).any()))

    async def ask():
        with pytest.raises(RuntimeError, match="the tokenizer failed"):
            await pictures.picture(np.full(4, 99), "jpeg")
        return await pictures.picture(np.full(4, 7), "png")

    assert pixel(asyncio.run(ask())) == 7
    assert calls == [1, 1]
    media.shutdown()


def test_pictures_are_encoded_apart_in_order_and_a_bad_one_fails_alone():
    calls = []
    media = ThreadPoolExecutor(1)
    busy = threading.Event()
    media.submit(busy.wait)

    def decode(tokens):  # frame 13's picture has five channels, which no image format takes
        calls.append(tokens.shape[0])
        return [np.full((8, 8, 5 if t[0] == 13 else 3), t[0], dtype=np.uint8) for t in tokens]

    pictures = PictureBatcher(media, decode)

    async def ask():
        waiting = [asyncio.ensure_future(pictures.picture(np.full(4, 10 + i), "png")) for i in range(8)]
        await asyncio.sleep(0.05)
        busy.set()
        return await asyncio.gather(*waiting, return_exceptions=True)

    got = asyncio.run(ask())
    assert calls == [8]
    assert isinstance(got[3], Exception)
    assert [pixel(png) for i, png in enumerate(got) if i != 3] == [10, 11, 12, 14, 15, 16, 17]
    media.shutdown()
    pictures.close()


def test_a_picture_asked_after_the_media_thread_stopped_fails_and_leaves_nothing_waiting():
    media = ThreadPoolExecutor(1)
    media.shutdown()
    pictures = PictureBatcher(media, fake_decode([]))

    async def ask():
        with pytest.raises(RuntimeError):
            await pictures.picture(np.full(4, 1), "png")

    asyncio.run(ask())
    assert pictures._waiting == [] and not pictures._draining
    pictures.close()
