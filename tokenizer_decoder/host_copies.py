"""Decoded batches brought to the host one batch behind the device's work.

A plain `.cpu()` after each batch waits for that batch, and the device then idles while the host
hands the frames over and launches the next batch (and, in a writer thread beside mp4 encoders,
waits for the interpreter lock first). Here each batch is copied into pinned memory on the
device's stream and the host takes it out only once the next batch is queued behind it, so the
device always has a batch to run. The same bytes either way; on the CPU a batch is handed over at once.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np
import torch

# Batches left queued on the device while the host takes an older one out (more only holds more pinned memory)
BATCHES_AHEAD = 1


class LaggedHostCopies:
    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.pending: deque[tuple[torch.Tensor, object, Callable[[np.ndarray], None]]] = deque()

    def put(self, pixels: torch.Tensor, deliver: Callable[[np.ndarray], None]) -> None:
        """Hand `pixels` (a uint8 tensor on the device) to `deliver` as a numpy array, now on the CPU,
        on CUDA once BATCHES_AHEAD more batches are queued behind it (or at `finish`)."""
        if not self.on_cuda:
            deliver(pixels.numpy())
            return
        host = self._pinned_like(pixels)
        host.copy_(pixels, non_blocking=True)  # (torch keeps the pinned block until this copy is done)
        self.pending.append((host, self._recorded_event(), deliver))
        while len(self.pending) > BATCHES_AHEAD:
            self._deliver_oldest()

    def finish(self) -> None:
        while self.pending:
            self._deliver_oldest()

    def _deliver_oldest(self) -> None:
        host, done, deliver = self.pending.popleft()
        done.synchronize()
        deliver(host.numpy())

    @staticmethod
    def _pinned_like(pixels: torch.Tensor) -> torch.Tensor:
        return torch.empty(pixels.shape, dtype=pixels.dtype, pin_memory=True)

    @staticmethod
    def _recorded_event():
        """An event on the current stream, after the copy just queued on it."""
        done = torch.cuda.Event()
        done.record()
        return done
