"""Model and tokenizer pairing (`models/resolve.py`), and the embedding layers both backends share
(`modeling_hf.SpatioTemporalEmbedding`, `build_action_projection`) against the published math."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from terra_cli.errors import InputError
from terra_cli.models.config import ARCH_V2
from terra_cli.models.modeling_hf import SpatioTemporalEmbedding, build_action_projection, build_model
from terra_cli.models.resolve import (TokenizerSpec, check_tokenizer_matches, resolve_model,
                                      split_tokenizer_spec)
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint


def _tokenizer_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_the_default_is_terra_mini_with_its_own_tokenizer():
    from terra_cli.models.default import default_tokenizer_dir, default_world_model_dir

    choice = resolve_model(None)
    assert choice.is_default and choice.world_model_dir == default_world_model_dir()
    assert choice.tokenizer == TokenizerSpec(str(default_tokenizer_dir()), None)


def test_a_local_terra_snapshot_pairs_each_variant_with_its_tokenizer(tmp_path):
    write_tiny_checkpoint(tmp_path / "world_model", tiny_config(image_tokens=16, layers=1))
    write_tiny_checkpoint(tmp_path / "world_model_v2", tiny_config(ARCH_V2, image_tokens=16, layers=1))
    _tokenizer_dir(tmp_path / "lfq_tokenizer_B_256")
    _tokenizer_dir(tmp_path / "lfq_tokenizer_B_256_ema")
    v1 = resolve_model(str(tmp_path))
    v2 = resolve_model(str(tmp_path), "world_model_v2")
    assert v1.world_model_dir == tmp_path / "world_model"
    assert v1.tokenizer == TokenizerSpec(str(tmp_path / "lfq_tokenizer_B_256"), None)
    assert v2.world_model_dir == tmp_path / "world_model_v2"
    assert v2.tokenizer == TokenizerSpec(str(tmp_path / "lfq_tokenizer_B_256_ema"), None)
    # --tokenizer wins over the pairing
    other = _tokenizer_dir(tmp_path / "elsewhere" / "tok")
    assert resolve_model(str(tmp_path), tokenizer=str(other)).tokenizer == TokenizerSpec(str(other), "lfq_tokenizer_B_256")
    with pytest.raises(InputError, match="--variant must be one of"):
        resolve_model(str(tmp_path), "world_model_v3")


def test_a_bare_checkpoint_comes_without_a_tokenizer(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", tiny_config(image_tokens=16, layers=1))
    choice = resolve_model(str(checkpoint))
    assert choice.world_model_dir == checkpoint and choice.tokenizer is None and not choice.is_default


def test_tokenizer_specs_local_and_hub():
    assert split_tokenizer_spec("turing-motors/Terra") == TokenizerSpec("turing-motors/Terra", "lfq_tokenizer_B_256")
    assert split_tokenizer_spec("turing-motors/Terra", "lfq_tokenizer_B_256_ema").subfolder == "lfq_tokenizer_B_256_ema"
    assert split_tokenizer_spec("someone/tok/sub/dir") == TokenizerSpec("someone/tok", "sub/dir")
    assert split_tokenizer_spec("someone/tok") == TokenizerSpec("someone/tok", None)
    assert split_tokenizer_spec("./not/there").source == "./not/there"  # a path, never a hub id


def test_the_hub_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    repo = tmp_path / "models--turing-motors--Terra"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    write_tiny_checkpoint(snapshot / "world_model_v2", tiny_config(ARCH_V2, image_tokens=16, layers=1))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    choice = resolve_model("turing-motors/Terra", "world_model_v2")
    assert choice.world_model_dir == snapshot / "world_model_v2"
    assert choice.tokenizer == TokenizerSpec("turing-motors/Terra", "lfq_tokenizer_B_256_ema")
    assert choice.label == "turing-motors/Terra/world_model_v2"
    from tokenizer_decoder.errors import CheckpointError

    with pytest.raises(CheckpointError, match="turing-motors/Terra/world_model has no config.json"):
        resolve_model("turing-motors/Terra", "world_model")  # the snapshot lacks this variant
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_model("someone/absent-model")


def test_a_tokenizer_that_does_not_fit_the_model_is_one_line():
    config = tiny_config(image_tokens=16, image_vocab=512, layers=1)
    check_tokenizer_matches(SimpleNamespace(codebook_size=512, tokens_per_frame=16, source="ok"), config)
    with pytest.raises(InputError, match="has 1024 codes but the world model expects 512"):
        check_tokenizer_matches(SimpleNamespace(codebook_size=1024, tokens_per_frame=16, source="t"), config)
    with pytest.raises(InputError, match="makes 576 tokens per frame but the world model expects 16"):
        check_tokenizer_matches(SimpleNamespace(codebook_size=512, tokens_per_frame=576, source="t"), config)


@pytest.mark.parametrize("mlp", [False, True])
def test_action_projection_is_the_published_linear_or_mlp(mlp):
    torch.manual_seed(0)
    config = tiny_config(hidden_size=64, layers=1)
    projection = build_action_projection(config, mlp)
    waypoints = torch.randn(4, 6, 3)
    if mlp:  # Terra v2: Linear(3, H), ReLU, Linear(H, H), ReLU, Linear(H, H); names .0, .2, .4
        names = [name for name, _ in projection.named_parameters()]
        assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        h = torch.relu(waypoints @ projection[0].weight.T + projection[0].bias)
        h = torch.relu(h @ projection[2].weight.T + projection[2].bias)
        expected = h @ projection[4].weight.T + projection[4].bias
    else:  # Terra v1: one Linear(3, H)
        assert projection.weight.shape == (64, 3)
        expected = waypoints @ projection.weight.T + projection.bias
    torch.testing.assert_close(projection(waypoints), expected)


def test_spatio_temporal_embedding_and_the_interleaved_input():
    torch.manual_seed(0)
    config = tiny_config(hidden_size=64, layers=1, image_tokens=16, max_frames=3)
    layout = config.layout
    per_frame = layout.image_tokens + layout.action_tokens  # 22 positions
    table = SpatioTemporalEmbedding(per_frame, 3, 64)
    positions = torch.tensor([0, 5, 21, 22, 43, 44, 65, 66, 200])  # the last two lie past frame 2
    expected = torch.stack([table.spatio_embeddings.weight[p % per_frame] +
                            table.temporal_embeddings.weight[min(p // per_frame, 2)] for p in positions.tolist()])
    torch.testing.assert_close(table(positions), expected)

    model = build_model(config).eval()
    frames = 2
    codes = torch.randint(0, layout.image_vocab_size, (1, frames, layout.image_tokens))
    slots = torch.full((1, frames, layout.action_tokens), layout.action_placeholder_id)
    ids = torch.cat([codes, slots], dim=2).reshape(1, -1)
    waypoints = torch.randn(1, frames * layout.action_tokens, 3)
    position_ids = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        embeds = model.embed(ids, waypoints, position_ids)[0]
        actions = model.action_projection(waypoints[0])
    st = model.pos_embedding_spatio_temporal
    for p in range(ids.shape[1]):
        frame, slot = divmod(p, per_frame)
        token = (model.model.embed_tokens.weight[ids[0, p]] if slot < layout.image_tokens
                 else actions[frame * layout.action_tokens + slot - layout.image_tokens])
        want = token + st.spatio_embeddings.weight[slot] + st.temporal_embeddings.weight[frame]
        torch.testing.assert_close(embeds[p], want, msg=f"position {p}")


def test_load_tokenizer_checks_it_against_the_model_when_asked():
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.models.resolve import load_tokenizer, split_tokenizer_spec

    spec = split_tokenizer_spec(str(default_tokenizer_dir()))
    embedded = load_tokenizer(spec, "cpu", matching=tiny_config(image_tokens=576, image_vocab=1024, layers=1))
    assert embedded.codebook_size == 1024
    with pytest.raises(InputError, match="has 1024 codes but the world model expects 512"):
        load_tokenizer(spec, "cpu", matching=tiny_config(image_tokens=576, image_vocab=512, layers=1))
