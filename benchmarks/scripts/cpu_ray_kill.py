"""What a killed engine costs a Ray scenario run, on the CPU (issue 26).

Two engines (reference backend, a tiny model, TERRA_TEST_FRAME_DELAY making each frame take
a known time) run the same scenarios twice on one local Ray cluster: once undisturbed, once with
engine 1's process SIGKILLed after its 4th written scenario. Printed (and written as JSON to
argv[1], if given): wall time of both runs, the frames redone (generated frames of the scenarios
open on the killed engine), scenarios handed out again, how long the engine was away, and whether
every scenario's tokens equal the undisturbed run's.

    PYTHONPATH=. python benchmarks/scripts/cpu_ray_kill.py [out.json]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FRAME_SECONDS = 0.1
SCENARIOS, FRAMES, CONTEXT = 24, 12, 2


def main() -> None:
    os.environ["TERRA_TEST_FRAME_DELAY"] = f"0={FRAME_SECONDS},1={FRAME_SECONDS}"
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.scenarios.job import ScenarioJob, prepare_job
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.ray_cluster import ray_cluster
    from terra_cli.scenarios.ray_runner import drive
    from terra_cli.scenarios.spec import Defaults

    folder = Path(tempfile.mkdtemp(prefix="terra-ray-kill-"))
    np.save(folder / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(CONTEXT, 16)))
    lines = [{"id": f"v{i}", "context": "ctx.npy", "actions": "left", "frames": FRAMES, "seed": i}
             for i in range(SCENARIOS)]
    (folder / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    model = write_tiny_checkpoint(folder / "model", tiny_config(image_tokens=16, layers=1))

    def prepared(out):
        return prepare_job(ScenarioJob(folder / "s.jsonl", folder / out, Defaults(), model=ModelSpec(str(model)),
                                       engine=Engine("hf", "cpu"), decode=False))

    report: dict = {"frame_seconds": FRAME_SECONDS, "scenarios": SCENARIOS,
                    "generated_frames_per_scenario": FRAMES - CONTEXT, "engines": 2}
    with ray_cluster(prepared("calm"), None, 2) as plan:
        started = time.perf_counter()
        calm = drive(prepared("calm"), plan)
        report["undisturbed_s"] = round(time.perf_counter() - started, 2)
        report["undisturbed_engine_start_s"] = round(report["undisturbed_s"] - calm.seconds, 2)
        pids, marks, written = {}, {}, {0: 0, 1: 0}

        def on_event(kind, engine, payload):
            now = time.perf_counter()
            if kind == "ready":
                pids[engine.index] = payload["pid"]
                marks.setdefault(f"ready_{engine.index}", now)
            elif kind == "written":
                written[engine.index] += 1
                if engine.index == 1 and written[1] == 4 and "kill" not in marks:
                    marks["kill"] = now
                    os.kill(pids[1], signal.SIGKILL)
            elif kind in ("lost", "rejoined"):
                marks[kind] = now

        started = time.perf_counter()
        killed = drive(prepared("killed"), plan, on_event)
        report["killed_s"] = round(time.perf_counter() - started, 2)
    engine = killed.engines[1]
    report.update({
        "extra_s": round(report["killed_s"] - report["undisturbed_s"], 2),
        "frames_redone": engine.lost_frames,
        "redone_s_on_one_engine": round(engine.lost_frames * FRAME_SECONDS, 2),
        "scenarios_handed_out_again": killed.requeued,
        "engine_away_s": round(marks["rejoined"] - marks["kill"], 2) if "rejoined" in marks else None,
        "detected_after_s": round(marks["lost"] - marks["kill"], 2),
        "shares_undisturbed": [row["scenarios"] for row in calm.summary()],
        "shares_killed": [row["scenarios"] for row in killed.summary()],
        "all_done_once": calm.done == killed.done == SCENARIOS,
        "tokens_equal": all(np.array_equal(np.load(folder / "calm" / f"v{i}.npy"),
                                           np.load(folder / "killed" / f"v{i}.npy")) for i in range(SCENARIOS)),
    })
    print(json.dumps(report, indent=2))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
