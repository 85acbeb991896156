"""The one seed rule: which random stream draws each generated frame, on every backend.

A run seeded `s` gives rollout `r` the seed `s + r` (so rollout r of seed s draws exactly as
rollout 0 of seed s + r: `--rollouts 8` equals eight runs with consecutive seeds). Frame `f` of a
rollout, counted from the first context frame of the whole video (rounds do not restart it),
is drawn from a generator seeded `draw_seed(s + r, f)`.

Why a hash and not arithmetic: torch's CPU generator keeps only the low 32 bits of its seed and
vLLM's sampler takes a non-negative int, so `seed + stride * round` style formulas either
overflowed near 2**63 or let seeds that differ above bit 31 give one video. `draw_seed` mixes
all 64 bits of the rollout's seed with the frame index (SplitMix64's finaliser, a bijection on
64 bits) and keeps 31 bits, which every generator holds whole. Because the frame index is global,
a frame's draws do not depend on how the video was cut into jobs: a one-video run, a scenario, a
Ray engine and a server session stepping frame by frame all draw the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass

from terra_cli.errors import InputError

SEED_BITS = 64
MAX_SEED = 2**63 - 2**16  # leaves room for `seed + rollout` below 2**63 whatever the rollout count
DRAW_SEED_BITS = 31  # what every generator keeps whole: torch CPU (32), vLLM's int seeds (signed)
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose every output bit depends on
    every input bit."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rollout_seed(seed: int, rollout: int) -> int:
    """The seed of rollout `rollout` of a run seeded `seed`."""
    return seed + rollout


def draw_seed(seed: int, frame: int) -> int:
    """The generator seed for frame `frame` (global index, context frames counted) of the rollout
    seeded `seed`: 31 bits of a 64-bit mix of both."""
    if not 0 <= seed < 2**SEED_BITS:
        raise ValueError(f"a rollout's seed must fit in {SEED_BITS} bits, got {seed}")
    if frame < 0:
        raise ValueError(f"frame index must be >= 0, got {frame}")
    mixed = _mix64(_mix64(seed) ^ (frame * 0x9E3779B97F4A7C15))
    return mixed >> (64 - DRAW_SEED_BITS)


def check_seed_range(seed: int, rollouts: int = 1, what: str = "--seed") -> None:
    """A run's seeds all fit: `seed` .. `seed + rollouts - 1` within [0, MAX_SEED]. Checked once, at
    the request layer, before anything loads."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"{what} must be a whole number, got {seed!r}")
    if not 0 <= seed <= MAX_SEED:
        raise InputError(f"{what} must be from 0 to {MAX_SEED} (2**63 - 2**16), got {seed}")
    if rollouts > 1 and seed + rollouts - 1 > MAX_SEED:
        raise InputError(f"{what} {seed} with {rollouts} rollouts needs seeds up to {seed + rollouts - 1}, "
                         f"above the maximum {MAX_SEED}")


# Branches (terra_cli.env's fork, POST /v1/sessions/{id}/fork). A lineage starts at an environment or
# session seeded `root` (environment i of a vector env seeded s: root s + i). The c-th branch ever
# forked inside that lineage (c = 1, 2, ...; a branch of a branch counts in the same lineage) is
# seeded `root + BRANCH_STRIDE * c`. Environments take at most MAX_ENVIRONMENTS consecutive seeds,
# fewer than BRANCH_STRIDE, so no branch seed equals an environment's seed or another branch's of
# any lineage of the same run: root_i + S c = root_j + S c' forces i - j = S (c' - c), so i = j, c = c'.
BRANCH_STRIDE = 2**20
MAX_ENVIRONMENTS = 2**16


def branch_seed(root: int, branch: int, what: str = "a branch's seed") -> int:
    """The seed of the `branch`-th (from 1) branch forked in the lineage rooted at seed `root`."""
    if branch < 1:
        raise ValueError(f"branches count from 1, got {branch}")
    seed = root + BRANCH_STRIDE * branch
    check_seed_range(seed, what=what)
    return seed


@dataclass
class Lineage:
    """An environment or session as started, and every branch forked from it since (branches of
    branches included): its c-th branch is seeded `branch_seed(root_seed, c)`."""

    root_seed: int
    branches: int = 0

    def next_seed(self) -> int:
        seed = branch_seed(self.root_seed, self.branches + 1)  # checked before the count moves
        self.branches += 1
        return seed
