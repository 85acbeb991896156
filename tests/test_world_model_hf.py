"""The transformers reference: layout, KV cache, sampling and checkpoint loading (CPU, tiny models)."""

import json

import numpy as np
import pytest
import torch

from terra_cli.backends.hf import generate_frames, sample_next
from terra_cli.models.checkpoint import CheckpointError, load_config, resolve_checkpoint_dir, weight_files
from terra_cli.models.config import ARCH_V2, ConfigError, LlamaActionConfig
from terra_cli.models.modeling_hf import MODEL_CLASSES, build_model, load_model
from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG, tiny_config, write_tiny_checkpoint
from terra_cli.backends.base import InputError, Sampling
from transformers.cache_utils import DynamicCache


def interleaved(layout, frame_tokens, rng):
    """ids (1, L) with action placeholders after every frame, and the actions (1, slots, 3)."""
    placeholders = np.full((frame_tokens.shape[0], layout.action_tokens), layout.action_placeholder_id)
    ids = np.concatenate([frame_tokens, placeholders], axis=1).reshape(1, -1)
    actions = rng.normal(size=(1, frame_tokens.shape[0] * layout.action_tokens, 3)).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(actions)


@pytest.mark.parametrize("arch", ["LlamaActionForCausalLM", ARCH_V2])
def test_kv_cached_steps_match_one_full_forward(arch):
    torch.manual_seed(0)
    config = tiny_config(arch, image_tokens=24, action_tokens=6)
    model = build_model(config)
    layout = config.layout
    rng = np.random.default_rng(0)
    codes = rng.integers(0, layout.image_vocab_size, size=(3, layout.image_tokens))
    codes[0, 0] = 0  # 0 is a valid image code, not padding
    ids, actions = interleaved(layout, codes, rng)
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        full, _ = model(ids, positions, actions)

        # Prefill frame 0 + its actions, then one token at a time, with the last code of each
        # frame fed together with that frame's 6 action slots (the generation schedule).
        stride = layout.frame_stride
        chunks = [(0, stride)]
        pos = stride
        while pos < ids.shape[1]:
            last_code = (pos // stride) * stride + layout.image_tokens - 1
            end = last_code + 1 + layout.action_tokens if pos == last_code else pos + 1
            chunks.append((pos, end))
            pos = end
        cache = DynamicCache(config=config)
        pieces = []
        for start, end in chunks:
            slots_before = int((ids[0, :start] == layout.action_placeholder_id).sum())
            slots_here = int((ids[0, start:end] == layout.action_placeholder_id).sum())
            step_actions = actions[:, slots_before : slots_before + slots_here] if slots_here else None
            logits, cache = model(ids[:, start:end], positions[:, start:end], step_actions, cache, use_cache=True)
            pieces.append(logits)
        incremental = torch.cat(pieces, dim=1)
    assert incremental.shape == full.shape
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)
    # The action embeddings matter: other actions change the logits after the first frame.
    with torch.no_grad():
        other, _ = model(ids, positions, actions + 1.0)
    assert torch.allclose(other[:, : layout.image_tokens], full[:, : layout.image_tokens])
    assert not torch.allclose(other[:, stride:], full[:, stride:])


def test_spatio_temporal_embedding_indexes_by_frame_and_slot():
    config = tiny_config(image_tokens=10, action_tokens=2)
    model = build_model(config)
    emb = model.pos_embedding_spatio_temporal
    positions = torch.tensor([0, 11, 12, 25])
    expected = torch.stack([
        emb.spatio_embeddings.weight[0] + emb.temporal_embeddings.weight[0],
        emb.spatio_embeddings.weight[11] + emb.temporal_embeddings.weight[0],
        emb.spatio_embeddings.weight[0] + emb.temporal_embeddings.weight[1],
        emb.spatio_embeddings.weight[1] + emb.temporal_embeddings.weight[2],
    ])
    torch.testing.assert_close(emb(positions), expected)


def test_terra_config_parses_unchanged_and_has_released_parameter_counts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TERRA_WORLD_MODEL_CONFIG))
    config = load_config(tmp_path)
    assert isinstance(config, LlamaActionConfig)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (2048, 5632, 22)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 4, 262145)
    assert config.num_action_embeddings == config.num_action_tokens == 6
    assert (config.num_image_patches, config.num_spatio_embeddings, config.num_temporal_embeddings) == (576, 582, 25)
    assert config.rope_parameters["rope_theta"] == 10000
    assert config.layout.special_id == 262144 == config.eos_token_id
    counts = {}
    for arch in MODEL_CLASSES:
        config.architectures = [arch]
        with torch.device("meta"):
            model = MODEL_CLASSES[arch](config)
        counts[arch] = sum(p.numel() for p in model.parameters())
    assert counts == {"LlamaActionForCausalLM": 2_043_973_632, "LlamaActionV2ForCausalLM": 2_052_366_336}
    names = set(model.state_dict())
    assert "pos_embedding_spatio_temporal.spatio_embeddings.weight" in names
    assert "action_projection.4.bias" in names and "model.layers.21.mlp.gate_proj.weight" in names


def test_disagreeing_action_token_counts_fail_loudly(tmp_path):
    raw = dict(TERRA_WORLD_MODEL_CONFIG, num_action_tokens=5)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="num_action_tokens=5 but num_action_embeddings=6"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="num_spatio_embeddings"):
        LlamaActionConfig(num_image_patches=500)


def test_tiny_checkpoint_loads_strictly_and_reproduces_weights(tmp_path):
    config = tiny_config()
    write_tiny_checkpoint(tmp_path / "single", config, seed=3)
    write_tiny_checkpoint(tmp_path / "sharded", config, seed=3, max_shard_bytes=200_000)
    assert len(weight_files(tmp_path / "sharded")) > 1
    a, b = load_model(tmp_path / "single"), load_model(tmp_path / "sharded")
    for (ka, va), (kb, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert ka == kb and torch.equal(va, vb)


def test_renamed_missing_and_misshaped_keys_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    state = load_file(ckpt / "model.safetensors")
    state["action_proj.weight"] = state.pop("action_projection.weight")
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert "missing keys: action_projection.weight" in str(err.value)
    assert "unexpected keys: action_proj.weight" in str(err.value)

    state["action_projection.weight"] = state.pop("action_proj.weight")[:, :2].contiguous()
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"action_projection.weight \(64, 2\) \(config wants \(64, 3\)\)"):
        load_model(ckpt)


def test_hub_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--turing-motors--Terra"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    write_tiny_checkpoint(repo / "snapshots" / commit / "world_model")
    found = resolve_checkpoint_dir("turing-motors/Terra", "world_model", cache_dir=tmp_path / "cache")
    assert found == repo / "snapshots" / commit / "world_model"
    assert load_model(found).config.num_hidden_layers == 2
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_checkpoint_dir("turing-motors/NotThere", "world_model", cache_dir=tmp_path / "cache")


def test_sampler_never_draws_the_special_id():
    layout = tiny_config().layout
    logits = torch.full((4, layout.image_vocab_size + 1), -5.0)
    logits[:, layout.special_id] = 100.0  # overwhelmingly likely, yet forbidden
    logits[:, 7] = 1.0
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert sample_next(logits, layout, Sampling(temperature=0), gens).tolist() == [7] * 4
    for _ in range(20):
        drawn = sample_next(logits, layout, Sampling(temperature=1.5), gens)
        assert (drawn < layout.special_id).all()
    top1 = sample_next(logits, layout, Sampling(temperature=1.0, top_k=1), gens)
    assert top1.tolist() == [7] * 4
    nucleus = sample_next(logits, layout, Sampling(temperature=1.0, top_p=0.01), gens)
    assert nucleus.tolist() == [7] * 4


def test_generation_is_seeded_and_rollouts_are_independent_of_batching(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    rng = np.random.default_rng(1)
    context = rng.integers(0, 512, size=(2, 576))
    actions = rng.normal(size=(2, 4, 6, 3)).astype(np.float32)
    sampling = Sampling(temperature=1.0, seed=5)
    batched = generate_frames(model, np.stack([context] * 2), actions, 4, sampling)
    assert batched.shape == (2, 4, 576) and batched.dtype == np.int64
    assert (batched[:, :2] == context).all()
    assert (batched >= 0).all() and (batched < 512).all()
    for r in range(2):
        alone = generate_frames(model, context, actions[r : r + 1], 4, Sampling(temperature=1.0, seed=5 + r))
        np.testing.assert_array_equal(alone[0], batched[r])
    again = generate_frames(model, np.stack([context] * 2), actions, 4, sampling)
    np.testing.assert_array_equal(again, batched)


def test_generation_rejects_bad_inputs(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    ctx = np.zeros((2, 576), dtype=np.int64)
    acts = np.zeros((4, 6, 3), dtype=np.float32)
    with pytest.raises(InputError, match="at least 4 frames"):
        generate_frames(model, ctx, acts[:3], 5, Sampling(temperature=0))
    with pytest.raises(InputError, match="at most 25"):
        generate_frames(model, ctx, np.zeros((30, 6, 3)), 26, Sampling(temperature=0))
    with pytest.raises(InputError, match="image codes"):
        generate_frames(model, ctx + 512, acts, 3, Sampling(temperature=0))
    with pytest.raises(InputError, match="NaN"):
        generate_frames(model, ctx, acts * np.nan, 3, Sampling(temperature=0))
