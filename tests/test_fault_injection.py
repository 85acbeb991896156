"""The faults a scenario run can be told to inject (scenarios/fault_injection.py): one frame-delay
knob for one-engine runs and Ray's engines alike."""

import threading
import time

from terra_cli.scenarios.fault_injection import (FRAME_DELAY_ENV, FRAME_GATE_ENV, injected_frame_delay,
                                                 injected_frame_gate, wait_for_gate)


def test_one_frame_delay_knob_for_every_engine_or_per_engine(monkeypatch):
    monkeypatch.delenv(FRAME_DELAY_ENV, raising=False)
    assert injected_frame_delay() == 0.0 and injected_frame_delay(3) == 0.0  # unset: no fault
    monkeypatch.setenv(FRAME_DELAY_ENV, "0.5")
    assert injected_frame_delay() == 0.5 and injected_frame_delay(2) == 0.5  # every engine, a one-engine run too
    monkeypatch.setenv(FRAME_DELAY_ENV, "1=2.0")
    assert injected_frame_delay(1) == 2.0 and injected_frame_delay(0) == 0.0  # one slow engine
    monkeypatch.setenv(FRAME_DELAY_ENV, "0.25,1=3")
    assert injected_frame_delay(0) == 0.25 and injected_frame_delay(1) == 3.0  # a default, and one engine apart


def test_a_frame_gate_holds_only_its_engine_until_its_file_appears(monkeypatch, tmp_path):
    monkeypatch.delenv(FRAME_GATE_ENV, raising=False)
    assert injected_frame_gate(0) == ""  # unset: no engine waits
    gate = tmp_path / "open"
    monkeypatch.setenv(FRAME_GATE_ENV, f"1={gate}")
    assert injected_frame_gate(1) == str(gate) and injected_frame_gate(0) == ""
    opener = threading.Timer(0.3, gate.touch)
    started = time.monotonic()
    opener.start()
    wait_for_gate(str(gate), limit_s=30)
    assert gate.exists() and 0.25 <= time.monotonic() - started < 30  # held until the file came
    started = time.monotonic()
    wait_for_gate(str(tmp_path / "never"), limit_s=0.2)  # a gate never opened: the engine goes on
    assert time.monotonic() - started < 5
