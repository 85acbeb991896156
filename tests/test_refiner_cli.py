"""`--decoder refiner` through `terra generate` (one video and --scenarios) and `terra refine`,
end to end with a tiny refiner checkpoint in Terra's format, a tiny world model and tokenizer."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("diffusers")

from terra_cli.cli import app  # noqa: E402


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A tiny world model over a small tokenizer's 1024 codes, that tokenizer, a tiny refiner, and
    24 context frames of tokens (so that a 25- or 26-frame video needs one or two generated frames)."""
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.refiner.testing import write_tiny_refiner
    from tokenizer_decoder import ImageTokenizer, small_config

    root = tmp_path_factory.mktemp("refiner_cli")
    model = write_tiny_checkpoint(root / "model", tiny_config(image_vocab=1024, layers=1, hidden_size=32, heads=1))
    # narrow low levels (ch_mult 1 at every level): each video decodes 25 or 26 frames at 288x512 for
    # the refiner's condition, about a third cheaper than with the default widths
    small = small_config(ch=32, num_res_blocks=1, ch_mult=(1,) * 5)
    tokenizer = ImageTokenizer.from_config(small, device="cpu").save_pretrained(root / "tok")
    refiner = write_tiny_refiner(root / "refiner_model.pt")
    context = root / "ctx.npy"
    np.save(context, np.random.default_rng(0).integers(0, 1024, size=(24, 576)))
    return {"model": str(model), "tokenizer": str(tokenizer), "refiner": str(refiner), "context": context}


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result


def video_frames(path):
    from terra_cli.media.frames import read_frames

    return np.stack(read_frames(path))


@pytest.mark.slow
def test_generate_with_the_refiner_then_refine_the_saved_tokens_the_same(tmp_path, parts):
    out, tokens = tmp_path / "out.mp4", tmp_path / "tokens.npy"
    common = ["--tokenizer", parts["tokenizer"], "--refiner", parts["refiner"], "--device", "cpu"]
    result = run("generate", out, "--model", parts["model"], "--context-tokens", parts["context"], "--frames", 25,
                 "--actions", "left", "--backend", "hf", "--seed", 3, "--decoder", "refiner", "--save-tokens", tokens,
                 *common)
    assert result.exit_code == 0, result.output
    frames = video_frames(out)
    assert frames.shape == (25, 32, 64, 3)  # the tiny refiner's 64x32 (Terra's: 640x384)
    again = tmp_path / "again.mp4"
    result = run("refine", tokens, again, "--seed", 3, *common)
    assert result.exit_code == 0, result.output
    assert np.array_equal(video_frames(again), frames)  # same tokens and seed: the same video
    # (another seed gives another video: tests/test_refiner.py, without the token decoder's cost)


def test_refiner_errors_are_one_line_before_any_model_runs(tmp_path, parts):
    out = tmp_path / "out.mp4"
    base = ["generate", out, "--model", parts["model"], "--tokenizer", parts["tokenizer"], "--context-tokens",
            parts["context"], "--actions", "left", "--backend", "hf", "--device", "cpu"]
    cases = [
        (["--decoder", "refiner"], "--decoder refiner has no weights: pass --refiner"),
        (["--decoder", "refiner", "--refiner", tmp_path / "none.pt"], "does not exist"),
        (["--decoder", "refined"], "--decoder must be frames or refiner"),
        (["--refiner", parts["refiner"]], "--refiner works with --decoder refiner"),
        (["--decoder", "refiner", "--refiner", parts["refiner"], "--frames", 24, "--context-frames", 3],
         "the refiner needs at least 25 frames"),
        (["--decoder", "refiner", "--refiner", parts["refiner"], "--refiner-compile", "fast"],
         "--refiner-compile must be one of auto, none, default"),
        (["--refiner-windows", 2], "--refiner-compile and --refiner-windows work with --decoder refiner"),
        (["--decoder", "refiner", "--refiner", parts["refiner"], "--refiner-windows", 0], "--refiner-windows"),
    ]
    for extra, message in cases:
        result = run(*base, *extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output and "Traceback" not in result.output, (extra, result.output)
    assert not out.exists()
    result = run("refine", "convert", parts["refiner"], tmp_path / "x.safetensors")
    assert result.exit_code == 2 and "--trust-checkpoint" in result.output
    assert not (tmp_path / "x.safetensors").exists()


def test_bench_refiner_reports_counted_flops_and_the_act_bench_projection(tmp_path, monkeypatch):
    """Also with three refiner switches on (issue 40), which the JSON and the log record."""
    monkeypatch.setenv("TERRA_REFINER_CHANNELS_LAST", "1")
    monkeypatch.setenv("TERRA_REFINER_ATTENTION", "math")
    monkeypatch.setenv("TERRA_REFINER_TIME_CONV", "plane")
    monkeypatch.delenv("TERRA_REFINER_GEGLU", raising=False)
    out = tmp_path / "bench.json"
    result = run("bench", "--refiner", "--tiny", "--device", "cpu", "--windows", "1", "--full-cfg", "--out", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    flops = data["flops"]
    assert flops["evals_per_window"] == 2 * data["config"]["steps"]  # the guidance pair: two evaluations per step
    assert flops["window"] == flops["evals_per_window"] * flops["unet_eval"] > 0
    assert data["act_bench"]["windows_per_sample"] == 2 and data["act_bench"]["samples"] == 2286
    row = data["rows"][0]
    assert row["windows_per_call"] == 1 and row["seconds_per_window"] > 0 and row["peak_memory_gib"] is None
    assert data["compile_mode"] == "none" and data["vae_decode_compiled"] is None  # eager on a CPU
    assert "per call, eager)" in result.output and "VAE decode compiled" not in result.output
    switches = {"TERRA_REFINER_CHANNELS_LAST": 1, "TERRA_REFINER_ATTENTION": "math", "TERRA_REFINER_TIME_CONV": "plane",
                "TERRA_REFINER_GEGLU": "split", "TERRA_REFINER_FP8_LAYERS": "all"}
    assert data["lab_switches"] == switches
    assert f"lab switches {switches}" in result.output


def test_bench_refiner_in_a_compiled_run_times_the_products_compiled_vae_decoder(tmp_path, monkeypatch):
    """Issue 40: `vae_seconds_per_frame.decode` (and the projection) is the product's decoder, the
    compiled one in a compiled run (here a stand-in: compiling on a CPU costs minutes), with eager beside it."""
    from terra_cli.refiner import refiner as refiner_module
    from terra_cli.refiner.autoencoder import one_frame_clips

    calls = []

    def stand_in(vae, mode="default"):
        eager = one_frame_clips(vae)
        return lambda latents: calls.append(latents.shape[0]) or eager(latents)

    monkeypatch.setattr(refiner_module, "resolve_compile_mode", lambda mode, device: "default")
    monkeypatch.setattr(refiner_module, "compile_unet", lambda unet, mode: unet)
    for switch in ("TERRA_REFINER_CHANNELS_LAST", "TERRA_REFINER_ATTENTION", "TERRA_REFINER_TIME_CONV",
                   "TERRA_REFINER_GEGLU"):
        monkeypatch.delenv(switch, raising=False)
    monkeypatch.setattr(refiner_module, "compile_vae_decoder", stand_in)
    out = tmp_path / "bench.json"
    result = run("bench", "--refiner", "--tiny", "--device", "cpu", "--windows", "1", "--out", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    compiled, decode = data["vae_decode_compiled"], data["vae_seconds_per_frame"]["decode"]
    assert data["compile_mode"] == "default" and len(calls) > 1
    assert compiled["ms_per_frame"] == pytest.approx(1e3 * decode, abs=0.01) and compiled["eager_ms_per_frame"] > 0
    assert compiled["error"] is None and compiled["compile_s"] >= 0 and compiled["max_abs_diff"] < 1e-5
    assert data["lab_switches"] == {"TERRA_REFINER_CHANNELS_LAST": 0, "TERRA_REFINER_ATTENTION": "default",
                                    "TERRA_REFINER_TIME_CONV": "3d", "TERRA_REFINER_GEGLU": "split",
                                    "TERRA_REFINER_FP8_LAYERS": "all"}
    assert "per call, compiled)" in result.output
    assert "VAE decode compiled (the product's in a compiled run)" in result.output


def test_a_missing_diffusers_is_one_line_with_the_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)  # import diffusers raises ImportError
    out = tmp_path / "bench.json"
    result = run("bench", "--refiner", "--tiny", "--device", "cpu", "--windows", "1", "--out", out)
    assert result.exit_code == 2, result.output
    assert "terra-cli[refiner]" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_options_before_the_arguments_and_a_converted_file_follows_the_umask(tmp_path, parts):
    """Issue 38: `terra refine --refiner R TOKENS OUT` failed with "No such option"; a converted
    .safetensors got mode 0600 where every other output follows the umask."""
    import os

    tokens = tmp_path / "t20.npy"
    np.save(tokens, np.zeros((20, 576), dtype=np.int64))
    options_first = run("refine", "--refiner", parts["refiner"], "--device", "cpu", tokens, tmp_path / "o.mp4")
    assert options_first.exit_code == 2, options_first.output
    assert "the refiner needs at least 25 frames" in options_first.output  # parsed as TOKENS OUT, then checked
    assert run("refine", "--help").exit_code == 0
    converted = tmp_path / "r.safetensors"
    saved = os.umask(0o022)
    try:
        result = run("refine", "convert", "--trust-checkpoint", parts["refiner"], converted)
    finally:
        os.umask(saved)
    assert result.exit_code == 0, result.output
    assert converted.stat().st_mode & 0o777 == 0o644


def scenario_file(folder, parts, count):
    """Each video's 24 context frames, 2 generated (a scenario's default of 3 context frames had the
    reference backend generate 23 frames of 576 tokens a video: most of these tests' time)."""
    (folder / "ctx.npy").write_bytes(parts["context"].read_bytes())
    lines = [{"id": f"v{i}", "context": "ctx.npy", "context_frames": 24, "actions": ["left", "right"][i % 2],
              "frames": 26, "seed": 5 + i} for i in range(count)]
    spec = folder / "s.jsonl"
    spec.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return spec, [line["id"] for line in lines]


def refine_args(spec, out, parts, *extra):
    return ["generate", "--scenarios", spec, "--out-dir", out, "--model", parts["model"], "--tokenizer",
            parts["tokenizer"], "--backend", "hf", "--device", "cpu", "--decoder", "refiner", "--refiner",
            parts["refiner"], *extra]


def assert_same_videos(folder_a, folder_b, ids):
    """The same tokens, and videos equal up to float rounding: kernels at another batch size round
    differently on the CPU, which the tiny random UNet grows over 15 steps (about 1 level on average
    here, 2026-11-27), then the mp4 codes the frames; another seed's video is about 12 levels away."""
    worst = 0.0
    for i in ids:
        assert np.array_equal(np.load(folder_a / f"{i}.npy"), np.load(folder_b / f"{i}.npy"))
        a, b = video_frames(folder_a / f"{i}.mp4").astype(int), video_frames(folder_b / f"{i}.mp4").astype(int)
        assert a.shape == b.shape == (26, 32, 64, 3)
        worst = max(worst, np.abs(a - b).mean())
    first, second = (video_frames(folder_a / f"{i}.mp4").astype(int) for i in ids[:2])
    other = np.abs(first - second).mean()  # other tokens and seed: another video
    assert worst < 3.0 and other > 3 * worst, (worst, other)


@pytest.fixture(scope="module")
def one_window_per_call(tmp_path_factory, parts):
    """Two 26-frame scenarios (two windows each) through one engine at one window per UNet call: the
    videos the data-parallel run must equal. Each video decodes 26 full-size frames on the CPU, so
    the two tests below share this run instead of making it each."""
    folder = tmp_path_factory.mktemp("refiner_one_window")
    spec, ids = scenario_file(folder, parts, 2)
    result = run(*refine_args(spec, folder / "w1", parts, "--refiner-windows", 1))
    assert result.exit_code == 0, result.output
    return spec, ids, folder / "w1"


def done_ids(folder):
    return sorted((r["id"], r["status"]) for r in map(json.loads, (folder / "results.jsonl").read_text().splitlines()))


@pytest.mark.slow
def test_scenarios_with_the_refiner_write_refined_videos_and_resume(parts, one_window_per_call):
    """The module's one-engine run: each scenario's refined video (two windows, overlap removed), its
    tokens and a done line; the same command again resumes. (The same videos at 2 windows per call:
    the data-parallel test below, through the same RefineStage; batching windows of several videos
    in one call: tests/test_refiner.py's stage test.)"""
    spec, ids, one = one_window_per_call
    records = [json.loads(line) for line in (one / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["status"], r["frames"]) for r in records] == [(i, "done", 26) for i in ids]
    for i in ids:
        assert video_frames(one / f"{i}.mp4").shape == (26, 32, 64, 3)
        assert np.load(one / f"{i}.npy").shape == (26, 576)
    result = run(*refine_args(spec, one, parts, "--refiner-windows", 1))
    assert result.exit_code == 0 and "2 already done" in result.output, result.output


@pytest.mark.slow
def test_data_parallel_engines_refine_their_own_videos(tmp_path, parts, one_window_per_call):
    """Issue 40: --decoder refiner on Ray (a local cluster of two engines) at 2 windows per UNet call:
    each engine refines its own videos, the driver writes them, and they are the videos one engine
    makes at 1 window per call (each window's noise is its own, whatever shares its calls)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    spec, ids, one = one_window_per_call
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    args = [str(a) for a in refine_args(spec, tmp_path / "two", parts, "--refiner-windows", 2, "--data-parallel", 2)]
    done = subprocess.run([sys.executable, "-m", "terra_cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done_ids(tmp_path / "two") == [(i, "done") for i in ids]
    records = [json.loads(line) for line in (tmp_path / "two" / "results.jsonl").read_text().splitlines()]
    assert {r["engine"] for r in records} <= {0, 1}
    assert_same_videos(one, tmp_path / "two", ids)
