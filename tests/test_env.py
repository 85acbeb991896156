"""terra_cli.env, the closed-loop simulator, on the reference backend: gymnasium's checker, the seed
rule (an env equals `generate_tokens` over two rounds), forks equal re-running from the same state
with the branch's seed, and bad actions give one error and disturb nothing. A tiny model of 1024
codes (tests/server_helpers.py): five-frame rounds, so frame 5 rolls over. Pixels come from
conftest's frame_tokenizer, a small tokenizer of Terra's frame size and codes (cheaper decodes)."""

from __future__ import annotations

import numpy as np
import pytest

from server_helpers import context_tokens, serve_checkpoint

gymnasium = pytest.importorskip("gymnasium")

SEED = 41
TOTAL = 7  # two rounds of five frames after two context frames


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from terra_cli.backends.hf import HfBackend

    return HfBackend(serve_checkpoint(tmp_path_factory.mktemp("env_model")), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(frame_tokenizer):
    from tokenizer_decoder import ImageTokenizer

    return ImageTokenizer.from_pretrained(frame_tokenizer, device="cpu")


def vector_env(backend, num_envs, **kwargs):
    from terra_cli.env import TerraVectorEnv

    kwargs.setdefault("observation", "tokens")
    return TerraVectorEnv(num_envs, backend=backend, **kwargs)


def waypoints(rng, frames):
    """Per-frame waypoints that differ frame to frame (so a wrong row would show)."""
    from terra_cli.actions import preset_actions

    base = preset_actions("left", frames, 30.0)
    return (base + rng.normal(0, 0.5, base.shape) * np.array([1, 1, 0])).astype(np.float32)


def test_gymnasium_env_checker_passes(backend, tokenizer):
    from gymnasium.utils.env_checker import check_env

    from terra_cli.env import TerraEnv

    env = TerraEnv(backend=backend, tokenizer=tokenizer, observation="tokens", max_frames=6)
    check_env(env, skip_render_check=True)
    env.close()


def test_pixels_are_the_tokens_decoded_in_one_batch(backend, tokenizer):
    from terra_cli.actions import preset_actions
    from terra_cli.errors import InputError

    env = vector_env(backend, 2, tokenizer=tokenizer, observation="both", max_frames=4)
    observation, info = env.reset(seed=SEED, options={"context_frames": 2})
    assert observation["pixels"].shape == (2, 288, 512, 3) and observation in env.observation_space
    step = np.repeat(preset_actions("straight", 1)[None, 0], 2, axis=0)
    observation, reward, terminated, truncated, info = env.step(step)
    assert observation in env.observation_space and list(info["frame"]) == [2, 2]
    np.testing.assert_array_equal(observation["pixels"], tokenizer.decode_tokens(observation["tokens"]))
    assert reward.tolist() == [0, 0] and not terminated.any() and not truncated.any()
    observation, _, _, truncated, _ = env.step(step)
    assert truncated.all()  # four frames: the cap
    with pytest.raises(InputError, match="max_frames"):
        env.step(step)
    env.close()


def test_env_draws_the_tokens_of_generate_and_bad_actions_disturb_nothing(backend):
    from terra_cli.backends.base import Sampling
    from terra_cli.errors import InputError
    from terra_cli.pipeline.rounds import generate_tokens

    rng = np.random.default_rng(0)
    context = np.array(context_tokens(2, seed=5), dtype=np.int64)
    actions = np.stack([waypoints(rng, TOTAL - 1), waypoints(rng, TOTAL - 1)])  # (2 envs, frames, 6, 3)
    env = vector_env(backend, 2, max_frames=TOTAL)
    env.reset(seed=SEED, options={"context": context, "context_actions": actions[:, :1]})
    for n in range(2, TOTAL):
        if n == 4:  # refused before anything is submitted; the envs go on as if never asked
            bad = actions[:, n - 1].copy()
            bad[1, 2, 0] = np.nan
            with pytest.raises(InputError, match=r"environment\(s\) \[1\]"):
                env.step(bad)
            with pytest.raises(InputError, match=r"shape \(2, 6, 3\)"):
                env.step(actions[:1, n - 1])
            assert [s.frames for s in env.states] == [4, 4]
        observation, _, _, truncated, info = env.step(actions[:, n - 1])
        assert list(info["frame"]) == [n, n] and truncated.all() == (n == TOTAL - 1)
    expected = generate_tokens(backend, context, actions, TOTAL, Sampling(seed=SEED))  # rollout r: seed SEED + r
    for i in range(2):
        np.testing.assert_array_equal(env.tokens(i), expected[i])
    assert (expected[0, 2:] != expected[1, 2:]).mean() > 0.5  # the two seeds drew different frames

    again = vector_env(backend, 1, max_frames=TOTAL)  # seed SEED + 1 alone draws env 1's frames
    again.reset(seed=SEED + 1, options={"contexts": [{"tokens": context}], "context_actions": actions[1, :1]})
    for n in range(2, 5):
        again.step(actions[1:, n - 1])
    np.testing.assert_array_equal(again.tokens(0), expected[1, :5])
    env.close()
    again.close()


def test_fork_equals_rerunning_from_the_state_with_the_branch_seed(backend):
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.driver import RolloutJob, run_lockstep
    from terra_cli.seeds import branch_seed

    rng = np.random.default_rng(1)
    context = np.array(context_tokens(2, seed=6), dtype=np.int64)
    actions = waypoints(rng, TOTAL - 1)
    env = vector_env(backend, 1, max_frames=TOTAL)
    env.reset(seed=SEED, options={"context": context})
    for n in range(2, 5):
        env.step(actions[None, n - 1])
    assert env.fork(0, 2) == [1, 2] and env.num_envs == 3
    seeds = [s.sampling.seed for s in env.states]
    assert seeds == [SEED, branch_seed(SEED, 1), branch_seed(SEED, 2)]
    state = env.tokens(0)
    rows = np.stack(env.states[0].rows)
    for n in range(5, TOTAL):
        env.step(np.repeat(actions[None, n - 1], 3, axis=0))
    for index, seed in enumerate(seeds):
        # Frames 5 and 6 fall in round 2 (frames 2..6): its context is frames 2..4, drawn as frames 5, 6.
        job = RolloutJob("rerun", state[2:5], np.concatenate([rows[2:], actions[4:6]]), 5, Sampling(seed=seed),
                         frame_offset=2)
        rerun = run_lockstep(backend.driver(1), [job])[0]
        np.testing.assert_array_equal(env.tokens(index), np.concatenate([state, rerun[3:]]))
    assert (env.tokens(1)[5:] != env.tokens(2)[5:]).mean() > 0.5
    kept = env.tokens(2)
    env.select([2])
    assert env.num_envs == 1 and env.action_space.shape == (1, 6, 3)
    np.testing.assert_array_equal(env.tokens(0), kept)
    assert env.fork(0, 1) == [1] and env.states[1].sampling.seed == branch_seed(SEED, 3)  # the lineage counts on
    env.close()


def test_branch_seeds_never_meet_environment_seeds_and_stay_in_range():
    from terra_cli.errors import InputError
    from terra_cli.seeds import BRANCH_STRIDE, MAX_ENVIRONMENTS, MAX_SEED, branch_seed

    base = 10
    envs = {base + i for i in range(MAX_ENVIRONMENTS)}
    branches = {branch_seed(base + i, c) for i in (0, 1, MAX_ENVIRONMENTS - 1) for c in range(1, 50)}
    assert not envs & branches and len(branches) == 3 * 49
    with pytest.raises(InputError, match="from 0 to"):
        branch_seed(MAX_SEED - BRANCH_STRIDE + 1, 1)


def test_bad_options_and_arguments_are_input_errors(backend, tokenizer):
    from terra_cli.errors import InputError

    with pytest.raises(InputError, match="observation"):
        vector_env(backend, 1, observation="latents")
    with pytest.raises(InputError, match="tokenizer"):
        vector_env(backend, 1, observation="pixels")
    env = vector_env(backend, 2, max_frames=TOTAL)
    with pytest.raises(InputError, match="before step"):
        env.step(np.zeros((2, 6, 3)))
    with pytest.raises(InputError, match="contexts holds 1"):
        env.reset(seed=0, options={"contexts": [np.zeros((2, 576), dtype=np.int64)]})
    with pytest.raises(InputError, match="unknown reset option"):
        env.reset(seed=0, options={"frames": 3})
    with pytest.raises(InputError, match="needs an image tokenizer"):
        env.reset(seed=0)
    with pytest.raises(InputError, match="image codes"):
        env.reset(seed=0, options={"context": np.full((2, 576), 5000)})
    env.reset(seed=0, options={"context": np.zeros((2, 576), dtype=np.int64)})
    with pytest.raises(InputError, match="select"):
        env.select([0, 0])
    with pytest.raises(InputError, match="fork"):
        env.fork(2, 1)
    for indices in ([0.7], np.array([True])):  # a float index or a mask of another length: no guess at what was meant
        with pytest.raises(InputError, match="select: indices must be integers"):
            env.select(indices)
    for actions in (np.full((2, 6, 3), 1 + 1j), np.ones((2, 6, 3), dtype=bool), [[[10**400, 0, 0]] * 6] * 2):
        with pytest.raises(InputError, match="actions must be real numbers"):
            env.step(actions)
    for count in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="context_frames must be a whole number"):
            env.reset(seed=0, options={"context": np.zeros((2, 576), dtype=np.int64), "context_frames": count})
    with pytest.raises(InputError, match="contexts is a list"):
        env.reset(seed=0, options={"contexts": "ab"})
    assert env.num_envs == 2
    env.select(np.array([False, True]))  # a mask of num_envs: the environments where it is True
    assert env.num_envs == 1
    env.close()
    with pytest.raises(InputError, match="closed"):
        env.reset(seed=0, options={"context": np.zeros((2, 576), dtype=np.int64)})


def test_loading_on_vllm_configures_vllms_environment_first(monkeypatch):
    """A library caller of `TerraVectorEnv.load(backend="vllm")` needs no `configure_vllm_env()` of
    its own (the closed-loop example failed without it on the GPU host): the settings are in place
    before the backend loads, and what the caller set stays."""
    import os

    import terra_cli.backends as backends
    from terra_cli.env import TerraVectorEnv

    seen = {}

    class Loaded(Exception):
        pass

    def fake_load_backend(name, checkpoint_dir, **kwargs):
        seen.update(name=name, multiprocessing=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
                    level=os.environ.get("VLLM_LOGGING_LEVEL"))
        raise Loaded

    for variable in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.setattr(backends, "load_backend", fake_load_backend)
    with pytest.raises(Loaded):
        TerraVectorEnv.load(1, backend="vllm", device="cpu")
    assert seen == {"name": "vllm", "multiprocessing": "0", "level": "ERROR"}
