"""`WakeProbe`: how long a thread of this process waits past a short sleep, as a gauge of the
engine's host side.

An engine's step is Python on the host between kernels. When other threads of the same process
(the intake, the video writer's decode and encoders, Ray's call threads) hold the interpreter
lock, or the host's cores are taken, the step waits and the GPU idles. A thread that sleeps 5 ms
and measures how late it wakes sees the same waits: near zero on a quiet process, up to the
interpreter's switch interval (5 ms) and beyond when it is contended. The Ray actor reports the
cumulative lateness with its engine loop's times, so a bench's minute lines show when it rose
(the wave change of the full run, benchmarks/README.md).
"""

from __future__ import annotations

import threading
import time

WAKE_EVERY_S = 0.005
LATE_S = 0.002  # a wake later than this counts as a long wait


class WakeProbe:
    def __init__(self, every_s: float = WAKE_EVERY_S):
        self.every_s = every_s
        self.wakes, self.late_s, self.long_waits = 0, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="terra-wake-probe", daemon=True)
        self._thread.start()

    def as_dict(self) -> dict:
        """Cumulative counts: differences of two snapshots give a window's (`bench.engine_report.loop_since`)."""
        return {"wakes": self.wakes, "wake_late_s": self.late_s, "wake_long_waits": self.long_waits}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            asleep = time.perf_counter()
            time.sleep(self.every_s)
            late = max(0.0, time.perf_counter() - asleep - self.every_s)
            self.wakes, self.late_s = self.wakes + 1, self.late_s + late
            self.long_waits += late > LATE_S
