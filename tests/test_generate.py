"""`terra generate` end to end, through a real subprocess, on the embedded terra-mini (`--backend hf`).

Generation on a 2-core CPU is the expensive part, so every run here generates one frame at most
(context K, --frames K+1), except the two-round run, which uses the tiny test checkpoint.
"""

import json
import shutil

import numpy as np
import pytest

from terra_cli.pipeline.rounds import RESEED_FRAMES, plan_rounds

from conftest import invoke_terra, run_terra

HF = ("--backend", "hf", "--device", "cpu")


@pytest.fixture(scope="module")
def tokenizer():
    from terra_cli.models.default import default_tokenizer_dir
    from tokenizer_decoder import ImageTokenizer

    return ImageTokenizer.from_pretrained(str(default_tokenizer_dir()), device="cpu")


def assert_fails(result, message):
    assert result.returncode != 0, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
def test_default_model_video_tokens_frames_and_determinism(tmp_path, tokenizer):
    import imageio.v2 as iio

    from terra_cli.models.default import DEFAULT_MODEL_LABEL, sample_context_frames
    from terra_cli.media.frames import read_frames

    video, tokens_path, frames_dir = tmp_path / "out.mp4", tmp_path / "t.npy", tmp_path / "frames"
    args = ["generate", video, "--frames", 4, "--actions", "left", "--seed", 3, *HF,
            "--save-tokens", tokens_path, "--save-frames", frames_dir]
    # Warnings as errors from the interpreter's start (as -W does): any FutureWarning or DeprecationWarning
    # that reaches the user fails this plain run; transformers' own "deprecated" log lines are checked in
    # the text (tests/test_deprecations.py: the KV cache's argument name).
    result = run_terra(*args, env={"PYTHONWARNINGS": "error::FutureWarning,error::DeprecationWarning"})
    assert result.returncode == 0, result.stderr
    printed = result.stdout + result.stderr
    assert "deprecat" not in printed.lower() and "FutureWarning" not in printed, printed
    assert DEFAULT_MODEL_LABEL.split(" (")[0] in result.stderr and "backend: hf" in result.stderr
    assert "4 frames (3 context + 1 generated" in result.stderr

    reader = iio.get_reader(str(video), format="FFMPEG")
    try:
        assert reader.count_frames() == 4
        assert reader.get_data(0).shape == (288, 512, 3)
        assert reader.get_meta_data()["fps"] == 10
    finally:
        reader.close()

    tokens = np.load(tokens_path)
    assert tokens.shape == (4, 576) and tokens.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() < 1024
    # The context is the embedded sample, encoded; the PNGs are the decoded tokens.
    np.testing.assert_array_equal(tokens[:3], tokenizer.tokenize(list(sample_context_frames(3))))
    pngs = read_frames(frames_dir)
    assert len(pngs) == 4
    np.testing.assert_array_equal(np.stack(pngs), tokenizer.decode_tokens(tokens))

    # Same seed, second run from the saved context tokens: the same tokens (determinism, and the
    # token file round-trips through --context-tokens).
    np.save(tmp_path / "ctx.npy", tokens[:3])
    again = invoke_terra("generate", "--frames", 4, "--actions", "left", "--seed", 3, *HF,
                      "--context-tokens", tmp_path / "ctx.npy", "--no-decode", "--save-tokens", tmp_path / "t2.npy")
    assert again.returncode == 0, again.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "t2.npy"), tokens)

    # Existing outputs are refused before any loading, each of them.
    assert_fails(invoke_terra(*args), "already exists")
    video.rename(tmp_path / "moved.mp4")
    assert_fails(invoke_terra(*args), "already exists")  # the tokens file
    tokens_path.unlink()
    assert_fails(invoke_terra(*args), "is not empty")  # the frames folder
    assert not video.exists() and not tokens_path.exists()


@pytest.mark.slow
def test_context_from_png_folder_and_video(tmp_path, tokenizer):
    from terra_cli.media.frames import read_frames, write_frames, write_video
    from terra_cli.synthetic.dataset import render_rollout
    from terra_cli.actions import preset_actions

    clip = render_rollout(11, preset_actions("straight", 5, 40.0))
    write_frames(tmp_path / "pngs", list(clip))
    write_video(tmp_path / "clip.mp4", list(clip))
    for source, expected in ((tmp_path / "pngs", list(clip)), (tmp_path / "clip.mp4", read_frames(tmp_path / "clip.mp4"))):
        out = tmp_path / f"{source.stem}.npy"
        result = invoke_terra("generate", "--context", source, "--context-frames", 2, "--frames", 3,
                           "--actions", "straight", "--temperature", 0, *HF, "--no-decode", "--save-tokens", out)
        assert result.returncode == 0, result.stderr
        tokens = np.load(out)
        assert tokens.shape == (3, 576)
        # The LAST two frames are the context (the most recent ones).
        np.testing.assert_array_equal(tokens[:2], tokenizer.tokenize(expected[-2:]))


def test_thirty_frames_run_in_two_rounds(tmp_path):
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.hf import generate_frames
    from terra_cli.models.modeling_hf import load_model
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    # 16 tokens a frame: the round schedule is the point, not the 576-token layout.
    tiny_checkpoint = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16))
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 512, size=(3, 16))
    acts = rng.normal(size=(30, 6, 3)).astype(np.float32)
    np.save(tmp_path / "ctx.npy", ctx)
    np.save(tmp_path / "acts.npy", acts)
    result = invoke_terra("generate", "--model", tiny_checkpoint, "--context-tokens", tmp_path / "ctx.npy",
                       "--actions", tmp_path / "acts.npy", "--frames", 30, "--temperature", 0, *HF,
                       "--no-decode", "--save-tokens", tmp_path / "out.npy")
    assert result.returncode == 0, result.stderr
    assert "2 rounds" in result.stderr and "2 round(s)" in result.stderr
    tokens = np.load(tmp_path / "out.npy")
    assert tokens.shape == (30, 16) and tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens[:3], ctx)

    rounds = plan_rounds(3, 30, 25)
    assert [(r.first_frame, r.context_frames, r.num_frames) for r in rounds] == [(0, 3, 25), (22, RESEED_FRAMES, 8)]
    # Round 2 is the model run afresh on frames 22-24 as context (temporal positions restart).
    model = load_model(tiny_checkpoint)
    second = generate_frames(model, tokens[22:25], acts[22:29], 8, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(tokens[22:30], second)


def test_bad_inputs_give_one_line_errors(tmp_path, tiny_checkpoint):
    np.save(tmp_path / "bad_shape.npy", np.zeros((5, 5, 3), dtype=np.float32))
    nan = np.zeros((5, 6, 3), dtype=np.float32)
    nan[2, 1, 0] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    np.save(tmp_path / "short.npy", np.zeros((3, 6, 3), dtype=np.float32))
    np.save(tmp_path / "ctx.npy", np.zeros((2, 576), dtype=np.int64))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty_model").mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", no_weights / "config.json")
    mismatched = tmp_path / "mismatched"
    shutil.copytree(tiny_checkpoint, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["intermediate_size"] += 32
    (mismatched / "config.json").write_text(json.dumps(config))

    out = tmp_path / "o.mp4"
    tokens_only = ["--context-tokens", tmp_path / "ctx.npy", "--no-decode", "--save-tokens", tmp_path / "o.npy"]
    cases = [
        ("shape (frames, 6, 3)", [out, "--actions", tmp_path / "bad_shape.npy", "--frames", 4]),
        ("NaN or inf", [out, "--actions", tmp_path / "nan.npy", "--frames", 4]),
        ("need actions for at least 5 frames", [out, "--actions", tmp_path / "short.npy", "--frames", 6]),
        ("above the supported maximum of 100", [out, "--actions", "straight", "--frames", 101]),
        ("does not exist", [out, "--actions", "straight", "--frames", 4, "--context", tmp_path / "missing.png"]),
        ("cannot read image", [out, "--actions", "straight", "--frames", 4, "--context", tmp_path / "broken.png"]),
        ("has no config.json", ["--model", tmp_path / "empty_model", "--actions", "straight", "--frames", 4, *tokens_only]),
        ("has neither model.safetensors", ["--model", no_weights, "--actions", "straight", "--frames", 4, *tokens_only]),
        ("does not match its config", ["--model", mismatched, "--actions", "straight", "--frames", 4, *tokens_only]),
        ("without an image tokenizer", [out, "--model", tiny_checkpoint, "--actions", "straight", "--frames", 4]),
        ("512 (vocab_size - 1)", ["--model", tiny_checkpoint, "--tokenizer", _default_tokenizer(), "--actions",
                                  "straight", "--frames", 4, "--no-decode", "--save-tokens", tmp_path / "o.npy"]),
        ("is not a directory", [tmp_path / "a_file" / "o.mp4", "--actions", "straight", "--frames", 4]),
        ("no OUTPUT video given", ["--actions", "straight", "--frames", 4]),
        ("--no-decode needs --save-tokens", ["--no-decode", "--actions", "straight", "--frames", 4]),
    ]
    for message, extra in cases:
        result = invoke_terra("generate", *HF, *extra)
        assert_fails(result, message)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], result.stderr
    assert not out.exists() and not (tmp_path / "o.npy").exists()


def _default_tokenizer():
    from terra_cli.models.default import default_tokenizer_dir

    return default_tokenizer_dir()


def test_sampled_rounds_are_seeded_per_round_and_repeatable(tmp_path):
    from dataclasses import replace

    from terra_cli.backends.base import Sampling
    from terra_cli.backends.hf import HfBackend
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.pipeline.rounds import generate_tokens

    # 16 tokens a frame and 5-frame rounds: 11 frames from 2 context frames take 4 sampled rounds.
    checkpoint = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_tokens=16, max_frames=5))
    backend = HfBackend(checkpoint, device="cpu", dtype="float32")
    rng = np.random.default_rng(4)
    ctx = rng.integers(0, 512, size=(2, 2, 16))
    acts = rng.normal(size=(2, 11, 6, 3)).astype(np.float32)
    sampling = Sampling(temperature=0.9, seed=21)
    tokens = generate_tokens(backend, ctx, acts, 11, sampling)
    np.testing.assert_array_equal(generate_tokens(backend, ctx, acts, 11, sampling), tokens)
    assert (generate_tokens(backend, ctx, acts, 11, replace(sampling, seed=22)) != tokens).any()

    rounds = plan_rounds(2, 11, 5)
    assert [(r.first_frame, r.context_frames, r.num_frames) for r in rounds] == [(0, 2, 5), (2, 3, 5), (4, 3, 5), (6, 3, 5)]
    for rnd in rounds:
        # Each round is the backend run afresh on the last frames of the one before; its draws follow
        # the frames' index in the whole video (terra_cli/seeds.py), so no round repeats another's stream.
        again = backend.generate(tokens[:, rnd.first_frame : rnd.first_frame + rnd.context_frames],
                                 acts[:, rnd.first_frame : rnd.end - 1], rnd.num_frames, sampling,
                                 first_frame=rnd.first_frame)
        np.testing.assert_array_equal(again, tokens[:, rnd.first_frame : rnd.end])
        if rnd.first_frame:
            restarted = backend.generate(tokens[:, rnd.first_frame : rnd.first_frame + rnd.context_frames],
                                         acts[:, rnd.first_frame : rnd.end - 1], rnd.num_frames, sampling)
            assert (restarted != again).any()
    # A rollout's frames do not depend on its batch neighbour.
    alone = generate_tokens(backend, ctx[1:], acts[1:], 11, replace(sampling, seed=sampling.seed + 1))
    np.testing.assert_array_equal(alone[0], tokens[1])
