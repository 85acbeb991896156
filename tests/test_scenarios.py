"""Scenario batches (terra_cli/scenarios): validation of every line before any model loads,
--skip-invalid, resume, Ctrl-C keeping finished scenarios, and batch == single outputs."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.backends.hf import HfBackend
from terra_cli.cli import app
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.scenarios.runner import RESULTS_NAME, completed_ids, run_scenarios
from terra_cli.scenarios.spec import Defaults, read_scenarios

TOKENS = 16  # a small frame: these tests are about bookkeeping, not the 576-token layout


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("scen_model"), tiny_config(image_tokens=TOKENS))
    return HfBackend(checkpoint, device="cpu", dtype="float32")


def scenario_file(folder, lines):
    rng = np.random.default_rng(0)
    np.save(folder / "ctx.npy", rng.integers(0, 512, size=(2, TOKENS)))
    path = folder / "s.jsonl"
    path.write_text("\n".join(json.dumps(line) if isinstance(line, dict) else line for line in lines) + "\n")
    return path


GOOD = [{"id": "a", "context": "ctx.npy", "actions": "left", "frames": 4},
        {"id": "b", "context": "ctx.npy", "actions": "right", "frames": 5, "seed": 7},
        {"id": "c", "context": "ctx.npy", "actions": [[[0.0, 1.0, 0.45]] * 6] * 3, "frames": 3}]


def test_every_bad_line_is_listed_before_any_model_loads(tmp_path):
    path = scenario_file(tmp_path, [GOOD[0], {"id": "x", "actions": "sideways"}, GOOD[0], "not json",
                                    {"id": "y", "context": "missing.png", "actions": "left"},
                                    {"id": "z", "context": "ctx.npy", "actions": [[[float("nan")] * 3] * 6] * 30}])
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "--scenarios", str(path), "--out-dir", str(out),
                                      "--model", str(tmp_path / "no-such-model")])
    assert result.exit_code == 2, result.output
    for line in (2, 3, 4, 5, 6):
        assert f"line {line}:" in result.output
    assert "duplicate id 'a'" in result.output and "Traceback" not in result.output
    assert not out.exists()  # nothing written, and the (missing) model was never looked at


def test_skip_invalid_records_skipped_lines_and_resume_skips_finished(tmp_path, backend):
    path = scenario_file(tmp_path, [*GOOD, {"id": "x", "actions": "sideways"}])
    file = read_scenarios(path, Defaults())
    out = tmp_path / "out"
    with pytest.raises(Exception, match="line 4"):
        run_scenarios(file, out, backend, None, max_rollouts=1)
    run = run_scenarios(file, out, backend, None, max_rollouts=1, skip_invalid=True)
    assert (run.done, run.skipped, run.resumed) == (3, 1, 0)
    records = [json.loads(line) for line in (out / RESULTS_NAME).read_text().splitlines()]
    assert {r["status"] for r in records} == {"done", "skipped"}
    assert completed_ids(out) == {"a", "b", "c"}
    assert np.load(out / "b.npy").shape == (5, TOKENS)
    again = run_scenarios(file, out, backend, None, max_rollouts=1, skip_invalid=True)
    assert (again.done, again.resumed) == (0, 3)
    (out / "a.npy").unlink()  # a lost file: that scenario runs again
    third = run_scenarios(file, out, backend, None, max_rollouts=1, skip_invalid=True)
    assert (third.done, third.resumed) == (1, 2)


def test_interrupt_keeps_finished_scenarios_and_a_scenario_is_the_same_alone(tmp_path, backend):
    path = scenario_file(tmp_path, GOOD)
    file = read_scenarios(path, Defaults())
    out = tmp_path / "out"
    frames_seen = []

    def stop_after_first_scenario(run, total):
        frames_seen.append(1)
        if len(frames_seen) == 3:  # "a" has 2 generated frames; stop inside "b"
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_scenarios(file, out, backend, None, max_rollouts=1, on_progress=stop_after_first_scenario)
    assert completed_ids(out) == {"a"}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no partial files
    run_scenarios(file, out, backend, None, max_rollouts=1)
    assert completed_ids(out) == {"a", "b", "c"}
    alone_dir = tmp_path / "alone"
    alone = read_scenarios(scenario_file(tmp_path, [GOOD[1]]), Defaults())
    run_scenarios(alone, alone_dir, backend, None, max_rollouts=1)
    np.testing.assert_array_equal(np.load(alone_dir / "b.npy"), np.load(out / "b.npy"))


def test_rollouts_expand_into_seeded_samples(tmp_path):
    file = read_scenarios(scenario_file(tmp_path, [GOOD[1]]), Defaults(), rollouts=3)
    assert [(s.id, s.seed) for s in file.scenarios] == [("b_s0", 7), ("b_s1", 8), ("b_s2", 9)]
