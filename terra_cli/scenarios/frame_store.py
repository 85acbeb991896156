"""`FrameStore`: a video writer's frames, decoded ahead as the engine makes them or when their video
is done, and the tokenizer's decoder compiled for it. Used by the writer processes
(`scenarios.writer_process`) and the writer thread of the engine's process (`scenarios.local_writer`)."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from terra_cli.compile_apart import fx_cache_counts

# TERRA_DECODER_COMPILE=0 keeps the tokenizer's decoder eager on CUDA (to compare; on by default).
DECODER_COMPILE_ENV = "TERRA_DECODER_COMPILE"


def decoder_compiles(decoder) -> bool:
    """Whether the decode-ahead compiles `decoder`: an `ImageTokenizer` on CUDA, unless TERRA_DECODER_COMPILE=0."""
    from terra_cli.runtime import switched_off

    if switched_off(DECODER_COMPILE_ENV):
        return False
    return hasattr(decoder, "compile_decoder") and getattr(getattr(decoder, "device", None), "type", None) == "cuda"


def compile_decoder(decoder) -> bool:
    """Decode-ahead batches through the compiled decoder on CUDA (`ImageTokenizer.compile_decoder`),
    Inductor's cache in terra's cache folder, unless TERRA_DECODER_COMPILE=0. The first run on a
    machine pays the compile once, in the thread that decodes."""
    if not decoder_compiles(decoder):
        return False
    from terra_cli.refiner.compiled import use_inductor_cache
    from terra_cli.runtime import decoder_compile_mode_asked

    use_inductor_cache()
    return decoder.compile_decoder(mode=decoder_compile_mode_asked())


class FrameStore:
    """Frames decoded ahead, per video: (tokens, pixels) by frame index, and the rows that wait to be decoded."""

    def __init__(self, decoder, held_frames: int, before_first_decode: Callable[[], None] | None = None):
        self.decoder, self.limit = decoder, held_frames
        compile_decoder(decoder)
        # Called once, before the first decode: an in-process writer waits there for the child that
        # compiles this decoder into Inductor's cache (decoder_compile_apart), so its compile is a cache hit.
        # It returns False when the writer was closed meanwhile: then nothing more is decoded ahead.
        self._before_first_decode = before_first_decode
        self.decoding_ahead = True
        self.videos: dict[str, dict[int, tuple[np.ndarray, np.ndarray | None]]] = {}
        self.waiting: deque[tuple[str, int]] = deque()  # (key, index) not decoded yet
        self.count = 0  # frames held, decoded or waiting
        # What the decode-ahead did (a bench's engine rows): its batches, their frames, the first one's
        # seconds (with a compiled decoder, the compile, which shares the engine's process), and the
        # seconds of the others: beside the engine's steps a batch takes longer than alone, and the
        # product's ms a frame says how much of the card the decoding holds
        self.batches_ahead, self.frames_ahead, self.first_batch_s = 0, 0, None
        self.first_batch_cache: list[int] | None = None  # Inductor's FX-graph cache [hits, misses] in it
        self.ahead_s, self.frames_timed = 0.0, 0  # the batches after the first
        # Frames decoded when their video was done instead (past `held_frames`, or a batch still short), and
        # other videos' waiting frames decoded in those batches' padding
        self.frames_late, self.late_s, self.frames_filled = 0, 0.0, 0
        # The first late decode of a store that decoded nothing before (--videos-at-end's drain, or a
        # run too short to fill a batch ahead) holds the decoder's compile: timed apart, with its cache
        # lookups, so the others' ms a frame is the decoder's pace (on an H100 a 12 s compile hid in a
        # drain's 34.8 s: benchmarks/README.md, 2026-12-06, sixth)
        self.late_first_s: float | None = None
        self.late_first_cache: list[int] | None = None
        self.late_timed_s, self.late_timed_frames = 0.0, 0

    def add(self, key: str, first: int, tokens: np.ndarray) -> None:
        video = self.videos.setdefault(key, {})
        for offset, row in enumerate(tokens):
            if self.count >= self.limit:
                return  # decoded when the video is done
            index = first + offset
            if index not in video:
                self.count += 1
                self.waiting.append((key, index))
            video[index] = (np.array(row), None)

    def drop(self, key: str) -> None:
        self.count -= len(self.videos.pop(key, {}))

    def full_batch_waiting(self) -> bool:
        return self.decoding_ahead and len(self.waiting) >= self.decoder.batch_size

    def decode_waiting(self, partial: bool = False) -> bool:
        """Decode one batch of the frames that wait (of videos still held); returns whether it decoded.

        Only a full batch unless `partial`: every batch is padded to the decoder's batch size, so a
        writer that decoded each frame as it came would pay a whole batch per frame. When rollouts'
        frames end in different steps (continuous refill), frames arrive one at a time and such a
        writer kept the GPU busy with padding beside the engine (benchmarks/README.md, issue 37)."""
        batch = self._waiting_frames(self.decoder.batch_size)
        if not batch or (len(batch) < self.decoder.batch_size and not partial):
            self.waiting.extendleft(reversed(batch))  # (the stale entries passed over are gone)
            return False
        if not self._ready_to_decode():
            self.waiting.extendleft(reversed(batch))
            return False
        rows = np.stack([self.videos[key][index][0] for key, index in batch])
        first = self.first_batch_s is None
        decoded, seconds, cache = self._timed(lambda: self.decoder.decode_tokens(rows, full_batches=True), first)
        for (key, index), pixels in zip(batch, decoded):
            self.videos[key][index] = (self.videos[key][index][0], pixels)
        if first:
            self.first_batch_s, self.first_batch_cache = seconds, cache
        else:  # (the first one's is the compile's, apart)
            self.ahead_s += seconds
            self.frames_timed += len(batch)
        self.batches_ahead += 1
        self.frames_ahead += len(batch)
        return True

    def _ready_to_decode(self) -> bool:
        """Whether to decode ahead, after the one call of `before_first_decode` (a video's end decodes
        what it needs regardless)."""
        hook, self._before_first_decode = self._before_first_decode, None
        if hook is not None and hook() is False:
            self.decoding_ahead = False
        return self.decoding_ahead

    def stats(self) -> dict:
        return {"decode_ahead_batches": self.batches_ahead, "decode_ahead_frames": self.frames_ahead,
                "decode_first_batch_s": self.first_batch_s, "decode_first_batch_cache": self.first_batch_cache,
                "decode_ahead_s": round(self.ahead_s, 3),
                "decode_ahead_timed_frames": self.frames_timed,
                "decode_late_frames": self.frames_late, "decode_late_s": round(self.late_s, 3),
                "decode_late_first_s": None if self.late_first_s is None else round(self.late_first_s, 3),
                "decode_late_first_cache": self.late_first_cache,
                "decode_late_timed_s": round(self.late_timed_s, 3), "decode_late_timed_frames": self.late_timed_frames,
                "decode_filled_frames": self.frames_filled, "decode_held_limit": self.limit}

    def take(self, key: str, tokens: np.ndarray) -> tuple[list[np.ndarray], int]:
        """Every frame of a finished video (F, T): the ones decoded ahead whose tokens match, the rest
        decoded now; and how many were decoded now."""
        held = self.videos.get(key, {})
        self.drop(key)  # first: its own waiting frames must not fill the batch's padding
        frames: list[np.ndarray | None] = []
        for index, row in enumerate(tokens):
            entry = held.get(index)
            frames.append(entry[1] if entry is not None and entry[1] is not None and np.array_equal(entry[0], row)
                          else None)
        missing = [i for i, f in enumerate(frames) if f is None]
        if missing:
            for index, pixels in zip(missing, self._decode_late(tokens[missing])):
                frames[index] = pixels
        return frames, len(missing)  # type: ignore[return-value]

    def _decode_late(self, rows: np.ndarray) -> np.ndarray:
        """A finished video's frames, decoded now; other videos' waiting frames go in the last batch's padding.
        When a wave of rollouts ends in one step, each video has a frame or two left; decoded alone,
        every one paid a whole batch (256 batches a wave end, ~13 s of an H200 beside the engine)."""
        self._ready_to_decode()
        first = self.first_batch_s is None and self.frames_late == 0  # nothing decoded yet: the compile is in it
        fill = self._waiting_frames(-len(rows) % self.decoder.batch_size)

        def decode() -> np.ndarray:
            nonlocal fill
            try:
                return self.decoder.decode_tokens(
                    np.concatenate([rows] + [self.videos[key][index][0][None] for key, index in fill]), full_batches=True)
            except Exception:
                if not fill:
                    raise
                # Another video's frame may be what failed: these frames alone, so that their error (or
                # success) is their own; the others are decoded, and fail if they must, at their own end.
                fill = []
                return self.decoder.decode_tokens(rows, full_batches=True)

        decoded, seconds, cache = self._timed(decode, first)
        for (key, index), pixels in zip(fill, decoded[len(rows):]):
            self.videos[key][index] = (self.videos[key][index][0], pixels)
        if first:
            self.late_first_s, self.late_first_cache = seconds, cache
        else:
            self.late_timed_s += seconds
            self.late_timed_frames += len(rows) + len(fill)
        self.frames_late += len(rows)
        self.frames_filled += len(fill)
        self.late_s += seconds
        return decoded[: len(rows)]

    @staticmethod
    def _timed(decode: Callable[[], np.ndarray], first: bool) -> tuple[np.ndarray, float, list[int] | None]:
        """`decode()`, its seconds, and for a store's first decode (the compile's) Inductor's FX-graph
        cache [hits, misses] in it."""
        before = fx_cache_counts() if first else None
        started = time.perf_counter()
        decoded = decode()
        seconds = time.perf_counter() - started
        if before is None:
            return decoded, seconds, None
        after = fx_cache_counts()
        return decoded, seconds, [after[0] - before[0], after[1] - before[1]]

    def _waiting_frames(self, count: int) -> list[tuple[str, int]]:
        """Up to `count` frames that wait to be decoded ahead (of videos still held), taken off the queue."""
        taken: list[tuple[str, int]] = []
        while self.decoding_ahead and self.waiting and len(taken) < count:
            key, index = self.waiting.popleft()
            entry = self.videos.get(key, {}).get(index)
            if entry is not None and entry[1] is None:
                taken.append((key, index))
        return taken
