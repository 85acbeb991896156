"""Actions: every input format gives the same (F, 6, 3) array; presets; validation; the CLI."""

import json
import os
import time

import numpy as np
import pytest
from PIL import Image

from terra_cli import actions as A
from terra_cli.actions import ActionsError, resolve_actions
from terra_cli.errors import TerraError

from conftest import invoke_terra

TIMES = np.array([0.45, 0.95, 1.45, 1.95, 2.45, 2.95])


def known_actions(frames=7, seed=0):
    rng = np.random.default_rng(seed)
    acts = np.zeros((frames, 6, 3), dtype=np.float32)
    acts[:, :, 0] = rng.normal(scale=2.0, size=(frames, 6))
    acts[:, :, 1] = np.cumsum(rng.uniform(0.5, 5.0, size=(frames, 6)), axis=1)
    acts[:, :, 2] = TIMES
    return acts


def act_bench_trajs(acts, seed=1):
    """60 points [x, y, z] per frame, 0.05 s apart; the waypoints sit at [9::10], noise elsewhere."""
    rng = np.random.default_rng(seed)
    trajs = rng.normal(size=(acts.shape[0], 60, 3))
    trajs[:, 0] = 0.0
    trajs[:, 9::10, 0] = acts[:, :, 1]
    trajs[:, 9::10, 1] = acts[:, :, 0]
    return trajs.tolist()


def test_constants_match_terra():
    np.testing.assert_allclose(A.WAYPOINT_TIMES, TIMES)
    from terra_cli.cli import actions as cli_actions

    assert cli_actions.DEFAULT_SPEED_KMH == A.DEFAULT_SPEED_KMH


# ---------------------------------------------------------------------------------- formats


def test_npy_shapes_are_equivalent(tmp_path):
    acts = known_actions()
    np.save(tmp_path / "a.npy", acts)
    np.save(tmp_path / "flat.npy", acts.reshape(-1, 3).astype(np.float64))
    a = resolve_actions(str(tmp_path / "a.npy"), frames=None, speed_kmh=30)
    flat = resolve_actions(str(tmp_path / "flat.npy"), frames=None, speed_kmh=30)
    assert a.dtype == np.float32 and a.shape == (7, 6, 3)
    np.testing.assert_array_equal(a, acts)
    np.testing.assert_array_equal(flat, acts)
    # the old name still works
    np.testing.assert_array_equal(A.load_actions(tmp_path / "flat.npy"), acts)


def test_act_bench_json_and_jsonl_recover_the_array(tmp_path):
    acts = known_actions()
    trajs = act_bench_trajs(acts)
    sample = {"sample_id": 0, "label": "x", "context_frames": ["a.jpg"], "instruction_trajs": trajs}
    other = {"sample_id": 1, "label": "y", "context_frames": [], "instruction_trajs": act_bench_trajs(acts * 2)}

    (tmp_path / "one.json").write_text(json.dumps(sample, indent=2))
    (tmp_path / "many.jsonl").write_text(json.dumps(sample) + "\n" + json.dumps(other) + "\n")
    (tmp_path / "array.json").write_text(json.dumps([sample, other]))
    (tmp_path / "bare.json").write_text(json.dumps(trajs))
    (tmp_path / "jsonl_named.json").write_text(json.dumps(sample) + "\n" + json.dumps(other) + "\n")
    (tmp_path / "pretty.jsonl").write_text(json.dumps(sample, indent=2))
    (tmp_path / "noext").write_text("\n" + json.dumps(sample))
    for name in ["one.json", "many.jsonl", "array.json", "bare.json", "jsonl_named.json", "pretty.jsonl", "noext"]:
        got = resolve_actions(str(tmp_path / name), frames=None, speed_kmh=30)
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(got, acts, rtol=0, atol=1e-6, err_msg=name)

    # the generator's own recipe, straight from the list: points [9::10][:6] -> (y, x, t)
    ref = np.array([np.concatenate([np.array(t)[9::10][:6][:, [1, 0]], TIMES[:, None]], axis=1) for t in trajs])
    np.testing.assert_allclose(A.instruction_trajs_to_actions(trajs), ref, atol=1e-6)

    # frames trims a file to its first frames
    assert resolve_actions(str(tmp_path / "many.jsonl"), frames=3, speed_kmh=30).shape == (3, 6, 3)
    assert resolve_actions(str(tmp_path / "many.jsonl"), frames=99, speed_kmh=30).shape == (7, 6, 3)


def test_actions_to_instruction_trajs_round_trip():
    acts = known_actions(5)
    trajs = A.actions_to_instruction_trajs(acts)
    assert trajs.shape == (5, 60, 3)
    np.testing.assert_allclose(A.instruction_trajs_to_actions(trajs), acts, atol=1e-6)


@pytest.mark.parametrize("name", A.PRESETS)
def test_preset_round_trips_through_npy_and_act_bench(tmp_path, name):
    acts = resolve_actions(name, frames=12, speed_kmh=25)
    np.save(tmp_path / "p.npy", acts)
    np.testing.assert_array_equal(resolve_actions(str(tmp_path / "p.npy"), frames=None, speed_kmh=99), acts)
    np.save(tmp_path / "flat.npy", acts.reshape(-1, 3))
    np.testing.assert_array_equal(resolve_actions(str(tmp_path / "flat.npy"), frames=None, speed_kmh=99), acts)
    (tmp_path / "p.jsonl").write_text(json.dumps({"instruction_trajs": A.preset_trajs(name, 12, 25).tolist()}) + "\n")
    np.testing.assert_allclose(resolve_actions(str(tmp_path / "p.jsonl"), frames=None, speed_kmh=99), acts, atol=1e-6)


# ---------------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", A.PRESETS)
def test_preset_shape_and_times(name):
    acts = resolve_actions(name.upper(), frames=30, speed_kmh=30)
    assert acts.shape == (30, 6, 3) and acts.dtype == np.float32
    assert np.isfinite(acts).all()
    np.testing.assert_allclose(acts[:, :, 2], np.broadcast_to(TIMES, (30, 6)), atol=1e-6)
    assert (np.diff(acts[:, :, 2], axis=1) > 0).all()
    assert (np.diff(acts[:, :, 1], axis=1) >= -1e-6).all(), "never drives backwards"


def test_turns_go_their_way():
    left = resolve_actions("left", frames=25, speed_kmh=30)
    right = resolve_actions("right", frames=25, speed_kmh=30)
    assert left[-1, -1, 0] > 1.0 and right[-1, -1, 0] < -1.0
    assert (left[:, :, 0] >= 0).all() and (right[:, :, 0] <= 0).all()
    np.testing.assert_allclose(left[:, :, 0], -right[:, :, 0], atol=1e-6)
    np.testing.assert_allclose(left[:, :, 1], right[:, :, 1], atol=1e-6)
    # a plausible yaw rate: the 2.95 s point turns well short of 90 degrees, but clearly turns
    heading_chord = np.degrees(np.arctan2(left[0, -1, 0], left[0, -1, 1]))
    assert 5 < heading_chord < 45
    assert A.summarize_actions(left).lateral_m > 0 > A.summarize_actions(right).lateral_m
    assert resolve_actions("straight", frames=5, speed_kmh=30)[:, :, 0].max() == 0


def test_stop_comes_to_rest():
    acts = resolve_actions("stop", frames=50, speed_kmh=30)
    ahead = acts[:, -1, 1]  # how far the last waypoint is
    assert ahead[0] > 5
    assert (np.diff(ahead) <= 1e-6).all()
    assert np.abs(acts[-10:, :, :2]).max() < 0.05
    # even a 25-frame clip is nearly stopped at the end
    assert resolve_actions("stop", frames=25, speed_kmh=30)[-1, -1, 1] < 0.5


def test_accelerate_grows_and_speed_scales():
    acts = resolve_actions("accelerate", frames=25, speed_kmh=30)
    ahead = acts[:, -1, 1]
    assert (np.diff(ahead) > 0).all()
    slow = resolve_actions("straight", frames=4, speed_kmh=20)
    fast = resolve_actions("straight", frames=4, speed_kmh=40)
    np.testing.assert_allclose(fast[:, :, 1], 2 * slow[:, :, 1], rtol=1e-5)
    np.testing.assert_allclose(slow[0, :, 1], 20 / 3.6 * TIMES, rtol=1e-5)
    for name in A.PRESETS:
        a = resolve_actions(name, frames=10, speed_kmh=20)
        b = resolve_actions(name, frames=10, speed_kmh=50)
        assert b[0, -1, 1] > a[0, -1, 1], name
    assert np.abs(resolve_actions("left", frames=3, speed_kmh=0)).max() <= 2.95  # standing: only the times


def test_summary_is_dead_reckoned():
    s = A.summarize_actions(resolve_actions("straight", frames=25, speed_kmh=36))
    assert s.frames == 25 and s.forward_m == pytest.approx(10 * (2.4 + 2.95), rel=1e-4) and s.lateral_m == 0
    s = A.summarize_actions(resolve_actions("accelerate", frames=11, speed_kmh=36))
    assert s.forward_m == pytest.approx(10 * 3.95 + 0.75 * 3.95**2, rel=1e-3)


# ---------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_one_line_errors(tmp_path):
    np.save(tmp_path / "shape.npy", np.zeros((4, 5, 3)))
    np.save(tmp_path / "nan.npy", np.full((2, 6, 3), np.nan))
    np.save(tmp_path / "inf.npy", np.full((12, 3), np.inf))
    np.save(tmp_path / "empty_arr.npy", np.zeros((0, 6, 3)))
    np.save(tmp_path / "strings.npy", np.array([["a"] * 3] * 6))
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "garbage.npy").write_bytes(b"not numpy at all")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "broken.json").write_text('{"instruction_trajs": [[[0, 0')
    (tmp_path / "nokey.json").write_text('{"sample_id": 3, "label": "x"}')
    (tmp_path / "noframes.json").write_text('{"instruction_trajs": []}')
    (tmp_path / "short.json").write_text(json.dumps({"instruction_trajs": [[[0.0, 0.0, 0.0]] * 30]}))
    (tmp_path / "ragged.json").write_text(json.dumps({"instruction_trajs": [[[0.0, 0.0], [1.0]] * 30]}))
    (tmp_path / "nan.json").write_text('{"instruction_trajs": [' + "[" + ",".join(["[NaN, 0, 0]"] * 60) + "]]}")
    (tmp_path / "number.json").write_text("3")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "mystery.txt").write_text("hello")
    (tmp_path / "adir").mkdir()
    cases = {
        "shape.npy": "shape (frames, 6, 3)",
        "nan.npy": "NaN or inf",
        "inf.npy": "NaN or inf",
        "empty_arr.npy": "empty",
        "strings.npy": "numbers",
        "empty.npy": "empty",
        "garbage.npy": "cannot read",
        "missing.npy": "does not exist",
        "empty.jsonl": "empty",
        "broken.json": "cannot read",
        "nokey.json": "no 'instruction_trajs'",
        "noframes.json": "no frames",
        "short.json": "has 30 points; need 60",
        "ragged.json": "frame 0",
        "nan.json": "NaN or inf",
        "number.json": "expected a JSON object",
        "binary.jsonl": "cannot read",
        "mystery.txt": "unknown actions format",
        "adir": "not a file",
    }
    for name, message in cases.items():
        with pytest.raises(ActionsError) as info:
            resolve_actions(str(tmp_path / name), frames=None, speed_kmh=30)
        text = str(info.value)
        assert message in text and "\n" not in text, (name, text)
        assert isinstance(info.value, TerraError)

    preset_cases = [
        (dict(spec="left", frames=None, speed_kmh=30), "needs a number of frames"),
        (dict(spec="left", frames=0, speed_kmh=30), "at least 1"),
        (dict(spec="stop", frames=5, speed_kmh=-1), "--speed"),
        (dict(spec="stop", frames=5, speed_kmh=float("nan")), "--speed"),
        (dict(spec="stop", frames=5, speed_kmh=1000), "--speed"),
        (dict(spec="", frames=5, speed_kmh=30), "empty actions"),
        (dict(spec="sideways", frames=5, speed_kmh=30), "does not exist"),
    ]
    for kwargs, message in preset_cases:
        spec = kwargs.pop("spec")
        with pytest.raises(ActionsError, match=message):
            resolve_actions(spec, **kwargs)


# ---------------------------------------------------------------------------------- CLI


def test_cli_convert_writes_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "left.npy"
    result = invoke_terra("actions", "convert", "left", out, "--frames", 25, "--speed", 20)
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(np.load(out), resolve_actions("left", frames=25, speed_kmh=20))
    assert np.load(out).dtype == np.float32
    said = result.stdout + result.stderr
    assert "25 frames" in said and "m forward" in said and "lateral offset +" in said

    again = invoke_terra("actions", "convert", "right", out, "--frames", 25)
    assert again.returncode != 0 and "already exists" in again.stderr and "Traceback" not in again.stderr
    np.testing.assert_array_equal(np.load(out), resolve_actions("left", frames=25, speed_kmh=20))
    assert invoke_terra("actions", "convert", "right", out, "--frames", 25, "--overwrite").returncode == 0
    assert np.load(out)[-1, -1, 0] < 0

    # a JSONL file converts to the same array as its source
    acts = known_actions()
    (tmp_path / "s.jsonl").write_text(json.dumps({"instruction_trajs": act_bench_trajs(acts)}) + "\n")
    assert invoke_terra("actions", "convert", tmp_path / "s.jsonl", tmp_path / "s.npy").returncode == 0
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), acts, atol=1e-6)


def test_cli_plot_writes_a_png_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "plot.png"
    result = invoke_terra("actions", "plot", "right", out, "--frames", 20)
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 5000
    with Image.open(out) as im:
        im.load()
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 300
        assert len(im.getcolors(maxcolors=1 << 20) or []) > 20, "not a blank picture"
    assert not list(tmp_path.glob(".*partial*")), "no leftover temporary file"
    before = out.read_bytes()
    again = invoke_terra("actions", "plot", "left", out, "--frames", 20)
    assert again.returncode != 0 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert out.read_bytes() == before
    assert invoke_terra("actions", "plot", "left", out, "--frames", 20, "--overwrite").returncode == 0


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_a_plot_is_the_same_bytes_each_time(tmp_path, suffix):
    """svg and pdf would carry the time they were made and random ids."""
    made = []
    for name in ("a", "b"):
        result = invoke_terra("actions", "plot", "right", tmp_path / f"{name}{suffix}", "--frames", 5)
        assert result.returncode == 0, result.stderr
        made.append((tmp_path / f"{name}{suffix}").read_bytes())
        time.sleep(1.1)  # the clock's second moves on between the two
    assert made[0] == made[1] and len(made[0]) > 1000


def test_cli_bad_inputs_exit_nonzero_without_traceback(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((4, 5, 3)))
    cases = [
        (["convert", tmp_path / "bad.npy", tmp_path / "o.npy"], "shape (frames, 6, 3)"),
        (["convert", "left", tmp_path / "o.npy"], "--frames"),
        (["convert", tmp_path / "nope.json", tmp_path / "o.npy"], "does not exist"),
        (["convert", "left", tmp_path / "o.txt", "--frames", 3], ".npy"),
        (["plot", tmp_path / "bad.npy", tmp_path / "o.png"], "shape (frames, 6, 3)"),
        (["plot", "stop", tmp_path / "o.png", "--frames", 3, "--speed", -5], "--speed"),
    ]
    for args, message in cases:
        result = invoke_terra("actions", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    assert not (tmp_path / "o.npy").exists() and not (tmp_path / "o.png").exists()


def test_numbers_beyond_float32_are_refused_before_anything_is_written(tmp_path):
    huge = np.full((5, 6, 3), 1e39)  # finite in float64, inf once the model's float32 sees it
    with pytest.raises(ActionsError, match="beyond float32"):
        A.normalize_actions(huge)
    np.save(tmp_path / "huge.npy", huge)
    for command, out in (("convert", "o.npy"), ("plot", "o.png")):
        result = invoke_terra("actions", command, tmp_path / "huge.npy", tmp_path / out)
        assert result.returncode == 2 and "beyond float32" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge.npy"]


def test_cli_plot_draws_a_file_name_that_looks_like_mathtext(tmp_path):
    name = tmp_path / "$\\foo^$.npy"  # matplotlib would parse "$...$" in the title as maths
    np.save(name, A.preset_actions("left", 5))
    result = invoke_terra("actions", "plot", name, tmp_path / "p.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "p.png").stat().st_size > 5000


def test_a_named_pipe_is_refused_without_opening_it(tmp_path):
    for name in ("acts.npy", "acts.json", "acts"):
        os.mkfifo(tmp_path / name)
        with pytest.raises(ActionsError, match="is a named pipe"):
            resolve_actions(str(tmp_path / name), frames=None)  # open() would block forever


def test_cli_help_has_examples():
    for command in ("convert", "plot"):
        result = invoke_terra("actions", command, "--help")
        assert result.returncode == 0 and "Examples" in result.stdout and "terra actions " + command in result.stdout


def test_implausible_waypoints_are_named_by_frame_and_presets_pass():
    from terra_cli.plausibility import implausible_actions

    for name in A.PRESETS:
        assert implausible_actions(A.preset_actions(name, 30, 120.0)) == [], name
    actions = A.preset_actions("straight", 10, 30.0).astype(np.float64)
    actions[4, :, 1] *= 100  # centimetres for metres: 3,000 km/h
    actions[6, 2, 0] = 8.0  # 8 m sideways 1.45 s ahead: 7.6 m/s^2, plausible
    actions[7, 0, 0] = 6.0  # 6 m sideways 0.45 s ahead: 59 m/s^2
    actions[8, :, 2] = 0.45  # every waypoint at the same time
    messages = implausible_actions(actions)
    assert len(messages) == 3
    times, speed, lateral = messages
    assert times.startswith("frame 8:") and "do not increase" in times
    assert speed.startswith("frame 4:") and "km/h" in speed and "(1 frame(s))" in speed
    assert lateral.startswith("frame 7:") and "m/s^2 sideways" in lateral


def test_cli_warns_about_implausible_actions_and_still_writes(tmp_path):
    from typer.testing import CliRunner

    from terra_cli.cli import app

    actions = A.preset_actions("left", 5, 30.0)
    actions[2, :, :2] *= 1000
    np.save(tmp_path / "km.npy", actions)
    result = CliRunner().invoke(app, ["actions", "convert", str(tmp_path / "km.npy"), str(tmp_path / "o.npy")])
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("warning:")][0].startswith(
        "warning: actions frame 2:")
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), actions)
