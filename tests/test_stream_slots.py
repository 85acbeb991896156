"""backends/vllm_slots.py's rules without an engine: a branch borrows its parent's salt and ids for
the rows they share; a salt is retired when a row it saw changes; a slot whose ids an in-flight
round borrows is not rewritten until that round ends."""

from types import SimpleNamespace

import numpy as np


def table():
    from terra_cli.backends.vllm_slots import SlotTable

    writes = []
    layout = SimpleNamespace(max_frames=5, action_tokens=6, action_placeholder_id=1000)
    return SlotTable(4, layout, lambda rows, waypoints: writes.append(rows.tolist())), writes


def rows(*values):
    return np.stack([np.full((6, 3), v, dtype=np.float32) for v in values])


def test_borrowing_retiring_and_pins():
    slots, writes = table()
    parent = slots.plan(0, rows(1, 2, 3), None)
    slots.owner[0] = "p"
    branch = slots.plan(1, rows(1, 2, 9), "p")
    assert branch.salt == parent.salt and branch.borrowed == 2 and branch.pinned == (0,)
    np.testing.assert_array_equal(branch.ids[:2], parent.ids[:2])
    assert not np.isin(branch.ids[2], parent.ids).any()  # its own row: its own slot's ids
    # The parent's slot is pinned: a round that would rewrite its rows waits, nothing written.
    before = len(writes)
    assert slots.plan(0, rows(7, 7), None) is None and len(writes) == before
    slots.release(branch)
    retry = slots.plan(0, rows(7, 7), None)
    assert retry is not None and retry.salt != parent.salt  # rows the salt saw changed: it is retired
    # The branch's old round borrowed rows that changed: it may no longer be borrowed.
    slots.owner[1] = "b"
    again = slots.plan(2, rows(1, 2, 9), "b")
    assert again.borrowed == 0 and again.salt == f"2.{slots.epochs[2]}"
