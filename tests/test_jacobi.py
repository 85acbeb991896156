"""Speculative Jacobi decoding (backends/jacobi.py) on the CPU in float32: greedy codes equal plain
decoding, sampled codes keep the model's distribution (chi-square against exact probabilities, as
tests/test_vllm_draft.py does for vLLM's draft), a seed gives the same tokens, and the counts of
kept drafts add up."""


import numpy as np
import pytest
import torch

from terra_cli.backends.base import Sampling
from terra_cli.backends.device_sampling import filtered_probabilities
from terra_cli.backends.single_stream import SingleStreamBackend
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from stats_helpers import chi_square, chi_square_bound

# A small code book makes repeats, and so kept drafts, common; short frames keep CPU time low.
VOCAB, CODES, FRAMES = 16, 8, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=FRAMES)
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("jacobi"), config, seed=3)
    return load_model(checkpoint, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def larger_model(tmp_path_factory):
    config = tiny_config(image_vocab=64, image_tokens=40, max_frames=5)
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("jacobi40"), config, seed=1), device="cpu")


def actions(frames, rollouts=1, seed=0):
    rng = np.random.default_rng(seed)
    return np.broadcast_to(rng.normal(scale=2.0, size=(frames, 6, 3)).astype(np.float32), (rollouts, frames, 6, 3))


def stats_add_up(stats, codes_per_frame):
    """Each step decides its kept drafts plus one code of its own, except a step whose kept drafts
    reach the frame's last code (nothing left to draw): at most one such step per frame."""
    for s in stats:
        decided = s["frames"] * (codes_per_frame - 1)
        assert decided - s["steps"] <= s["accepted_drafts"] <= decided - s["steps"] + s["frames"], s
        assert s["codes_per_step"] == pytest.approx(decided / s["steps"])


@pytest.mark.parametrize("draft", ["jacobi", "previous-frame"])
@pytest.mark.parametrize("draft_tokens", [1, 4, 32])  # 32: windows that run past the frame's action slots
def test_greedy_codes_equal_plain_decoding(larger_model, draft, draft_tokens):
    rng = np.random.default_rng(0)
    context = rng.integers(0, 64, size=(2, 2, 40))
    acts = np.stack([actions(4, seed=1)[0], actions(4, seed=2)[0]])
    plain = SingleStreamBackend(device="cpu", model=larger_model).generate(context, acts, 5, Sampling(temperature=0))
    backend = SingleStreamBackend(device="cpu", model=larger_model, draft_tokens=draft_tokens, draft=draft)
    np.testing.assert_array_equal(backend.generate(context, acts, 5, Sampling(temperature=0)), plain)
    stats_add_up(backend.stats, 40)
    # Drafts were kept: the check is about a decoder that really speculated.
    assert sum(s["accepted_drafts"] for s in backend.stats) > 10


@pytest.mark.parametrize("draft", ["jacobi", "previous-frame"])
def test_the_same_seed_gives_the_same_tokens(larger_model, draft):
    rng = np.random.default_rng(1)
    context = rng.integers(0, 64, size=(1, 2, 40))
    backend = SingleStreamBackend(device="cpu", model=larger_model, draft_tokens=4, draft=draft)
    a = backend.generate(context, actions(4), 5, Sampling(temperature=0.9, seed=5))
    b = backend.generate(context, actions(4), 5, Sampling(temperature=0.9, seed=5))
    c = backend.generate(context, actions(4), 5, Sampling(temperature=0.9, seed=6))
    np.testing.assert_array_equal(a, b)
    assert (a[0, 2:] != c[0, 2:]).mean() > 0.5


def exact_code_probabilities(model, context: np.ndarray, acts: np.ndarray, sampling: Sampling, last: int) -> list:
    """Marginal probabilities of codes 1..`last` of the first generated frame (one context frame),
    summed exactly over every prefix, under the reference's sampling rule."""
    layout = model.layout
    slots = np.full(layout.action_tokens, layout.action_placeholder_id)
    waypoints = torch.from_numpy(np.array(acts[:1])).reshape(1, -1, 3)

    def next_code_probs(prefixes: np.ndarray) -> np.ndarray:
        rows = np.stack([np.concatenate([context, slots, prefix]) for prefix in prefixes])
        ids = torch.tensor(rows)
        with torch.inference_mode():
            logits, _ = model(ids, torch.arange(ids.shape[1])[None].expand(len(rows), -1), waypoints.expand(len(rows), -1, -1))
        return filtered_probabilities(logits[:, -1], layout, sampling).double().numpy()

    prefixes = np.zeros((1, 0), dtype=np.int64)
    joint = np.ones(1)
    marginals = []
    for n in range(last + 1):
        step = next_code_probs(prefixes)  # (prefixes, V)
        joint = (joint[:, None] * step).reshape(-1)
        prefixes = np.concatenate([np.repeat(prefixes, VOCAB, axis=0), np.tile(np.arange(VOCAB), len(prefixes))[:, None]], 1)
        if n:
            marginals.append(joint.reshape(-1, VOCAB).sum(axis=0))
    return marginals


@pytest.mark.parametrize("draft,sampling", [("jacobi", Sampling(temperature=1.0, seed=11)),
                                            ("previous-frame", Sampling(temperature=1.0, seed=12)),
                                            ("jacobi", Sampling(temperature=0.8, top_k=6, top_p=0.95, seed=13))])
def test_sampled_codes_keep_the_model_distribution(model, draft, sampling):
    samples, draft_tokens = 640, 3
    acts = actions(2)
    plain = SingleStreamBackend(device="cpu", model=model)
    reference_frame = plain.generate(np.zeros((1, 1, CODES), dtype=np.int64), acts, 2, Sampling(temperature=0))[0, 1]
    # The model's own greedy frame as context makes the previous-frame drafts likely enough to be kept often.
    context = np.broadcast_to(reference_frame, (samples, 1, CODES))
    backend = SingleStreamBackend(device="cpu", model=model, draft_tokens=draft_tokens, draft=draft)
    frames = backend.generate(context, actions(2, samples), 2, sampling)
    stats_add_up(backend.stats, CODES)
    accepted = sum(s["accepted_drafts"] for s in backend.stats)
    steps = sum(s["steps"] for s in backend.stats)
    # Verification ran both ways: many drafts kept, and many steps ended on a rejected one (a
    # step that keeps all 3 drafts decides 4 codes; 640 frames of 7 decided codes take >= 1280).
    assert accepted >= 300 and steps >= 2000, (accepted, steps)

    for position, probabilities in enumerate(exact_code_probabilities(model, reference_frame, acts[0], sampling, 3), 1):
        counts = np.bincount(frames[:, 1, position], minlength=VOCAB)
        statistic, dof = chi_square(counts, probabilities)
        assert dof >= 2, probabilities
        assert statistic < chi_square_bound(dof), (position, statistic, dof, counts, probabilities * samples)
        # The test has power: always keeping the draft would put every sample on one code.
        always_kept = np.zeros(VOCAB)
        always_kept[reference_frame[position]] = samples
        assert chi_square(always_kept, probabilities)[0] > chi_square_bound(dof)
