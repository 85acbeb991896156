"""What a killed engine costs a Ray scenario run on GPUs (issue 29).

`terra bench --scenarios N --data-parallel E`'s scenarios (random contexts, presets, 25 frames)
run on E engine actors of a local Ray cluster, and engine 1's process is SIGKILLed once the run
is --kill-at of the way through its generated frames. Ray restarts the actor; the driver hands
the scenarios that were open on it to whichever engine frees up first. Reported (stdout and
--out): wall and generating seconds, when the kill came, how long the engine was away, the
frames that were generated on it and lost, the scenarios handed out again, each engine's share,
and whether every scenario was written exactly once (one done line in results.jsonl, one .npy,
no other line). With --baseline (the undisturbed `terra bench --scenarios ... --data-parallel E
--out` JSON of the same machine), the time the kill added, beside what redoing the lost frames
at one engine's rate and the restart would cost.

    python benchmarks/scripts/gpu_ray_kill.py --scenarios 512 --engines 2 --max-rollouts 256 \\
        --kv-cache-dtype fp8 --baseline /tmp/dp2.json --out $OUT/kill.json
    # a CPU smoke test: --model DIR --backend hf --device cpu --frame-delay 0.05
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", type=int, default=512)
    ap.add_argument("--frames", type=int, default=25)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--max-rollouts", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the generated frames done at the kill")
    ap.add_argument("--model", default=None, help="default: Terra's config, random weights")
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--frame-delay", type=float, default=0.0, help="CPU smoke test: seconds per frame per engine")
    ap.add_argument("--baseline", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.frame_delay:
        os.environ["TERRA_TEST_FRAME_DELAY"] = ",".join(f"{i}={args.frame_delay}" for i in range(args.engines))

    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.bench.cache import random_terra_checkpoint
    from terra_cli.bench.scenarios import ScenarioBenchPlan, write_bench_scenarios
    from terra_cli.models.checkpoint import load_config
    from terra_cli.runtime import configure_vllm_env, resolve_device
    from terra_cli.scenarios.job import ScenarioJob, prepare_job
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.ray_cluster import ray_cluster
    from terra_cli.scenarios.ray_runner import drive
    from terra_cli.scenarios.runner import RESULTS_NAME, read_results
    from terra_cli.scenarios.spec import Defaults

    configure_vllm_env()
    device = resolve_device(args.device)
    model = Path(args.model) if args.model else random_terra_checkpoint(device, 0)
    plan = ScenarioBenchPlan(args.scenarios, args.frames)
    work = Path(tempfile.mkdtemp(prefix="terra-ray-kill-"))
    path = write_bench_scenarios(work, load_config(model).layout, plan)
    options = engine_options(kv_cache_dtype=args.kv_cache_dtype) if args.backend == "vllm" else {}
    job = ScenarioJob(path, work / "outputs", Defaults(seed=plan.seed), model=ModelSpec(str(model)),
                      engine=Engine(args.backend, args.device, options=options), max_rollouts=args.max_rollouts,
                      decode=False)
    prepared = prepare_job(job)
    total_frames = args.scenarios * (args.frames - plan.context_frames)
    pids: dict[int, int] = {}
    marks: dict[str, float] = {}
    at_kill: dict = {}
    victim = 1

    def on_event(kind, engine, payload):
        now = time.perf_counter()
        if kind == "ready":
            pids[engine.index] = payload["pid"]
        elif kind in ("lost", "rejoined", "dead"):
            marks.setdefault(f"{kind}_{engine.index}", now)
            if kind == "rejoined":
                at_kill["restart_startup_s"] = payload["startup_s"]
        elif kind == "tick":
            frames = payload.progress_frames
            if frames and "first_frame" not in marks:
                marks["first_frame"] = now
            if "kill" not in marks and frames >= args.kill_at * total_frames and victim in pids:
                engine = payload.engines[victim]
                marks["kill"] = now
                at_kill.update(progress_frames=frames, open_scenarios=len(engine.open),
                               victim_pending_frames=engine.pending_frames, seconds_after_first_frame=round(now - marks["first_frame"], 2))
                os.kill(pids[victim], signal.SIGKILL)

    started = time.perf_counter()
    with ray_cluster(prepared, None, args.engines) as engines_plan:
        run = drive(prepared, engines_plan, on_event)
    end = time.perf_counter()

    records = read_results(work / "outputs" / RESULTS_NAME)
    ids = [s.id for s in prepared.file.scenarios]
    done = collections.Counter(r["id"] for r in records if r.get("status") == "done")
    npy = sorted(p.stem for p in (work / "outputs").glob("*.npy"))
    killed = run.engines[victim]
    report = {
        "scenarios": args.scenarios, "frames": args.frames, "engines": args.engines,
        "generated_frames": run.generated_frames, "kill_at_fraction": args.kill_at,
        "seconds_wall": round(end - started, 2),
        "seconds_generating": round(end - marks["first_frame"], 2) if "first_frame" in marks else None,
        "kill": at_kill,
        "detected_after_s": round(marks[f"lost_{victim}"] - marks["kill"], 2) if f"lost_{victim}" in marks else None,
        "engine_away_s": round(marks[f"rejoined_{victim}"] - marks["kill"], 2) if f"rejoined_{victim}" in marks else None,
        "frames_lost": killed.lost_frames,
        "scenarios_handed_out_again": run.requeued,
        "summary": run.summary(),
        "exactly_once": {
            "done_lines": sum(done.values()), "distinct_done": len(done),
            "every_scenario_once": sorted(done) == sorted(ids) and set(done.values()) == {1},
            "other_lines": [r for r in records if r.get("status") != "done"][:5],
            "npy_files": len(npy), "npy_match_ids": npy == sorted(ids),
            "errors": run.errors[:5],
        },
    }
    if args.baseline and args.baseline.is_file():
        base = json.loads(args.baseline.read_text())["stream"]
        rate = base["generated_frames_per_s"] / args.engines  # one engine's share of the undisturbed rate
        report["baseline"] = {"seconds_generating": base["seconds_generating"], "seconds_wall": base["seconds_wall"],
                              "generated_frames_per_s": base["generated_frames_per_s"]}
        report["extra_generating_s"] = round(report["seconds_generating"] - base["seconds_generating"], 2)
        report["redo_lost_frames_at_one_engine_s"] = round(killed.lost_frames / rate, 2)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
