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
    assert draw_seed(5, 9) == draw_seed(5, 9)  # a function of its arguments only


def test_the_whole_range_of_a_run_is_checked_up_front():
    check_seed_range(MAX_SEED)
    check_seed_range(MAX_SEED - 7, rollouts=8)
    for seed, rollouts in ((-1, 1), (MAX_SEED + 1, 1), (MAX_SEED - 6, 8), (1.5, 1), (True, 1)):
        with pytest.raises(InputError):
            check_seed_range(seed, rollouts)
    with pytest.raises(ValueError):
        draw_seed(2**64, 0)
