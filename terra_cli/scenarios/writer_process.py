"""Inside a video writer process (`scenarios.writers.WriterPool` starts them): frames decoded as the
engine makes them, an mp4 encoded once a video is done.

A scenario's frames arrive while it is generated (`frames` messages, its context first); the process
decodes them on the run's device whenever a full batch of the tokenizer's batch size has arrived, and
keeps the pixels. When the scenario is done (`finish`, with all its tokens), only the frames not decoded yet
(the last one, or all of them past the memory cap) are decoded, and the mp4 is encoded by one of a
few encoder threads (each runs its own ffmpeg), while this thread goes on decoding. So the videos of
a batch of rollouts that finish together are not decoded one after the other after the last token:
on an H100 that drain was 120-174 s of a 256-sample run with the whole video decoded at the end
(benchmarks/README.md, issue 37).

Every frame is decoded in a full batch (`ImageTokenizer.decode_tokens(full_batches=True)`), so its
pixels do not depend on which frames shared its batch: the mp4 is the one the run's writer thread
makes of the same tokens. A finished frame's tokens are compared with the ones decoded ahead; a
frame whose tokens differ is decoded again.

Messages in (tuples): ("frames", key, first index, tokens (n, T)); ("finish", key, tokens (F, T));
("drop", key); None to stop. Out: ("ready",), ("failed", message), ("done", key, mp4 bytes, frames
decoded after the finish), ("error", key, message). A reader thread moves the pipe's messages into a queue, so the engine's
side never waits on a pipe this process is too busy to read.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from terra_cli.scenarios.frame_store import FrameStore
from terra_cli.scenarios.held_frames import HELD_FRAMES

# The drain of --videos-at-end: how many decoded videos may wait for each encoder before more are
# decoded (20 MB each at 47 frames). One video a decode call: four a call measured no faster on an
# H100, its wall 0.5-1.0 s longer for 192 videos (four mp4s start only once all four are decoded;
# benchmarks/README.md, 2026-12-06, sixth)
DRAIN_READY_PER_ENCODER = 2
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@dataclass(frozen=True)
class DecoderSpec:
    """What a worker loads: the image tokenizer's folder and settings, as the engine's process has them."""

    source: str
    device: str
    batch_size: int
    image_size: tuple[int, int]
    threads: int  # torch CPU threads: the engine process's, so a decode on the CPU gives the same frames
    fps: float
    folder: str  # temporary mp4s (removed with the pool, also those of a killed worker)
    encoders: int = 2  # mp4s encoded at once (each an ffmpeg process of its own)
    held_frames: int = HELD_FRAMES

    @staticmethod
    def of(tokenizer) -> dict | None:
        """The fields a worker needs from a loaded `ImageTokenizer`; None for a decoder that cannot
        be loaded again from a folder (random weights, the refiner)."""
        from tokenizer_decoder import ImageTokenizer

        if not isinstance(tokenizer, ImageTokenizer) or not tokenizer.source:
            return None
        return {"source": str(tokenizer.source), "device": str(tokenizer.device), "batch_size": tokenizer.batch_size,
                "image_size": tuple(tokenizer.image_size)}


def serve(conn, spec: DecoderSpec) -> None:
    """A writer process's main function."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    _exit_with_parent()
    try:
        import torch

        from terra_cli.runtime import quiet_dependency_deprecations
        from tokenizer_decoder import ImageTokenizer

        quiet_dependency_deprecations()
        torch.set_num_threads(spec.threads)
        decoder = ImageTokenizer.from_pretrained(spec.source, device=spec.device, batch_size=spec.batch_size,
                                                 image_size=spec.image_size)
    except BaseException as exc:  # told to the engine's process, which ends the run with it
        _send(conn, threading.Lock(), ("failed", " ".join(f"{type(exc).__name__}: {exc}".split())))
        return
    send_lock = threading.Lock()
    if not _send(conn, send_lock, ("ready",)):
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, inbox), name="terra-writer-inbox", daemon=True).start()
    drive(inbox, FrameStore(decoder, spec.held_frames), lambda message: _send(conn, send_lock, message), spec.fps,
          spec.folder, spec.encoders)


def drive(inbox: queue.SimpleQueue, store: FrameStore, reply: Callable[[tuple], object], fps: float, folder: str,
          encoders: int, tail_encoders: int | None = None, engine_done: threading.Event | None = None) -> None:
    """A writer's loop (a writer process's, and `local_writer.InProcessWriter`'s thread): take the
    messages of `inbox` until None, decode frames ahead, and answer each finished video through `reply`
    once it is encoded: `encoders` mp4s at once while any video it holds is still being generated,
    `tail_encoders` (default: as many) while none is. Then the engine has nothing in flight for this
    writer (a run's last videos, which all end together when they started together, or a Ray engine
    between calls) and the host's cores that its loop would need are idle. With `engine_done`
    (--videos-at-end), finished videos wait until it is set, then go on `tail_encoders`."""
    tail_encoders = max(encoders, tail_encoders or encoders)
    finished: deque[tuple[str, np.ndarray]] = deque()
    ready: deque[tuple[str, list, int]] = deque()  # decoded, waiting for an encoder
    busy_lock, busy = threading.Lock(), [0]

    def encoded(_future) -> None:
        with busy_lock:
            busy[0] -= 1
        inbox.put(("encoded",))  # wakes the loop: an encoder is free

    def draining() -> bool:  # --videos-at-end, the engine done: every finished video waits on this loop
        return engine_done is not None and engine_done.is_set()

    def encoders_now() -> int:
        if engine_done is not None:
            return tail_encoders if draining() else encoders
        done_keys = {key for key, _ in finished}
        running = any(key not in done_keys for key in store.videos)
        return encoders if running else tail_encoders

    def may_take() -> bool:
        if draining():  # decoded videos wait for an encoder in memory: bounded
            return bool(finished) and len(ready) < DRAIN_READY_PER_ENCODER * tail_encoders
        return bool(finished) and engine_done is None

    with ThreadPoolExecutor(max(1, tail_encoders), thread_name_prefix="terra-mp4") as encoding:

        def start_encodes(limit: int) -> None:
            while ready and busy[0] < limit:
                with busy_lock:
                    busy[0] += 1
                encoding.submit(_encode, reply, fps, folder, *ready.popleft()).add_done_callback(encoded)

        stopping = False
        while not stopping:
            # Blocks unless a done video, a full batch of frames or a video an encoder is free for waits: a
            # part batch waits for more frames (or for its video's end, when `take` decodes what is left).
            can_encode = bool(ready) and busy[0] < encoders_now()
            messages = [] if may_take() or can_encode or store.full_batch_waiting() else [inbox.get()]
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for message in messages:
                if message is None:
                    stopping = True
                elif message[0] == "frames":
                    store.add(message[1], message[2], message[3])
                elif message[0] == "finish":
                    finished.append((message[1], message[2]))
                elif message[0] == "drop":
                    store.drop(message[1])
                # ("engine done",) only wakes the loop: `engine_done` is set
            if may_take():  # a done video first: the run waits on it, not on frames of videos still running
                key, tokens = finished.popleft()
                try:
                    frames, late = store.take(key, tokens)
                except Exception as exc:  # this scenario's failure: recorded as failed, the run goes on
                    reply(("error", key, str(exc)))
                else:
                    ready.append((key, frames, late))
            elif store.full_batch_waiting():
                try:
                    store.decode_waiting()
                except Exception:  # such a frame is decoded again when its video is done, and fails there alone
                    store.waiting.clear()
            start_encodes(encoders_now())
        start_encodes(len(ready) + busy[0])  # told to stop: what is decoded is still encoded (the pool queues it)


def _encode(reply: Callable[[tuple], object], fps: float, folder: str, key: str, frames: list[np.ndarray],
            late: int) -> None:
    from terra_cli.media.frames import video_bytes

    try:
        message = ("done", key, video_bytes(frames, fps, folder), late)
    except Exception as exc:
        message = ("error", key, str(exc))
    reply(message)


def _read(conn, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        inbox.put(message)
        if message is None:
            return


def _send(conn, lock: threading.Lock, message) -> bool:
    try:
        with lock:
            conn.send(message)
        return True
    except (OSError, ValueError):  # the engine's process is gone
        return False


def _exit_with_parent() -> None:
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="terra-parent-watch", daemon=True).start()
