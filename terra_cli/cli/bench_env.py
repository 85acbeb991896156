"""`terra bench --env N`: the closed-loop simulator's stepping and forking (terra_cli/bench/env.py),
its table and JSON."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.table import Table

from terra_cli.cli.app import console, out


def env_bench(model: str | None, plan, out_json: Path | None, overwrite: bool) -> None:
    from terra_cli.bench.env import check_plan, run_env_bench
    from terra_cli.bench.cache import bench_layout, random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.models.resolve import resolve_world_model_dir
    from terra_cli.runtime import resolve_device

    # --out was checked with the bench's other outputs (cli/bench.py).
    log = lambda msg: console.print(f"[dim]{msg}[/]", highlight=False)  # noqa: E731
    check_plan(plan, bench_layout(model))  # before a random model is built or the engine loads
    checkpoint = (resolve_world_model_dir(model) if model else
                  random_terra_checkpoint(resolve_device(plan.device), plan.seed, log))
    results = run_env_bench(checkpoint, plan, log)
    results["model"] = str(model or checkpoint)
    results["command"] = "terra " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results["environment"] = environment()
    stepping, fork = results["stepping"], results["fork"]
    table = Table(title=f"terra bench --env: {results['model']} ({results['backend']})")
    for col in ("measure", "seconds", "frames/s", "ratio", "prefix cache hits"):
        table.add_column(col, justify="left" if col == "measure" else "right")

    def hits(cache: dict) -> str:
        if cache["cached_tokens"] is None:
            return "-"
        return f"{cache['cached_tokens']:,} / {cache['prompt_tokens']:,} tokens"

    n, steps = stepping["environments"], stepping["steps"]
    table.add_row(f"engine: {n} rollouts in flight x {steps} frames", f"{stepping['engine_seconds']:.2f}",
                  f"{stepping['engine_frames_per_s']:.2f}", "1", "-")
    table.add_row(f"env: {n} environments x {steps} steps", f"{stepping['env_seconds']:.2f}",
                  f"{stepping['env_frames_per_s']:.2f}", f"{stepping['env_over_engine']:.2f} of the engine",
                  hits(stepping["prefix_cache"]))
    b, state = fork["branches"], fork["fork_from"]
    for label, key, cache in ((f"fork of {b} from {state} frames: first step", "fork_step_s", "fork_step"),
                              (f"the {b} branches' next step (new frames only)", "continued_step_s", "continued_step"),
                              (f"{b} fresh rollouts from the state (no shared prefix)", "fresh_step_s", "fresh_step")):
        ratio = fork[key] / fork["continued_step_s"]
        table.add_row(label, f"{fork[key]:.3f}", f"{b / fork[key]:.2f}", f"{ratio:.2f} of new frames only",
                      hits(fork["prefix_cache"][cache]))
    out.print(table)
    if out_json:
        atomic_write_json(out_json, results, overwrite=overwrite)
        console.print(f"results -> {out_json}")
