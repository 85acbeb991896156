"""The Ray actor's WakeProbe: a thread's lateness past a 5 ms sleep gauges the engine's host side."""

import threading
import time

from terra_cli.scenarios.wake_probe import WakeProbe


def _window(probe: WakeProbe, seconds: float) -> dict:
    before = probe.as_dict()
    time.sleep(seconds)
    after = probe.as_dict()
    return {k: after[k] - before[k] for k in after}


def test_a_thread_holding_the_interpreter_makes_the_probe_wake_late():
    probe = WakeProbe()
    stop = threading.Event()

    def hold_the_interpreter():  # pure Python: it gives the lock up only when the switch interval forces it
        while not stop.is_set():
            sum(range(1000))

    hog = threading.Thread(target=hold_the_interpreter, daemon=True)
    hog.start()
    try:
        busy = _window(probe, 1.0)
    finally:
        stop.set()
        hog.join()
    probe.stop()
    assert busy["wakes"] > 20  # it keeps sampling under load
    # Each wake waits for the hog's switch interval (5 ms), so most wakes are long waits.
    assert busy["wake_late_s"] / busy["wakes"] > 0.002
    assert busy["wake_long_waits"] > busy["wakes"] / 2
    assert probe.as_dict()["wakes"] >= busy["wakes"]
