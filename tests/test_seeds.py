"""The one seed rule (terra_cli/seeds.py): every bit of a seed counts, frames and rollouts differ,
and the range is checked once."""

import pytest
import torch

from terra_cli.errors import InputError
from terra_cli.seeds import DRAW_SEED_BITS, MAX_SEED, check_seed_range, draw_seed, rollout_seed


def _draws(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(8).exponential_(generator=generator)


def test_seeds_that_differ_only_above_bit_32_draw_differently_on_the_cpu():
    # torch's CPU generator keeps 32 bits: seeding it with the seed itself made these two equal.
    assert torch.equal(_draws(0), _draws(2**32))
    assert not torch.equal(_draws(draw_seed(0, 3)), _draws(draw_seed(2**32, 3)))
    assert draw_seed(0, 3) != draw_seed(2**63 - 1, 3)


def test_draw_seeds_fit_every_generator_and_differ_per_frame_and_rollout():
    seeds = {draw_seed(rollout_seed(7, r), f) for r in range(16) for f in range(100)}
    assert len(seeds) == 1600  # no two frames of these rollouts share a stream
    assert all(0 <= s < 2**DRAW_SEED_BITS for s in seeds)
    assert draw_seed(MAX_SEED + 2**16 - 1, 99) < 2**DRAW_SEED_BITS


def test_the_rule_is_the_documented_one():
    """rollout r of seed s is s + r; a frame's draw seed is the top 31 bits of SplitMix64's finaliser
    of (finaliser(s) xor f * golden), recomputed here in numpy's wrapping uint64 arithmetic."""
    import numpy as np

    from terra_cli.seeds import _mix64

    # SplitMix64 seeded 0 first outputs 0xE220A8397B1DCDAF: the finaliser of its first state, the golden gamma
    assert _mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF

    def mix(z):
        z = np.uint64(z)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        for seed, rollout, frame in ((0, 0, 0), (1, 3, 7), (2**40 + 5, 1, 24), (MAX_SEED, 0, 99)):
            assert rollout_seed(seed, rollout) == seed + rollout
            golden = np.uint64((frame * 0x9E3779B97F4A7C15) & (2**64 - 1))
            expected = int(mix(mix(seed + rollout) ^ golden) >> np.uint64(64 - DRAW_SEED_BITS))
            assert draw_seed(rollout_seed(seed, rollout), frame) == expected


def test_the_whole_range_of_a_run_is_checked_up_front():
    check_seed_range(MAX_SEED)
    check_seed_range(MAX_SEED - 7, rollouts=8)
    for seed, rollouts in ((-1, 1), (MAX_SEED + 1, 1), (MAX_SEED - 6, 8), (1.5, 1), (True, 1)):
        with pytest.raises(InputError):
            check_seed_range(seed, rollouts)
    with pytest.raises(ValueError):
        draw_seed(2**64, 0)
