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
    from terra_cli.errors import InputError

    path = scenario_file(tmp_path, [*GOOD, {"id": "x", "actions": "sideways"}])
    file = read_scenarios(path, Defaults())
    out = tmp_path / "out"
    with pytest.raises(InputError, match="line 4"):
        run_scenarios(file, out, backend, None, max_rollouts=1)
    run = run_scenarios(file, out, backend, None, max_rollouts=1, skip_invalid=True)
    assert (run.done, run.skipped, run.resumed) == (3, 1, 0)
    records = [json.loads(line) for line in (out / RESULTS_NAME).read_text().splitlines()]
    assert {r["status"] for r in records} == {"done", "skipped"}
    assert completed_ids(out) == {"a", "b", "c"}
    assert np.load(out / "b.npy").shape == (5, TOKENS)
    again = run_scenarios(file, out, backend, None, max_rollouts=1, skip_invalid=True)
    assert (again.done, again.resumed) == (0, 3)
    assert (out / RESULTS_NAME).read_text().count('"skipped"') == 1  # a resume records its skips once
    assert [r["id"] for r in records if r["status"] == "skipped"] == ["x"]  # the bad line's own id
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


def act_bench_line(sample_id, images, rows=47):
    # ACT-Bench's instruction_trajs: per frame 60 points [x, y] 0.05 s apart (straight ahead at 8 m/s).
    trajectory = [[0.4 * i, 0.0] for i in range(60)]
    return {"sample_id": sample_id, "context_frames": images, "instruction_trajs": [trajectory] * rows,
            "label": "curving_to_left"}


def test_act_bench_lines_read_like_terras_own_script(tmp_path):
    from PIL import Image

    from terra_cli.errors import InputError

    root = tmp_path / "nuscenes"
    (root / "samples").mkdir(parents=True)
    images = [f"samples/{i}.jpg" for i in range(3)]
    for name in images:
        Image.new("RGB", (64, 36)).save(root / name)
    path = scenario_file(tmp_path, [act_bench_line(12, images), act_bench_line("7", images, rows=10)])
    # context_frames are relative to the nuScenes dataroot, not to the file
    without_root = read_scenarios(path, Defaults())
    assert [p.line for p in without_root.problems] == [1, 2]
    assert "--image-root" in without_root.problems[0].message
    file = read_scenarios(path, Defaults(image_root=root))
    [scenario] = file.scenarios
    assert (scenario.frames, scenario.context_frames, scenario.source_format) == (47, 3, "act-bench")
    assert scenario.output_stem == "NUSCENES_ACTION_000012"
    assert "10 rows; 47 frames need at least 46" in file.problems[0].message
    samples = read_scenarios(path, Defaults(image_root=root), rollouts=2).scenarios
    assert [(s.id, s.output_stem, s.seed) for s in samples] == [
        ("12_s0", "s0/NUSCENES_ACTION_000012", 0), ("12_s1", "s1/NUSCENES_ACTION_000012", 1)]
    assert read_scenarios(path, Defaults(frames=6, image_root=root)).scenarios[1].frames == 6
    with pytest.raises(InputError, match="--image-root"):
        from terra_cli.scenarios.job import ScenarioJob, prepare_job

        prepare_job(ScenarioJob(path, tmp_path / "out", Defaults(image_root=tmp_path / "nowhere")))


@pytest.mark.slow
def test_act_bench_videos_are_what_its_scorer_reads(tmp_path, frame_tokenizer):
    """End to end through the CLI: the scorer globs *.mp4 in one folder, takes the sample id from
    the trailing _digits of the name and keeps the last frames of each video. (The tokenizer is a
    small one of Terra's frame size and codes: names and frame counts are the point, not pictures.)"""
    import re

    from PIL import Image

    from terra_cli.media.frames import count_frames

    root = tmp_path / "nuscenes"
    root.mkdir()
    rng = np.random.default_rng(1)
    images = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, size=(288, 512, 3), dtype=np.uint8)).save(root / f"{i}.jpg")
        images.append(f"{i}.jpg")
    path = scenario_file(tmp_path, [act_bench_line(345, images)])
    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_vocab=1024, layers=1))  # the tokenizer's codes
    out = tmp_path / "videos"
    result = CliRunner().invoke(app, ["generate", "--scenarios", str(path), "--image-root", str(root),
                                      "--out-dir", str(out), "--model", str(model), "--tokenizer",
                                      frame_tokenizer, "--backend", "hf", "--frames", "4",
                                      "--rollouts", "2"])
    assert result.exit_code == 0, result.output
    for sample in ("s0", "s1"):
        videos = sorted((out / sample).glob("*.mp4"))
        assert [int(re.search(r"_(\d+)$", v.stem).group(1)) for v in videos] == [345]
        assert count_frames(videos[0]) == 4
    records = [json.loads(line) for line in (out / RESULTS_NAME).read_text().splitlines()]
    assert sorted(r["id"] for r in records if r["status"] == "done") == ["345_s0", "345_s1"]
    # the two samples of a scene differ (seed, seed+1)
    assert not np.array_equal(np.load(out / "s0/NUSCENES_ACTION_000345.npy")[3:],
                              np.load(out / "s1/NUSCENES_ACTION_000345.npy")[3:])


def test_engine_options_are_checked_before_a_model_loads():
    from terra_cli.pipeline.engine_request import check_backend_options, engine_options
    from terra_cli.errors import InputError

    assert engine_options() == engine_options("auto", "none", "none", 8) == {}
    assert engine_options("FP8", "fp8") == {"kv_cache_dtype": "fp8", "quantization": "fp8"}
    assert engine_options(draft="previous-frame", draft_tokens=8) == {"draft_tokens": 8}
    assert engine_options(torch_compile=False) == {"torch_compile": False}
    assert engine_options(torch_compile=True) == {"torch_compile": True}
    with pytest.raises(InputError, match="--no-torch-compile: vLLM engine option"):
        check_backend_options("hf", engine_options(torch_compile=False))
    with pytest.raises(InputError, match="--draft must be none, previous-frame or jacobi"):
        engine_options(draft="ngram")
    with pytest.raises(InputError, match="--quantization must be none or fp8"):
        engine_options("auto", "int4")
    with pytest.raises(InputError, match="--kv-cache-dtype must be auto or fp8"):
        engine_options("bf16", "none")


def test_a_scenario_that_cannot_be_written_ends_the_run_with_exit_1_not_2(tmp_path, monkeypatch):
    """Issue 38: every input was checked up front, so a write that fails mid-run (a full disk
    here) is the run's failure, not a mistake of the user's: exit 1, one line, the rest written."""
    import errno

    from terra_cli.scenarios import results

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=TOKENS, layers=1))
    path = scenario_file(tmp_path, GOOD)
    real_write = results.write_scenario

    def disk_full_for_b(out_dir, scenario, *args, **kwargs):
        if scenario.id == "b":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(out_dir, scenario, *args, **kwargs)

    monkeypatch.setattr(results, "write_scenario", disk_full_for_b)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["generate", "--scenarios", str(path), "--out-dir", str(out), "--model", str(model),
                                      "--backend", "hf", "--device", "cpu", "--no-decode"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 scenario(s) could not be written" in errors[0] and "b: " in errors[0]
    assert "unexpected" not in result.output and "Traceback" not in result.output
    assert sorted(p.name for p in out.glob("*.npy")) == ["a.npy", "c.npy"]


def test_a_resumed_runs_bar_counts_only_what_it_still_makes(tmp_path):
    """The frames bar's total and the written count are this run's: a run that resumes two finished
    scenarios of three shows 1/1 frames and "1 of 1 written", so its rate and ETA are true."""
    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=TOKENS, layers=1))
    args = ["generate", "--scenarios", str(scenario_file(tmp_path, GOOD[:2])), "--out-dir", str(tmp_path / "out"),
            "--model", str(model), "--backend", "hf", "--device", "cpu", "--no-decode"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0 and "5/5 generated frames" in first.output, first.output
    scenario_file(tmp_path, GOOD)  # the third scenario added: 1 frame to generate
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "1/1 generated frames" in again.output and "1 of 1 written" in again.output, again.output
    assert "1 scenario(s) written, 2 already done" in again.output
