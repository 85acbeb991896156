"""A decode step's inputs by `StepPrologue` (backends/step_prologue.py): the model's own sums for code rows,
bit for bit, eager and compiled (Inductor's C++ backend here), and the switch that chooses."""

import pytest
import torch

from terra_cli.backends.step_prologue import PROLOGUE_ENV, StepPrologue, code_step_inputs
from terra_cli.backends.static_kv import rotary_table
from terra_cli.errors import InputError
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

CODES, VOCAB, FRAMES = 40, 64, 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=FRAMES)
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prologue"), config, seed=3)
    return load_model(path, device="cpu", dtype=torch.bfloat16)


def steps(model, rows: int, seed: int = 0):
    """Codes and positions a decode step may see, past the last frame's positions too (draft rows)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, VOCAB, (rows,), generator=generator)
    positions = torch.randint(0, model.layout.max_positions + 20, (rows,), generator=generator)
    return codes, positions


@torch.inference_mode()
def test_the_step_inputs_are_the_models_embedding_and_rotary_rows(model, monkeypatch):
    monkeypatch.delenv(PROLOGUE_ENV, raising=False)
    last = model.layout.max_positions - 1
    rotary = rotary_table(model, last + 1, torch.bfloat16)
    prologue = StepPrologue(model, rotary, last, compiled=False)
    assert not prologue.compiled
    codes, positions = steps(model, 24)
    embeds, (cos, sin) = prologue(codes, positions)
    assert torch.equal(embeds, model.embed(codes[None], None, positions[None]))
    want_cos, want_sin = model.model.rotary_emb(embeds, positions.clamp(max=last)[None])
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    # tables of another dtype than the embeddings': none taken, the decoder makes its rows itself
    assert StepPrologue(model, tuple(t.float() for t in rotary), last, compiled=False)(codes, positions)[1] is None


@pytest.mark.slow
@torch.inference_mode()
def test_the_compiled_step_inputs_keep_eagers_bits(model, monkeypatch):
    """Inductor adds in float32 and rounds once unless told to emulate eager's casts; here the first sum's
    rounding shows in the result (checked below), so a compile that dropped it would fail."""
    monkeypatch.delenv(PROLOGUE_ENV, raising=False)
    last = model.layout.max_positions - 1
    rotary = rotary_table(model, last + 1, torch.bfloat16)
    prologue = StepPrologue(model, rotary, last, compiled=True)
    for rows in (1, 8):
        codes, positions = steps(model, rows, seed=rows)
        embeds, (cos, sin) = prologue(codes, positions)
        assert prologue.compiled, prologue.error
        want, (want_cos, want_sin) = code_step_inputs(codes, positions, *prologue.tables)
        assert torch.equal(embeds, want) and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    codes, positions = steps(model, 64, seed=9)
    tokens, spatial, temporal = prologue.tables[:3]
    frame = (positions // spatial.shape[0]).clamp(max=temporal.shape[0] - 1)
    unrounded = (tokens[codes].float() + spatial[positions % spatial.shape[0]].float() + temporal[frame].float())
    assert not torch.equal(unrounded.bfloat16()[None], code_step_inputs(codes, positions, *prologue.tables)[0])
    assert torch.equal(prologue(codes, positions)[0], code_step_inputs(codes, positions, *prologue.tables)[0])


@pytest.mark.slow
@torch.inference_mode()
def test_the_final_norm_is_compiled_too_unless_the_switch_keeps_it_or_both_eager(model, monkeypatch):
    last = model.layout.max_positions - 1
    monkeypatch.delenv(PROLOGUE_ENV, raising=False)
    prologue = StepPrologue(model, None, last, compiled=True)
    hidden = torch.randn(1, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    normed = prologue.norm(hidden)
    assert prologue._norm is not None and prologue.error is None
    # the layers' norms' math, compiled: within a bf16 rounding of the model's eager norm
    torch.testing.assert_close(normed, model.model.norm(hidden), rtol=1e-2, atol=1e-2)
    assert not StepPrologue(model, None, last, compiled=False).compiled  # a CPU decoder: nothing compiled
    assert StepPrologue(model, None, last, compiled=False).norm(hidden).equal(model.model.norm(hidden))
    monkeypatch.setenv(PROLOGUE_ENV, "inputs")
    inputs_only = StepPrologue(model, None, last, compiled=True)
    assert inputs_only._inputs is not None and inputs_only._norm is None
    assert inputs_only.norm(hidden).equal(model.model.norm(hidden))  # the model's own module
    monkeypatch.setenv(PROLOGUE_ENV, "eager")
    eager = StepPrologue(model, None, last, compiled=True)
    assert eager._inputs is None and eager._norm is None
    monkeypatch.setenv(PROLOGUE_ENV, "fast")
    with pytest.raises(InputError, match=f"{PROLOGUE_ENV}='fast'"):
        StepPrologue(model, None, last, compiled=True)
