"""The synthetic driving world (renderer, ego motion, random actions, metrics) and the terra-mini
training scripts' --smoke runs."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from terra_cli.actions import WAYPOINT_TIMES, preset_actions, summarize_actions
from terra_cli.synthetic import dataset, metrics
from terra_cli.synthetic import world as world_module
from tokenizer_decoder import psnr

REPO = Path(__file__).resolve().parents[1]


def _two_frames(seed, name, gap=5, speed=30.0):
    """Frames 0 and `gap` of a preset rollout, rendering only those two."""
    actions = preset_actions(name, gap + 1, speed)
    world = world_module.make_world(seed)
    poses = dataset.rollout_poses(actions, world.start_pose())
    return world.render(poses[0]), world.render(poses[gap])


# -- renderer ---------------------------------------------------------------------------------
def test_render_shape_dtype_and_determinism():
    actions = preset_actions("left", 3, 40)
    a = dataset.render_rollout(7, actions)
    world_module.make_world.cache_clear()  # a freshly built world renders the same pixels
    b = dataset.render_rollout(7, actions)
    assert a.shape == (3, 288, 512, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a[0], a[2])  # the ego moved
    other = dataset.render_rollout(8, actions)
    assert not np.array_equal(a, other)  # another world
    # sky on top, darker ground/road at the bottom centre
    assert a[0, :20].mean() > a[0, -20:, 200:312].mean()


def test_render_speed_is_sane():
    world = world_module.make_world(3)
    world.render((0.0, 0.0, 0.0))
    t0 = time.perf_counter()
    for i in range(5):
        world.render((2.0 * i, 0.0, 0.01 * i))
    assert (time.perf_counter() - t0) / 5 < 1.0


def test_rollout_poses_follow_the_actions():
    straight = dataset.rollout_poses(preset_actions("straight", 11, 36.0))
    assert straight.shape == (11, 3)
    np.testing.assert_allclose(straight[10], [10.0, 0.0, 0.0], atol=1e-6)  # 10 m/s for 1 s
    left = dataset.rollout_poses(preset_actions("left", 11, 30.0))
    right = dataset.rollout_poses(preset_actions("right", 11, 30.0))
    assert left[10, 1] > 0.5 and left[10, 2] > 0.2  # moved and turned left
    np.testing.assert_allclose(right[:, 1:], -left[:, 1:], atol=1e-9)  # mirror images
    np.testing.assert_allclose(left[10, 2], math.radians(15.0), rtol=0.05)  # 15 deg/s for 1 s
    start = (5.0, -2.0, 0.5)
    moved = dataset.rollout_poses(preset_actions("straight", 3, 36.0), start)
    np.testing.assert_allclose(moved[2], [5 + 2 * math.cos(0.5), -2 + 2 * math.sin(0.5), 0.5], atol=1e-6)


def test_left_and_right_shift_the_lane_markings_oppositely():
    agree = 0
    straight = []
    for seed in range(20):
        l = metrics.estimate_lateral_shift(*_two_frames(seed, "left"))
        r = metrics.estimate_lateral_shift(*_two_frames(seed, "right"))
        straight.append(metrics.estimate_lateral_shift(*_two_frames(seed, "straight")))
        agree += l > 0.2 and r < -0.2
    assert agree >= 19
    assert max(abs(s) for s in straight) < 0.05


def test_lateral_motion_accumulates_and_lane_offset_sees_the_ego_offset():
    frames = dataset.render_rollout(2, preset_actions("right", 8, 30))
    motion = metrics.estimate_lateral_motion(frames)
    assert motion.shape == (8,) and motion[0] == 0
    assert np.all(np.diff(motion) < 0)  # turning right: the ego moves right every frame
    a = preset_actions("straight", 1, 30)
    centred = [metrics.lane_offset(dataset.render_rollout(s, a)[0]) for s in range(5)]
    shifted = [metrics.lane_offset(dataset.render_rollout(s, a, lateral=0.5)[0]) for s in range(5)]
    diff = np.nanmedian(np.array(shifted) - np.array(centred))
    assert -0.6 < diff < -0.4  # ego 0.5 m left of where it was: the lane centre is 0.5 m further right


def test_metrics_psnr_and_ssim():
    a, b = _two_frames(4, "straight", gap=3)
    assert psnr(a, a) == float("inf")
    assert 5 < psnr(a, b) < 60
    assert metrics.ssim(a, a) == pytest.approx(1.0)
    assert 0 < metrics.ssim(a, b) < 0.999
    with pytest.raises(ValueError):
        psnr(a, b[:10])


# -- training data ----------------------------------------------------------------------------
def test_random_actions_are_plausible_and_seeded():
    rng = np.random.default_rng(0)
    for _ in range(40):
        acts = dataset.random_actions(rng, 12)
        assert acts.shape == (12, 6, 3) and acts.dtype == np.float32 and np.isfinite(acts).all()
        np.testing.assert_allclose(acts[:, :, 2], np.broadcast_to(WAYPOINT_TIMES, (12, 6)), atol=1e-6)
        speed = acts[:, 0, 1] / 0.45  # roughly the speed, m/s
        assert speed.max() < 80 / 3.6 and speed.min() > -0.1
        assert np.abs(acts[:, :, 0]).max() < 40  # lateral look-ahead within a plausible range
        summarize_actions(acts)
    a = dataset.random_actions(np.random.default_rng(5), 10)
    b = dataset.random_actions(np.random.default_rng(5), 10)
    np.testing.assert_array_equal(a, b)


def test_dataset_rollouts_are_seeded_and_independent():
    spec_a, acts_a = dataset.rollout_spec(3, 7, 10)
    spec_b, acts_b = dataset.rollout_spec(3, 7, 10)
    assert spec_a == spec_b and np.array_equal(acts_a, acts_b)
    assert dataset.rollout_spec(3, 8, 10)[0] != spec_a
    (frames, actions), = list(dataset.dataset_rollouts(3, 1, 2, start=7))
    assert frames.shape == (2, 288, 512, 3) and actions.shape == (2, 6, 3)
    np.testing.assert_array_equal(actions, dataset.rollout_spec(3, 7, 2)[1])


# -- training scripts: --smoke end to end -----------------------------------------------------
def _run_script(name, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def smoke_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok_smoke")
    _run_script("train_tokenizer.py", "--smoke", "--out", out)
    return out


def test_train_tokenizer_smoke_writes_a_loadable_tokenizer(smoke_tokenizer):
    from tokenizer_decoder import ImageTokenizer

    tok = ImageTokenizer.from_pretrained(smoke_tokenizer / "tokenizer", device="cpu")
    assert tok.codebook_size == 1024 and tok.tokens_per_frame == 576
    frame = dataset.render_rollout(0, preset_actions("straight", 1, 30))[0]
    tokens = tok.tokenize([frame])
    assert tokens.shape == (1, 576) and 0 <= tokens.min() and tokens.max() < 1024
    assert (smoke_tokenizer / "ckpt" / "state.pt").is_file()
    log = (smoke_tokenizer / "log.csv").read_text().splitlines()
    assert log[0].startswith("step,") and len(log) == 3  # header + 2 steps


@pytest.mark.slow
@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["trained-tokenizer", "random-tokenizer"])
def test_train_world_model_smoke_writes_a_loadable_checkpoint(tmp_path, smoke_tokenizer, with_tokenizer):
    import torch

    from terra_cli.models.modeling_hf import load_model

    out = tmp_path / "wm"
    extra = ["--tokenizer", smoke_tokenizer / "tokenizer"] if with_tokenizer else []
    _run_script("train_world_model.py", "--smoke", "--out", out, *extra)
    model = load_model(out / "world_model")  # strict
    layout = model.config.layout
    assert layout.image_tokens == 576 and layout.action_tokens == 6 and model.config.vocab_size == 1025
    tokens = np.load(out / "data" / "tokens.npy")
    assert tokens.shape[1:] == (3, 576) and tokens.max() < 1024
    ids = torch.full((1, 582), layout.action_placeholder_id)
    ids[0, :576] = torch.from_numpy(tokens[0, 0].astype(np.int64))
    logits, _ = model(ids, torch.arange(582)[None], torch.zeros(1, 6, 3))
    assert logits.shape == (1, 582, 1025) and torch.isfinite(logits).all()
    if with_tokenizer:  # resumable: continues at step 2, reusing the tokenized data
        proc = _run_script("train_world_model.py", "--smoke", "--out", out, "--resume", "--steps", "3", *extra)
        assert "resumed" in proc.stdout and "reusing" in proc.stdout
        assert (out / "log.csv").read_text().splitlines()[-1].startswith("3,")
