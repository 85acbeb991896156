"""Session frames to pictures, decoded together on the media thread.

Rows of a row batch (backends/row_batch.py) that end their frames together answer their sessions at
once, and each session asks for its next frame only once it has its picture. The frames waiting when
the media thread comes to them are decoded in one call (at most `MAX_PICTURES`; the server's decoder
takes them one frame at a time, `EngineService.decode`), then encoded on
`ENCODERS` threads of their own (Pillow's encoders let go of the interpreter lock: a 288x512 JPEG is a few ms
of one core, a PNG tens).
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

MAX_PICTURES = 32  # a row batch's sessions
ENCODERS = 4


def encode_picture(picture: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    image = Image.fromarray(picture)
    if fmt == "png":
        image.save(buffer, format="PNG")
    else:
        image.save(buffer, format="JPEG", quality=88)
    return buffer.getvalue()


def _encoded(picture: np.ndarray, fmt: str) -> tuple[bytes | None, BaseException | None]:
    try:
        return encode_picture(picture, fmt), None
    except Exception as exc:  # noqa: BLE001 - this session's picture alone
        return None, exc


def _settle(future: asyncio.Future, data: bytes | None, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(data)


class PictureBatcher:
    """`await picture(tokens, fmt)` from the event loop; `decode(tokens (N, T)) -> images (N, H, W, 3)` runs
    on `executor` (the one media thread), over every frame waiting then."""

    def __init__(self, executor: Executor, decode, max_batch: int = MAX_PICTURES):
        self.executor, self.decode, self.max_batch = executor, decode, max_batch
        self.encoders = ThreadPoolExecutor(ENCODERS, thread_name_prefix="terra-picture")
        self._lock = threading.Lock()
        self._waiting: list[tuple[np.ndarray, str, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._draining = False
        self.pictures = self.calls = 0
        self.seconds = 0.0  # decoding and encoding, on the media thread

    async def picture(self, tokens: np.ndarray, fmt: str) -> bytes:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting.append((np.asarray(tokens), fmt, future, loop))
            start, self._draining = not self._draining, True
        if start:
            try:
                self.executor.submit(self._drain)
            except RuntimeError:  # the media thread is shut down: the server is stopping
                with self._lock:
                    self._draining = False
                    self._waiting = [entry for entry in self._waiting if entry[2] is not future]
                raise
        return await future

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
                    if not batch:
                        return
                self._run(batch)
        finally:
            with self._lock:
                self._draining = again = bool(self._waiting)  # came in after the last look (or a failure)
            if again:
                self.executor.submit(self._drain)

    def _run(self, batch) -> None:
        started = time.perf_counter()
        try:
            images = self.decode(np.stack([tokens for tokens, _, _, _ in batch]))
        except Exception as error:  # noqa: BLE001 - every waiting session gets the failure
            images, failure = None, error
        if images is None:
            results = [(None, failure)] * len(batch)
        else:
            results = list(self.encoders.map(_encoded, images, [fmt for _, fmt, _, _ in batch]))
        # counted before any session is answered: a reader of the counts after its picture sees this call
        self.calls += 1
        self.pictures += len(batch)
        self.seconds += time.perf_counter() - started
        for (_, _, future, loop), (data, error) in zip(batch, results):
            loop.call_soon_threadsafe(_settle, future, data, error)

    def close(self) -> None:
        self.encoders.shutdown(wait=True)
