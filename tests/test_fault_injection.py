"""The faults a scenario run can be told to inject (scenarios/fault_injection.py): one frame-delay
knob for one-engine runs and Ray's engines alike."""

from terra_cli.scenarios.fault_injection import FRAME_DELAY_ENV, injected_frame_delay


def test_one_frame_delay_knob_for_every_engine_or_per_engine(monkeypatch):
    monkeypatch.delenv(FRAME_DELAY_ENV, raising=False)
    assert injected_frame_delay() == 0.0 and injected_frame_delay(3) == 0.0  # unset: no fault
    monkeypatch.setenv(FRAME_DELAY_ENV, "0.5")
    assert injected_frame_delay() == 0.5 and injected_frame_delay(2) == 0.5  # every engine, a one-engine run too
    monkeypatch.setenv(FRAME_DELAY_ENV, "1=2.0")
    assert injected_frame_delay(1) == 2.0 and injected_frame_delay(0) == 0.0  # one slow engine
    monkeypatch.setenv(FRAME_DELAY_ENV, "0.25,1=3")
    assert injected_frame_delay(0) == 0.25 and injected_frame_delay(1) == 3.0  # a default, and one engine apart
