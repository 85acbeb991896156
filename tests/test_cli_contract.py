"""`terra generate` token contract through a real subprocess, and the CLI's error handling."""

import numpy as np
import pytest

from terra_cli.backends.hf import generate_frames
from terra_cli.models.modeling_hf import load_model
from terra_cli.backends.base import Sampling

from conftest import invoke_terra, run_terra


def write_inputs(tmp_path, frames=4, context_frames=2, seed=0):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 512, size=(context_frames, 576)).astype(np.int32)
    acts = rng.normal(size=(frames, 6, 3)).astype(np.float32)
    np.save(tmp_path / "ctx.npy", ctx)
    np.save(tmp_path / "acts.npy", acts)
    return ctx, acts


@pytest.mark.slow
def test_generate_no_decode_contract_hf(tmp_path, tiny_checkpoint):
    ctx, acts = write_inputs(tmp_path)
    args = ["generate", "--model", tiny_checkpoint, "--context-tokens", tmp_path / "ctx.npy",
            "--actions", tmp_path / "acts.npy", "--frames", 4, "--temperature", 0, "--backend", "hf",
            "--no-decode", "--save-tokens", tmp_path / "out.npy"]
    result = run_terra(*args)
    assert result.returncode == 0, result.stderr
    assert "backend: hf" in result.stderr
    tokens = np.load(tmp_path / "out.npy")
    assert tokens.shape == (4, 576) and tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens[:2], ctx)
    expected = generate_frames(load_model(tiny_checkpoint), ctx, acts, 4, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(tokens, expected)

    # An existing output is never overwritten without --overwrite.
    again = invoke_terra(*args)
    assert again.returncode != 0 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert invoke_terra(*args, "--overwrite").returncode == 0


def test_generate_bad_inputs_give_one_line_errors(tmp_path, tiny_checkpoint):
    write_inputs(tmp_path)
    base = ["generate", "--model", tiny_checkpoint, "--context-tokens", tmp_path / "ctx.npy",
            "--temperature", 0, "--backend", "hf", "--no-decode", "--save-tokens", tmp_path / "o.npy"]
    np.save(tmp_path / "bad_shape.npy", np.zeros((4, 5, 3), dtype=np.float32))
    for name, tokens, message in (("empty.npy", np.zeros((0, 576), np.int64), "holds no frames"),
                                  ("huge.npy", np.full((2, 576), 2**63, np.uint64), f"found {2**63}")):
        np.save(tmp_path / name, tokens)
        result = invoke_terra("generate", "--model", tiny_checkpoint, "--context-tokens", tmp_path / name,
                              "--actions", tmp_path / "acts.npy", "--frames", 4, "--backend", "hf", "--no-decode",
                              "--save-tokens", tmp_path / "o.npy")
        assert result.returncode == 2 and message in result.stderr and "backend:" not in result.stderr, result.stderr
    cases = {
        "shape (frames, 6, 3)": ["--actions", tmp_path / "bad_shape.npy", "--frames", 4],
        "at least 5 frames": ["--actions", tmp_path / "acts.npy", "--frames", 6],
        "does not exist": ["--actions", tmp_path / "missing.npy", "--frames", 4],
    }
    for message, extra in cases.items():
        result = invoke_terra(*base, *extra)
        assert result.returncode == 2, (message, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
    missing_model = invoke_terra("generate", "--model", tmp_path / "nope", "--context-tokens", tmp_path / "ctx.npy",
                              "--actions", tmp_path / "acts.npy", "--frames", 4, "--backend", "hf",
                              "--no-decode", "--save-tokens", tmp_path / "o.npy")
    assert missing_model.returncode == 2 and "does not exist" in missing_model.stderr


def test_too_few_frames_for_the_embedded_road_fails_before_any_model_loads(tmp_path):
    result = invoke_terra("generate", tmp_path / "out.mp4", "--frames", 3, "--actions", "left", "--backend", "hf")
    assert result.returncode == 2 and "--frames (3) must be more than the 3 context frame(s)" in result.stderr
    assert "backend:" not in result.stderr and "encoding" not in result.stderr and not (tmp_path / "out.mp4").exists()
    two = invoke_terra("generate", "--frames", 3, "--context-frames", 2, "--actions", "left",
                       "--backend", "hf", "--no-decode", "--save-tokens", tmp_path / "t.npy", "--temperature", 0)
    assert two.returncode == 0, two.stderr
    np.save(tmp_path / "long.npy", np.zeros((26, 576), dtype=np.int64))  # terra-mini's round holds 25 frames
    long = invoke_terra("generate", "--context-tokens", tmp_path / "long.npy", "--frames", 30, "--actions", "left",
                        "--backend", "hf", "--no-decode", "--save-tokens", tmp_path / "l.npy")
    assert long.returncode == 2 and "26 context frames leave no room in a 25-frame round" in long.stderr
    assert "backend:" not in long.stderr


def test_info_describes_a_checkpoint(tiny_checkpoint):
    result = run_terra("info", tiny_checkpoint)
    assert result.returncode == 0, result.stderr
    assert "LlamaActionForCausalLM" in result.stdout and "576 per frame" in result.stdout
    embedded = invoke_terra("info")  # no argument: the embedded terra-mini, as generate runs it
    assert embedded.returncode == 0 and "terra-mini" in embedded.stdout and "6 layers, hidden 384" in embedded.stdout


@pytest.mark.parametrize("args,message", [
    (["serve", "--picture-batch", "0"], "Invalid value for '--picture-batch'"),
    (["serve", "--picture-batch", "33"], "Invalid value for '--picture-batch'"),
    (["generate", "--no-such-flag"], "No such option: --no-such-flag"),
    (["tokenize"], "Missing argument 'INPUT'"),
    (["actions", "convert", "--bogus", "1"], "No such option: --bogus"),
])
def test_a_mistyped_command_line_is_one_error_line_naming_its_help(args, message):
    """Typer's own checks (ranges, unknown options, missing arguments) go through the same one-line format as
    terra's, exit 2, instead of Typer's box of several lines."""
    result = run_terra(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines
    assert lines[0].endswith(f"{' '.join(args[:2 if args[0] == 'actions' else 1])} --help)"), lines


def test_terra_alone_prints_its_help_and_help_exits_zero():
    alone, asked = run_terra(), run_terra("--help")
    assert alone.returncode == 2 and asked.returncode == 0
    for result in (alone, asked):
        assert "Usage:" in result.stdout + result.stderr and "serve" in result.stdout + result.stderr


def test_vllm_fp8_weights_on_a_cpu_are_one_line_before_any_engine_starts(tmp_path):
    pytest.importorskip("vllm")
    result = invoke_terra("generate", tmp_path / "q.mp4", "--frames", 5, "--actions", "left", "--backend", "vllm",
                          "--quantization", "fp8", "--device", "cpu")
    assert result.returncode == 2 and "--quantization fp8 on vLLM needs a CUDA GPU" in result.stderr, result.stderr
    assert "backend:" not in result.stderr and "Traceback" not in result.stderr
