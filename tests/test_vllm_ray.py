"""A vLLM engine in a Ray actor (scenarios/ray_actor.py: StreamDriver over a JobFeed that the
driver's calls fill): the same tokens as the continuous-batching runner on the engine in this
process, every scenario written once by the driver."""

import json

import numpy as np
import pytest

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from conftest import ENGINE_IMAGE_TOKENS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_vllm_engine_actor_writes_what_the_engine_in_this_process_writes(tmp_path, engine_checkpoint, vllm_engine):
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.scenarios.job import ScenarioJob, prepare_job
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.ray_runner import run_on_ray
    from terra_cli.scenarios.runner import RESULTS_NAME, read_results, run_scenarios
    from terra_cli.scenarios.spec import Defaults, read_scenarios

    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, ENGINE_IMAGE_TOKENS)))
    lines = [{"id": f"v{i}", "context": "ctx.npy", "actions": ["left", "right"][i % 2], "frames": 7 - i % 3,
              "seed": i} for i in range(6)]  # 7 frames: two rounds on this 5-frame model
    (tmp_path / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    run_scenarios(read_scenarios(tmp_path / "s.jsonl"), tmp_path / "here", vllm_engine, None, max_rollouts=4,
                  decode=False)
    job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "actor", Defaults(), model=ModelSpec(str(engine_checkpoint)),
                      engine=Engine("vllm", "cpu", "float32", options=engine_options(torch_compile=False)),
                      max_rollouts=8, decode=False)  # eager (~12 s to start, not ~40 s); this process's is compiled
    result = run_on_ray(prepare_job(job), None, 1, probe_wakes=True)  # a local cluster of this machine, one engine
    assert result.done == 6 and not result.errors
    # The actor's engine loop times come back with the run's summary, taken as it ended.
    loop = result.summary()[0]["engine_loop"]
    assert loop["steps"] > 0 and 0 < loop["in_engine_step_s"] <= loop["seconds"]
    assert loop["wakes"] > 0 and loop["wake_late_s"] >= 0  # the actor's WakeProbe rides along
    records = read_results(tmp_path / "actor" / RESULTS_NAME)
    assert sorted(r["id"] for r in records if r["status"] == "done") == [f"v{i}" for i in range(6)]
    assert {(r["engine"], bool(r["node"])) for r in records} == {(0, True)}
    for line in lines:
        np.testing.assert_array_equal(np.load(tmp_path / "actor" / f"{line['id']}.npy"),
                                      np.load(tmp_path / "here" / f"{line['id']}.npy"))
