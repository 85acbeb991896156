"""`POST /v1/sessions/{id}/fork`: a new session holding the parent's frames that draws with the
lineage's branch seed (terra_cli/seeds.py), as terra_cli.env's fork does; the reference backend on
a tiny model with five-frame rounds, so the fork's frames roll over into round 2."""

from __future__ import annotations

import io

import numpy as np
import pytest

from server_helpers import context_tokens, serve_checkpoint

pytest.importorskip("fastapi")

SEED = 17


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serve_checkpoint(tmp_path_factory.mktemp("fork_model"))


@pytest.fixture(scope="module")
def client(checkpoint, frame_tokenizer):
    from fastapi.testclient import TestClient

    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, load_engine

    engine = load_engine(EngineConfig(model=str(checkpoint), tokenizer=frame_tokenizer, backend="hf",
                                      device="cpu", dtype="float32", threads=1))
    with TestClient(create_app(engine, Settings(max_sessions=3, session_timeout=120))) as test_client:
        yield test_client


def tokens_of(client, session_id: str) -> np.ndarray:
    return np.load(io.BytesIO(client.get(f"/v1/sessions/{session_id}/tokens").content))


def test_a_fork_copies_the_frames_and_draws_with_the_branch_seed(client, checkpoint):
    from terra_cli.actions import preset_actions
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.driver import RolloutJob, run_lockstep
    from terra_cli.backends.hf import HfBackend
    from terra_cli.seeds import branch_seed

    context = context_tokens(3, seed=4)
    parent = client.post("/v1/sessions", json={"context": {"tokens": context}, "seed": SEED}).json()["id"]
    assert client.post(f"/v1/sessions/{parent}/step", json={"action": "left", "frames": 2}).status_code == 200
    forked = client.post(f"/v1/sessions/{parent}/fork")
    assert forked.status_code == 201, forked.text
    child = forked.json()
    assert child["seed"] == branch_seed(SEED, 1) and child["parent"] == parent and child["frames"] == 5
    assert forked.headers["Location"] == f"/v1/sessions/{child['id']}"
    state = tokens_of(client, parent)
    np.testing.assert_array_equal(tokens_of(client, child["id"]), state)

    for session in (parent, child["id"]):
        step = client.post(f"/v1/sessions/{session}/step", json={"action": "straight", "frames": 2})
        assert [f["index"] for f in step.json()["frames"]] == [5, 6]
    # Re-run frames 5 and 6 from the state: round 2 holds frames 2..6, its context frames 2..4.
    left, straight = preset_actions("left", 1, 30.0)[0], preset_actions("straight", 1, 30.0)[0]
    rows = np.stack([left, left, left, left, left, straight])[2:]  # the context rows are the first step's
    backend = HfBackend(checkpoint, device="cpu", dtype="float32")
    for session, seed in ((parent, SEED), (child["id"], child["seed"])):
        job = RolloutJob("rerun", state[2:5], rows, 5, Sampling(seed=seed), frame_offset=2)
        np.testing.assert_array_equal(tokens_of(client, session)[5:], run_lockstep(backend.driver(1), [job])[0, 3:])
    assert (tokens_of(client, parent)[5:] != tokens_of(client, child["id"])[5:]).mean() > 0.5

    grandchild = client.post(f"/v1/sessions/{child['id']}/fork").json()  # the lineage counts on
    assert grandchild["seed"] == branch_seed(SEED, 2) and grandchild["frames"] == 7
    full = client.post(f"/v1/sessions/{parent}/fork")  # three sessions: the cap
    assert full.status_code == 429, full.text
    assert client.post("/v1/sessions/s-nothing/fork").status_code == 404
