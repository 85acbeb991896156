"""StreamDriver's action-row slots and cache salts: which ids and which salt a round's prompt uses,
so that a fork's branches are served their parent's cached prefix, and no salt ever covers two
meanings of one action id.

Slot s owns the action rows of frames [s * max_frames, (s + 1) * max_frames) of the engine's table;
row j of a slot conditions frame j of the round its rollout is in. `held[s]` is what the slot's
rows hold in the table (row -> waypoint bytes).

Salts. Every request carries `cache_salt=f"{host}.{epoch}"`. vLLM hashes the salt into the first
block only, so two prompts share cached blocks exactly when they have the same salt and the same
token ids up to there. The invariant: while a salt is alive, every action id that ever appeared in
a request under it means the waypoints it meant then. A slot's own ids keep their meaning for its
salt's `guests` are every (slot, row) whose ids appeared under it, its own rows included; when such
a row gets other waypoints, every salt it is a guest of is retired (its host's epoch goes up, the
host's rows keep what they hold), so no later request can hit blocks computed with the old ids. A
slot's own next round therefore keeps its salt while it only appends rows (a session's or an
environment's next frame) and gets a new one when a row it used changes (a new round).

Borrowing (a fork's prefix). A round may reuse the ids and salt of an earlier round (`last[s]`,
the last round slot s ran): the round of the same slot (a session's or environment's next frame)
or the last round of the slot of `RolloutJob.prefix_of` (a fork's parent, or its branch of a
branch). It takes that round's ids for the rows both hold alike (their longest common prefix of
waypoints) and its own slot's ids for the rest, under that round's salt: a branch's prompt is then
token for token its parent's up to the rows where they part, and vLLM serves that prefix from the
parent's blocks. To keep the invariant when a salt carries other slots' ids ("guests"):
- a borrowed round is used only while its salt is alive and every borrowed row still holds what it
  held (checked row by row);
- the borrowed rows and the round's own rows become guests of that salt (so a later change of any
  of them retires it);
- a slot whose ids an in-flight request borrows is pinned: nothing may rewrite its rows until that
  request's round ends (a request may be preempted and recomputed at any step). A round that would
  rewrite a pinned slot waits (`plan` returns None); pins belong only to rounds in flight, which
  always finish, so a waiting round always starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SlotRound:
    """A round's prompt ids: (rows, A) action ids, the waypoint bytes of each row, and its salt."""

    host: int
    epoch: int
    ids: np.ndarray
    rows: list[bytes]


@dataclass
class RoundPlan:
    salt: str
    ids: np.ndarray  # (rows, A)
    borrowed: int  # rows whose ids came from an earlier round (0: none)
    pinned: tuple[int, ...]  # other slots whose ids the round uses, pinned until it ends


class SlotTable:
    def __init__(self, slots: int, layout, write_rows):
        # write_rows(first table rows (R,), waypoints (R, A, 3)) writes rows into the engine's table.
        self.slots, self.layout, self.write_rows = slots, layout, write_rows
        self.epochs = [0] * slots
        self.held: list[dict[int, bytes]] = [{} for _ in range(slots)]
        self.owner: list[str | None] = [None] * slots
        self.last: list[SlotRound | None] = [None] * slots
        self.guests: list[set[tuple[int, int]]] = [set() for _ in range(slots)]  # (slot, row) per host
        self.pins = [0] * slots
        self.borrowed_rounds = 0  # rounds that used an earlier round's ids and salt

    def restart(self) -> None:
        """A run begins: the table may have changed since the last one; nothing is in flight."""
        for slot in range(self.slots):
            self.epochs[slot] += 1
            self.held[slot], self.last[slot], self.guests[slot], self.pins[slot] = {}, None, set(), 0

    def take(self, free: list[int], affinity: str | None, prefix_of: str | None) -> int:
        """The slot `affinity` used last when it is free; else one nobody claims; else any. A slot
        that is pinned or belongs to `prefix_of` (whose rows a branch borrows) comes last."""
        owned = [s for s in free if affinity is not None and self.owner[s] == affinity]
        spare = [s for s in free if not self.pins[s] and (prefix_of is None or self.owner[s] != prefix_of)]
        unclaimed = [s for s in spare if self.owner[s] is None]
        slot = (owned or unclaimed or spare or free)[-1]
        free.remove(slot)
        self.owner[slot] = affinity
        return slot

    def release(self, plan: RoundPlan | None) -> None:
        for slot in plan.pinned if plan is not None else ():
            self.pins[slot] -= 1

    def own_ids(self, slot: int, rows: int) -> np.ndarray:
        layout = self.layout
        first_rows = (slot * layout.max_frames + np.arange(rows)) * layout.action_tokens
        return layout.action_placeholder_id + first_rows[:, None] + np.arange(layout.action_tokens)

    def plan(self, slot: int, waypoints: np.ndarray, prefix_of: str | None) -> RoundPlan | None:
        """Write a round's rows (what is not borrowed) and give its ids and salt; None when it must
        wait for a pinned slot (nothing is written then)."""
        keys = [w.tobytes() for w in waypoints]
        source, shared = self._best_round(slot, keys, prefix_of)
        if self.pins[slot] and self._conflicts(slot, keys, shared):
            return None
        self._write(slot, keys, waypoints, shared)
        if shared and not self._valid(source, keys, shared):  # our own rows' change retired its salt
            shared = 0
            if self.pins[slot] and self._conflicts(slot, keys, 0):
                return None
            self._write(slot, keys, waypoints, 0)
        if not shared:
            host, epoch, ids = slot, self.epochs[slot], self.own_ids(slot, len(keys))
        else:
            host, epoch = source.host, source.epoch
            ids = np.concatenate([source.ids[:shared], self.own_ids(slot, len(keys))[shared:]])
            self.borrowed_rounds += 1
        used = {(self._slot_of(i), self._row_of(i)) for i in ids[:, 0]}
        pinned = tuple(sorted({other for other, _ in used} - {slot}))
        self.guests[host].update(used)
        for other in pinned:
            self.pins[other] += 1
        self.last[slot] = SlotRound(host, epoch, ids, keys)
        return RoundPlan(f"{host}.{epoch}", ids, shared, pinned)

    # -- internals --------------------------------------------------------------------------

    def _slot_of(self, action_id: int) -> int:
        frame = (int(action_id) - self.layout.action_placeholder_id) // self.layout.action_tokens
        return frame // self.layout.max_frames

    def _row_of(self, action_id: int) -> int:
        frame = (int(action_id) - self.layout.action_placeholder_id) // self.layout.action_tokens
        return frame % self.layout.max_frames

    def _best_round(self, slot: int, keys: list[bytes], prefix_of: str | None) -> tuple[SlotRound | None, int]:
        """The earlier round (this slot's, or `prefix_of`'s) whose rows begin as `keys` the
        longest, still valid; and how many rows they share (0: none)."""
        candidates = [self.last[slot]]
        if prefix_of is not None:
            candidates += [self.last[s] for s in range(self.slots) if self.owner[s] == prefix_of and s != slot]
        best, best_shared = None, 0
        for source in candidates:
            if source is None:
                continue
            shared = 0
            for mine, theirs in zip(keys, source.rows):
                if mine != theirs:
                    break
                shared += 1
            if shared > best_shared and self._valid(source, keys, shared):
                best, best_shared = source, shared
        return best, best_shared

    def _valid(self, source: SlotRound, keys: list[bytes], shared: int) -> bool:
        """The source's salt is alive and each of its first `shared` ids still means those waypoints."""
        if self.epochs[source.host] != source.epoch:
            return False
        return all(self.held[self._slot_of(source.ids[j, 0])].get(self._row_of(source.ids[j, 0])) == keys[j]
                   for j in range(shared))

    def _conflicts(self, slot: int, keys: list[bytes], start: int) -> bool:
        held = self.held[slot]
        return any(held.get(j, keys[j]) != keys[j] for j in range(start, len(keys)))

    def _write(self, slot: int, keys: list[bytes], waypoints: np.ndarray, start: int) -> None:
        """Rows [start, R) of the slot get `waypoints`; rows that held other waypoints retire every
        salt they are guests of."""
        held = self.held[slot]
        rewritten = {(slot, j) for j in range(start, len(keys)) if held.get(j, keys[j]) != keys[j]}
        for host in range(self.slots) if rewritten else ():
            if self.guests[host] & rewritten:  # its salt saw these ids' old meaning: no request may use it again
                self.epochs[host] += 1
                self.guests[host].clear()
        changed = [j for j in range(start, len(keys)) if held.get(j) != keys[j]]
        if changed:
            first_rows = (slot * self.layout.max_frames + np.asarray(changed, dtype=np.int64)) * self.layout.action_tokens
            self.write_rows(first_rows, np.ascontiguousarray(waypoints[changed], dtype=np.float32))
            held.update({j: keys[j] for j in changed})
