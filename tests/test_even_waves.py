"""`--max-rollouts even`: a run's rollouts in equal waves on each engine, no small last wave alone
(benchmarks/README.md, the whole run on four H200s: its last wave of ~60 an engine cost ~70 s)."""

import pytest

from terra_cli.errors import InputError
from terra_cli.scenarios.job import (AUTO_MAX_ROLLOUTS, EVEN_WAVES_LIMIT, ScenarioJob, even_waves,
                                     parse_max_rollouts, rollouts_to_load, wants_even_waves)


def test_even_waves_are_the_fewest_waves_and_as_full_as_each_other():
    for capacity in (1, 2, 7, 64, 256, 511):
        for rollouts in range(1, 1200, 7):
            in_flight = even_waves(rollouts, capacity)
            waves = -(-rollouts // in_flight)
            assert in_flight <= capacity
            assert waves == -(-rollouts // capacity)  # no more waves than filling each to capacity
            last = rollouts - (waves - 1) * in_flight
            assert 1 <= last <= in_flight and in_flight - last < waves  # the last wave nearly as full as the rest
    # ACT-Bench's 2,286 samples on four engines whose KV cache holds 511 rollouts (H200, fp8):
    # each engine's 572 in two waves of 286, where filling gives 511 and 61 (or 256, 256 and 60)
    assert even_waves(572, 511) == 286
    with pytest.raises(ValueError):
        even_waves(0, 5)


def test_what_an_engine_is_started_for():
    job = ScenarioJob("s.jsonl", "out")
    assert rollouts_to_load(job, 572) == AUTO_MAX_ROLLOUTS  # auto: the cap, whatever the run's size
    assert rollouts_to_load(ScenarioJob("s.jsonl", "out", max_rollouts=9), 572) == 9
    even = ScenarioJob("s.jsonl", "out", even_waves=True)
    assert rollouts_to_load(even, 572) == 286 and rollouts_to_load(even, 40) == 40
    assert rollouts_to_load(even, 2286) == even_waves(2286, EVEN_WAVES_LIMIT) == 458
    assert rollouts_to_load(even, None) == AUTO_MAX_ROLLOUTS  # share unknown: as auto


def test_the_option_parses_and_an_impossible_pair_is_refused(tmp_path):
    from terra_cli.scenarios.job import prepare_job

    assert (parse_max_rollouts("even"), wants_even_waves("Even")) == (None, True)
    assert (parse_max_rollouts("auto"), wants_even_waves("auto")) == (None, False)
    assert (parse_max_rollouts("12"), wants_even_waves("12")) == (12, False)
    with pytest.raises(InputError, match="auto, even or a whole number"):
        parse_max_rollouts("evenly")
    with pytest.raises(InputError, match="either even or a count"):
        prepare_job(ScenarioJob(tmp_path / "s.jsonl", tmp_path / "out", max_rollouts=4, even_waves=True))


def test_a_ray_run_sizes_each_engine_by_its_share(tmp_path):
    """The driver hands each engine about pending/engines scenarios: each engine is started for
    equal waves of that share, and the driver's window follows what the engine was started for."""
    import json

    from terra_cli.pipeline.world_model import Engine
    from terra_cli.scenarios.job import prepare_job
    from terra_cli.scenarios.ray_cluster import EnginePlan
    from terra_cli.scenarios.ray_hand_out import window_for
    from terra_cli.scenarios.ray_runner import RayDriver
    from terra_cli.scenarios.spec import Defaults

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "actions": "left", "frames": 4, "seed": i}) + "\n"
                            for i in range(11)))
    for even, share_load in ((True, 3), (False, AUTO_MAX_ROLLOUTS)):
        job = ScenarioJob(path, tmp_path / f"out-{even}", Defaults(), even_waves=even, decode=False,
                          engine=Engine(backend="hf", device="cpu"))
        driver = RayDriver(prepare_job(job), EnginePlan(4, "cpu", {"num_cpus": 1}))
        try:
            assert driver.share == 3  # 11 scenarios on 4 engines
            assert driver.loaded_for == share_load and driver.window == window_for(share_load)
        finally:
            driver.reader.close()


def test_generate_scenarios_takes_even_and_says_how_it_split(tmp_path):
    """`terra generate --scenarios --max-rollouts even`: the engine line says this engine's share and
    its waves (the reference backend runs one rollout at a time here, so 3 waves of 1), and every
    scenario is written."""
    import json

    import numpy as np
    from typer.testing import CliRunner

    from terra_cli.cli import app
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16, layers=1))
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, 16)))
    (tmp_path / "s.jsonl").write_text("".join(
        json.dumps({"id": f"s{i}", "context": "ctx.npy", "actions": "left", "frames": 3, "seed": i}) + "\n"
        for i in range(3)))
    result = CliRunner().invoke(app, ["generate", "--scenarios", str(tmp_path / "s.jsonl"), "--out-dir",
                                      str(tmp_path / "out"), "--model", str(model), "--backend", "hf", "--device",
                                      "cpu", "--no-decode", "--max-rollouts", "even"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "each engine's scenarios in equal waves" in said
    assert "--max-rollouts even: this engine's 3 rollout(s) in 3 wave(s) of at most 1" in said
    assert sorted(p.name for p in (tmp_path / "out").glob("*.npy")) == ["s0.npy", "s1.npy", "s2.npy"]
