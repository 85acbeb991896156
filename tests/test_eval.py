"""`terra eval`: metric functions on synthetic inputs, and the command end to end (quality is measured, not asserted)."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from terra_cli.evaluation.metrics import (
    clean,
    commanded_lateral,
    copy_baseline,
    finite_mean,
    lateral_from_last_context,
    per_frame_psnr,
    sign_accuracy,
)
from terra_cli.evaluation.run import EVAL_WORLD_SEED_BASE, EvalError, EvalPlan, parse_presets, training_world_seeds
from tokenizer_decoder import psnr

from terra_cli.models.default import default_tokenizer_dir
from conftest import invoke_terra


def test_sign_accuracy():
    assert sign_accuracy([0.3, 0.1, -0.2, 0.5], 1.0) == 0.75
    assert sign_accuracy([0.3, 0.1, -0.2, 0.5], -1.0) == 0.25
    assert sign_accuracy([0.0, -1.0], -1.0) == 0.5  # zero counts as wrong
    assert math.isnan(sign_accuracy([], 1.0))


def test_copy_baseline_is_psnr_of_last_context_vs_truth():
    rng = np.random.default_rng(0)
    last = rng.integers(0, 256, size=(16, 24, 3), dtype=np.uint8)
    truth = rng.integers(0, 256, size=(3, 16, 24, 3), dtype=np.uint8)
    copy = copy_baseline(last, truth)
    assert copy.shape == truth.shape
    got = per_frame_psnr(copy, truth)
    np.testing.assert_allclose(got, [psnr(last, t) for t in truth])
    assert per_frame_psnr(truth, truth).tolist() == [math.inf] * 3


def test_finite_mean_and_clean():
    assert finite_mean([1.0, math.inf, 3.0, math.nan]) == 2.0
    assert math.isnan(finite_mean([math.inf]))
    assert clean({"a": np.float32(1.5), "b": [math.inf, np.int64(2)], "c": np.array([0.25, math.nan])}) == {
        "a": 1.5, "b": [None, 2], "c": [0.25, None]}


def test_commanded_lateral_signs():
    from terra_cli.actions import preset_actions

    assert commanded_lateral(preset_actions("left", 8, 30.0), 3, 8) > 0.01
    assert commanded_lateral(preset_actions("right", 8, 30.0), 3, 8) < -0.01
    assert abs(commanded_lateral(preset_actions("straight", 8, 30.0), 3, 8)) < 1e-6


def test_lateral_estimate_on_true_frames_follows_the_turn():
    from terra_cli.actions import preset_actions
    from terra_cli.synthetic.dataset import render_rollout

    for name, sign in (("left", 1), ("right", -1)):
        frames = render_rollout(EVAL_WORLD_SEED_BASE, preset_actions(name, 6, 30.0))
        assert np.sign(lateral_from_last_context(frames[2], frames[3:])) == sign


def test_eval_worlds_are_held_out_from_training():
    plan = EvalPlan(seeds=20)
    eval_seeds = set(plan.world_seeds())
    assert eval_seeds == set(range(1000, 1020))
    for data_seed in (0, 1):  # tokenizer, world model (scripts/train_*.py --data-seed defaults)
        assert not eval_seeds & training_world_seeds(data_seed, 5000)


@pytest.mark.parametrize("kwargs, message", [
    ({"presets": ["sideways"]}, "unknown preset"),
    ({"presets": []}, "at least one preset"),
    ({"seeds": 0}, "--seeds"),
    ({"frames": 3, "context_frames": 3}, "more than --context-frames"),
])
def test_plan_validation(kwargs, message):
    with pytest.raises(EvalError, match=message):
        EvalPlan(**kwargs).validate()
    assert parse_presets(" Left,right ,") == ["left", "right"]


@pytest.mark.slow
def test_eval_command_end_to_end(tmp_path):
    """The brief's smoke run, on a tiny random world model in terra-mini's token format (the real one
    needs ~80 ms per token step on a 2-core CPU: 5 min for this run); the embedded tokenizer is real."""
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "wm", tiny_config(image_vocab=1024, layers=1))
    out = tmp_path / "eval.json"
    plot = tmp_path / "eval.png"
    strip = tmp_path / "strip.png"
    args = ["eval", "--model", model, "--tokenizer", default_tokenizer_dir(), "--seeds", 2, "--frames", 4, "--context-frames", 3,
            "--presets", "left,right", "--backend", "hf", "--device", "cpu", "--ceiling-seeds", 1,
            "--out", out, "--plot", plot, "--strip", strip]
    result = invoke_terra(*args)
    assert result.returncode == 0, result.stderr + result.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"config", "presets", "summary", "seconds", "environment"}
    assert data["config"]["temperature"] == 0 and data["config"]["sampling"] == "greedy"
    assert (data["config"]["top_k"], data["config"]["top_p"], data["config"]["sampling_seed"]) == (0, 1.0, 0)
    assert data["config"]["world_seeds"] == [1000, 1001]
    s = data["summary"]
    for key in ("psnr_generated_frames_1_5", "psnr_copy_baseline_frames_1_5", "ssim_generated_frames_1_5",
                "psnr_tokenizer_ceiling_frames_1_5", "sign_accuracy_left", "sign_accuracy_right"):
        assert isinstance(s[key], float) and math.isfinite(s[key]), key
    assert set(data["presets"]) == {"left", "right"}
    for res in data["presets"].values():
        assert res["per_frame"]["frame_index"] == [1]
        assert len(res["per_seed"]) == 2
        assert all(math.isfinite(v) for v in res["per_seed"][0]["psnr_generated"])
        assert res["per_seed"][1]["psnr_tokenizer_ceiling"] == [None]  # ceiling on the first seed only
    for png in (plot, strip):
        with Image.open(png) as im:
            im.load()
            assert im.size[0] > 100 and im.size[1] > 100

    again = invoke_terra(*args)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


def test_eval_bad_preset_is_one_line_error(tmp_path):
    result = invoke_terra("eval", "--presets", "left,sideways", "--out", tmp_path / "e.json")
    assert result.returncode == 2
    assert "unknown preset 'sideways'" in result.stderr and "Traceback" not in result.stderr


def test_eval_without_tokenizer_ceiling(tmp_path):
    """--ceiling-seeds 0 skips the ceiling (it used to crash reshaping an empty token array)."""
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "wm", tiny_config(image_vocab=1024, layers=1))
    out, plot = tmp_path / "eval.json", tmp_path / "eval.png"
    result = invoke_terra("eval", "--model", model, "--tokenizer", default_tokenizer_dir(), "--seeds", 1, "--frames", 4, "--presets", "straight",
                       "--backend", "hf", "--device", "cpu", "--ceiling-seeds", 0, "--out", out, "--plot", plot)
    assert result.returncode == 0, result.stderr + result.stdout
    data = json.loads(out.read_text())
    assert data["summary"]["psnr_tokenizer_ceiling_frames_1_5"] is None
    assert math.isfinite(data["summary"]["psnr_generated_frames_1_5"])
    assert data["presets"]["straight"]["per_seed"][0]["psnr_tokenizer_ceiling"] == [None]
    with Image.open(plot) as im:
        assert im.size[0] > 100


def test_eval_frames_and_seeds_are_capped_before_anything_is_rendered():
    for kwargs, message in (({"frames": 1000}, "above the maximum of 100"),
                            ({"frames": 20, "seeds": 1000}, "frames per preset")):
        with pytest.raises(EvalError, match=message):
            EvalPlan(**kwargs).validate()
    plan = EvalPlan(frames=26, seeds=1)
    plan.validate()
    with pytest.raises(EvalError, match="25 frames per round"):
        plan.check_model(25)
