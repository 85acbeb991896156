"""`terra bench --scenarios N`: the run (terra_cli/bench/scenarios.py), its table and JSON; `engine_shares`, the
engines column it shares with `--act-bench`."""

from __future__ import annotations

import shlex
import sys

from rich.table import Table

from terra_cli.cli.app import console, out


def scenario_bench(model, plan, keep_outputs, out_json, overwrite) -> None:
    from terra_cli.bench.cache import check_engine_run, random_terra_checkpoint
    from terra_cli.bench.hf_vs_vllm import environment
    from terra_cli.bench.scenarios import run_scenario_bench
    from terra_cli.cli.progress import LazyFrameBar
    from terra_cli.media.atomic import atomic_write_json
    from terra_cli.models.resolve import resolve_world_model_dir
    from terra_cli.runtime import resolve_device

    check_engine_run(model, plan.backend, plan.vllm_options, plan.device, plan.frames, plan.context_frames)
    device = resolve_device(plan.device)
    log = lambda msg: console.print(f"[dim]{msg}[/]", highlight=False)  # noqa: E731
    checkpoint = resolve_world_model_dir(model) if model else random_terra_checkpoint(device, plan.seed, log)
    bar = LazyFrameBar(console, "scenarios")
    try:
        results = run_scenario_bench(checkpoint, plan, keep_outputs, log, bar)
    finally:
        bar.close()
    results["model"] = str(model or checkpoint)
    results["command"] = "terra " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results["environment"] = environment()
    stream = results["stream"]
    table = Table(title=f"terra bench --scenarios: {results['model']}")
    for col in ("run", "engines", "start-up s", "generated frames/s", "GPU busy", "ACT-Bench h (projected)"):
        table.add_column(col, justify="left" if col == "run" else "right")
    busy = ", ".join("-" if b is None else f"{b:.0%}" for b in stream["gpu_busy"].values()) or "-"
    table.add_row(f"continuous, {plan.scenarios} x {plan.frames} frames", engine_shares(results["engines"]),
                  ", ".join("not ready" if e["startup_s"] is None else f"{e['startup_s']:.1f}" for e in results["engines"]),
                  f"{stream['generated_frames_per_s']:.2f}", busy, f"{stream['projected_act_bench_hours']:.2f}")
    if "lockstep" in results:
        lock = results["lockstep"]
        table.add_row(f"lockstep x{lock['rollouts']}", "1", "-", f"{lock['generated_frames_per_s']:.2f}",
                      "-" if lock["gpu_busy"] is None else f"{lock['gpu_busy']:.0%}", "-")
    out.print(table)
    if out_json:
        atomic_write_json(out_json, results, overwrite=overwrite)
        console.print(f"results -> {out_json}")


def engine_shares(engines: list[dict]) -> str:
    """How many engines, and on Ray each one's share of the scenarios and its restarts."""
    shares = [f"{e['share']:.0f}%" + (f" ({e['restarts']} restart)" if e.get("restarts") else "")
              for e in engines if e.get("share") is not None]
    return f"{len(engines)}" + (f": {', '.join(shares)}" if shares else "")
