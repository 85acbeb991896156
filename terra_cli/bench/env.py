"""`terra bench --env N`: the closed-loop simulator (terra_cli.env) against the engine it runs on,
on one loaded model, tokens only (nothing decoded).

1. Stepping: N environments step one frame each, `steps` times (`TerraVectorEnv.step`, one
   `RolloutJob` per environment and step), against the engine's own rate: N rollouts of `steps`
   frames in flight at once through the same backend's driver (`run_lockstep`, continuous batching
   on vLLM), measured in the same process just before. The issue's target: the env at >= 90% of it.
2. Forking: one environment steps to a `fork_from`-frame state and forks `branches` branches (the
   parent is dropped). Three times of B new frames each, from the same state:
   - `fork_step_s`: the branches' first step: on vLLM their prompts borrow the parent's cache salt
     and ids (backends/vllm_slots.py), so the state's prefix is served from the cache;
   - `continued_step_s`: the branches' second step, each over its own cached prefix: the time of
     the branches' new frames only, the yardstick (target: fork_step_s within 10% of it);
   - `fresh_step_s`: B new environments reset with the same state as context, stepping once: no
     shared prefix, every prompt computed (what a fork costs without the cache).
   Each with the prefix-cache hits of its requests (vLLM: cached / prompt tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class EnvBenchPlan:
    envs: int = 64
    steps: int = 8  # frames each environment steps in the stepping measure
    context_frames: int = 3
    branches: int = 8
    fork_from: int = 20  # frames of the forked state, context included
    backend: str = "vllm"
    device: str = "auto"
    dtype: str = "auto"
    temperature: float = 0.9
    seed: int = 0
    vllm_options: dict = field(default_factory=dict)


def check_plan(plan: EnvBenchPlan, layout) -> None:
    from terra_cli.errors import InputError

    if not 1 <= plan.context_frames < layout.max_frames:
        raise InputError(f"--context-frames must be from 1 to {layout.max_frames - 1}, got {plan.context_frames}")
    if plan.steps < 1 or plan.context_frames + plan.steps > layout.max_frames:
        raise InputError(f"--steps must be from 1 to {layout.max_frames - plan.context_frames} (one round), "
                         f"got {plan.steps}")
    if not plan.context_frames < plan.fork_from <= layout.max_frames - 2:
        raise InputError(f"--fork-from must be from {plan.context_frames + 1} to {layout.max_frames - 2} (the state "
                         f"and the branches' two steps in one round), got {plan.fork_from}")
    if plan.branches < 1:
        raise InputError(f"--branches must be at least 1, got {plan.branches}")


def run_env_bench(checkpoint, plan: EnvBenchPlan, log: Callable[[str], None] = print) -> dict:
    from terra_cli.backends import Sampling, load_backend
    from terra_cli.models.checkpoint import load_config
    from terra_cli.runtime import resolve_device

    layout = load_config(checkpoint).layout
    check_plan(plan, layout)
    in_flight = max(plan.envs, 2 * plan.branches + 1)  # the fork's branches, and the fresh ones beside them
    began = time.perf_counter()
    backend = load_backend(plan.backend, checkpoint, device=resolve_device(plan.device), dtype=plan.dtype,
                           max_rollouts=in_flight, **plan.vllm_options)
    startup = time.perf_counter() - began
    log(f"engine ready in {startup:.1f} s")
    sampling = Sampling(temperature=plan.temperature, seed=plan.seed)
    rng = np.random.default_rng(plan.seed)
    try:
        warm_up(backend, layout, plan, sampling, rng)
        stepping = measure_stepping(backend, layout, plan, sampling, rng, in_flight, log)
        fork = measure_fork(backend, layout, plan, sampling, rng, in_flight, log)
    finally:
        backend.close()
    return {"plan": {k: v for k, v in plan.__dict__.items() if k != "vllm_options"},
            "vllm_options": plan.vllm_options, "backend": backend.name, "startup_s": round(startup, 2),
            "stepping": stepping, "fork": fork}


def contexts(rng, layout, count: int, frames: int) -> np.ndarray:
    """Distinct random context tokens (count, frames, T): no prefix is shared by accident."""
    return rng.integers(0, layout.image_vocab_size, size=(count, frames, layout.image_tokens), dtype=np.int64)


def step_actions(count: int, steps: int) -> np.ndarray:
    """(count, steps, 6, 3): the environments drive the presets in turn (different rows per env)."""
    from terra_cli.actions import preset_actions

    names = ("left", "straight", "right", "accelerate", "stop")
    return np.stack([preset_actions(names[i % len(names)], steps, 20.0 + i % 7) for i in range(count)])


def warm_up(backend, layout, plan, sampling, rng) -> None:
    """One short job per environment: the engine's first steps (compilation, graphs) are not timed."""
    from terra_cli.backends.driver import RolloutJob, run_lockstep

    context = contexts(rng, layout, plan.envs, plan.context_frames)
    actions = step_actions(plan.envs, plan.context_frames)
    jobs = [RolloutJob(f"warm{i}", context[i], actions[i], plan.context_frames + 1, sampling)
            for i in range(plan.envs)]
    run_lockstep(backend.driver(plan.envs), jobs)


def cache_counts(before, after) -> dict:
    if before is None or after is None:
        return {"cached_tokens": None, "prompt_tokens": None, "hit_rate": None}
    cached, prompt = after[0] - before[0], after[1] - before[1]
    return {"cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": round(cached / prompt, 4) if prompt else None}


def measure_stepping(backend, layout, plan, sampling, rng, in_flight, log) -> dict:
    from dataclasses import replace

    from terra_cli.backends.driver import RolloutJob, run_lockstep
    from terra_cli.env import TerraVectorEnv

    n, k = plan.envs, plan.context_frames
    context = contexts(rng, layout, n, k)
    actions = step_actions(n, k - 1 + plan.steps)
    jobs = [RolloutJob(f"engine{i}", context[i], actions[i], k + plan.steps, replace(sampling, seed=plan.seed + i))
            for i in range(n)]
    driver = backend.driver(n)
    began = time.perf_counter()
    run_lockstep(driver, jobs)
    engine_s = time.perf_counter() - began
    engine_fps = n * plan.steps / engine_s
    log(f"engine: {n} rollouts x {plan.steps} frames in flight: {engine_fps:.2f} frames/s")

    env = TerraVectorEnv(n, backend=backend, observation="tokens", max_frames=k + plan.steps, max_in_flight=in_flight,
                         sampling=sampling)
    try:
        context = contexts(rng, layout, n, k)
        env.reset(seed=plan.seed, options={"contexts": [{"tokens": c} for c in context],
                                           "context_actions": actions[:, : k - 1] if k > 1 else None})
        before, times = env.engine.prefix_cache, []
        for step in range(plan.steps):
            env.step(actions[:, k - 1 + step])
            times.append(env.last_step_seconds)
        cache = cache_counts(before, env.engine.prefix_cache)
        loop = env.engine.driver.loop.as_dict()
    finally:
        env.close()
    env_fps = n * plan.steps / sum(times)
    log(f"env: {n} environments x {plan.steps} steps: {env_fps:.2f} frames/s ({env_fps / engine_fps:.0%} of the engine's)")
    return {"environments": n, "steps": plan.steps, "engine_seconds": round(engine_s, 3),
            "engine_frames_per_s": round(engine_fps, 3), "env_seconds": round(sum(times), 3),
            "env_frames_per_s": round(env_fps, 3), "env_over_engine": round(env_fps / engine_fps, 4),
            "step_seconds": [round(t, 4) for t in times], "prefix_cache": cache, "env_engine_loop": loop}


def measure_fork(backend, layout, plan, sampling, rng, in_flight, log) -> dict:
    from terra_cli.env import TerraVectorEnv

    k, b = plan.context_frames, plan.branches
    actions = step_actions(b, plan.fork_from + 1)  # branch i drives preset i for its two steps
    env = TerraVectorEnv(1, backend=backend, observation="tokens", max_frames=plan.fork_from + 2,
                         max_in_flight=in_flight, sampling=sampling)
    try:
        env.reset(seed=plan.seed, options={"context": {"tokens": contexts(rng, layout, 1, k)[0]}})
        for step in range(plan.fork_from - k):
            env.step(actions[:1, k - 1 + step])
        state = env.tokens(0)
        env.select(env.fork(0, b))  # the parent's state in b branches; the parent is dropped
        timed = []
        for step in range(2):
            before = env.engine.prefix_cache
            env.step(actions[:, plan.fork_from - 1 + step])
            timed.append((env.last_step_seconds, cache_counts(before, env.engine.prefix_cache)))
    finally:
        env.close()
    fresh = TerraVectorEnv(b, backend=backend, observation="tokens", max_frames=plan.fork_from + 1,
                           max_in_flight=in_flight, sampling=sampling)
    try:  # the same state as every environment's context: the same prompts, no shared cached prefix
        fresh.reset(seed=plan.seed + 1, options={"context": {"tokens": state}})
        before = fresh.engine.prefix_cache
        fresh.step(actions[:, plan.fork_from - 1])
        fresh_s, fresh_cache = fresh.last_step_seconds, cache_counts(before, fresh.engine.prefix_cache)
    finally:
        fresh.close()
    (fork_s, fork_cache), (continued_s, continued_cache) = timed
    log(f"fork of {b} from a {plan.fork_from}-frame state: first step {fork_s:.3f} s, next step {continued_s:.3f} s "
        f"(new frames only), {b} fresh rollouts from the state {fresh_s:.3f} s")
    return {"branches": b, "fork_from": plan.fork_from, "fork_step_s": round(fork_s, 4),
            "continued_step_s": round(continued_s, 4), "fresh_step_s": round(fresh_s, 4),
            "fork_over_continued": round(fork_s / continued_s, 4), "fresh_over_continued": round(fresh_s / continued_s, 4),
            "prefix_cache": {"fork_step": fork_cache, "continued_step": continued_cache, "fresh_step": fresh_cache}}
