"""`terra serve`'s API in this process (FastAPI's TestClient): jobs, sessions, streaming, cancel,
expiry, auth, caps, bad requests and a client that goes away, on a tiny model and the reference
backend. One engine for the module; apps for auth and caps share it without their lifespan. Its
frames decode with conftest's frame_tokenizer (Terra's frame size and codes, a third of the
embedded tokenizer's decode time)."""

from __future__ import annotations

import base64
import io
import threading
import time

import numpy as np
import pytest

from server_helpers import SERVE_MAX_FRAMES, context_tokens, serve_checkpoint, wait_for, wait_job

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serve_checkpoint(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="module")
def engine(checkpoint, frame_tokenizer):
    import torch

    from terra_cli.server.loader import EngineConfig, load_engine

    threads = torch.get_num_threads()  # threads=1 sets the process's; later modules' CPU decoding rounds with the default
    service = load_engine(EngineConfig(model=str(checkpoint), tokenizer=frame_tokenizer, backend="hf",
                                       device="cpu", dtype="float32", threads=1))
    yield service
    service.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from terra_cli.server.app import Settings, create_app

    with TestClient(create_app(engine, Settings(max_sessions=4, session_timeout=120))) as test_client:
        yield test_client  # leaving runs the app's shutdown, which closes the engine


def test_health_and_the_client_say_when_the_weights_are_an_approximation(engine, monkeypatch):
    """A server whose backend reads fp8 weights (`--quantization fp8`) says so in /health, and
    `terra generate --server`'s line repeats it; the checkpoint's own weights add nothing."""
    from terra_cli.backends.base import weights_note

    assert weights_note(None) == ""
    monkeypatch.setattr(engine, "quantization", "fp8")
    health = side_app(engine).get("/health").json()
    assert health["quantization"] == "fp8"
    assert weights_note(health["quantization"]) == ", fp8 weights (an approximation of the model)"


def side_app(engine, **settings):
    """Another app on the same engine, without lifespan (so it does not close the engine)."""
    from fastapi.testclient import TestClient

    from terra_cli.server.app import Settings, create_app

    return TestClient(create_app(engine, Settings(**settings)))


def png_b64(width=64, height=36, color=(90, 120, 160)) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_health_openapi_and_page(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["backend"] == "hf" and health["quantization"] is None
    assert (health["max_frames"], health["round_frames"]) == (100, SERVE_MAX_FRAMES)  # the cap, the model's round
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/videos", "/v1/videos/{video_id}/content", "/v1/sessions/{session_id}/step"} <= set(paths)
    assert "swagger" in client.get("/docs").text.lower()
    page = client.get("/")
    assert page.status_code == 200 and 'id="frame"' in page.text
    for name in ("/", "/static/app.js", "/static/style.css"):  # nothing from another host: no CDN
        assert "://" not in client.get(name).text
    assert client.get("/static/../app.py").status_code == 404


def test_video_job_tokens_match_the_reference_and_mp4_is_written(client, checkpoint):
    from terra_cli.actions import preset_actions
    from terra_cli.backends import Sampling
    from terra_cli.backends.hf import HfBackend
    from terra_cli.pipeline.rounds import generate_tokens

    context = context_tokens(3, seed=1)
    reply = client.post("/v1/videos", json={"id": "left-1", "context": {"tokens": context}, "actions": "left",
                                            "frames": 4, "seed": 5, "tokens": True})
    assert reply.status_code == 202, reply.text
    job = wait_job(client, reply.json()["id"])
    assert job["status"] == "done" and job["progress"] == 1.0 and job["label"] == "left-1"
    assert 0 < job["generation_seconds"] <= job["seconds"]
    video = client.get(f"/v1/videos/{job['id']}/content")
    assert video.headers["content-type"] == "video/mp4" and video.content[4:8] == b"ftyp"
    tokens = np.load(io.BytesIO(client.get(f"/v1/videos/{job['id']}/content", params={"format": "npy"}).content))
    expected = generate_tokens(HfBackend(checkpoint, device="cpu", dtype="float32"), np.array(context),
                               preset_actions("left", 4, 30.0), 4, Sampling(seed=5))[0]
    np.testing.assert_array_equal(tokens, expected)
    assert client.get("/v1/videos").json()["videos"]
    # a frame of the kept tokens as a picture (read back through terra's .npy reader), and past the last one a 404
    assert client.get(f"/v1/videos/{job['id']}/frames/3").content[:4] == b"\x89PNG"
    past = client.get(f"/v1/videos/{job['id']}/frames/4")
    assert past.status_code == 404 and "frames 0..3" in past.text, past.text


def test_cancel_a_running_job(client):
    reply = client.post("/v1/videos", json={"context": {"tokens": context_tokens(1)}, "actions": "straight",
                                            "frames": 12})
    job_id = reply.json()["id"]
    assert client.delete(f"/v1/videos/{job_id}").status_code == 200
    job = wait_job(client, job_id)
    assert job["status"] == "cancelled" and job["generated_frames"] < 11
    assert client.get(f"/v1/videos/{job_id}/content").status_code == 409
    assert client.delete("/v1/videos/v-nope").status_code == 404


def test_a_cancel_while_a_job_is_handed_to_the_engine_is_not_lost(client, engine, monkeypatch):
    """The DELETE lands after the job turned "running" and before the engine holds it."""
    submit, cancels = engine.submit, []

    def submit_with_a_cancel_between(job, handlers, **kwargs):
        if job.key.startswith("v-"):
            cancel = threading.Thread(target=lambda: cancels.append(client.delete(f"/v1/videos/{job.key}")))
            cancel.start()
            cancel.join(0.5)  # the cancel waits for the hand-over (fixed), or runs now and finds nothing (the bug)
        submit(job, handlers, **kwargs)

    monkeypatch.setattr(engine, "submit", submit_with_a_cancel_between)
    reply = client.post("/v1/videos", json={"context": {"tokens": context_tokens(1)}, "actions": "straight", "frames": 4})
    job = wait_job(client, reply.json()["id"])
    wait_for(lambda: cancels, 30)
    assert cancels[0].status_code == 200 and job["status"] == "cancelled", job


def test_session_steps_roll_over_into_rounds_and_stream(client):
    from PIL import Image

    created = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(3, seed=2)}, "seed": 3})
    assert created.status_code == 201, created.text
    session_id = created.json()["id"]
    step = client.post(f"/v1/sessions/{session_id}/step", json={"action": "left", "frames": 2})
    assert step.status_code == 200, step.text
    frames = step.json()["frames"]
    assert [f["index"] for f in frames] == [3, 4]
    assert Image.open(io.BytesIO(base64.b64decode(frames[-1]["image"]))).size == (512, 288)
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as socket:
        replayed = [socket.receive_json() for _ in range(5)]
        assert [m["index"] for m in replayed] == [0, 1, 2, 3, 4] and all(m["replay"] for m in replayed)
        socket.send_json({"action": "faster"})  # frame 5: past the 5-frame round, re-seeded from frames 2..4
        message = socket.receive_json()
        assert message["index"] == 5 and "replay" not in message and message["speed_kmh"] > 30.0
        socket.send_json({"action": "sideways"})
        assert socket.receive_json() == {"type": "error", "field": "action",
                                         "message": "action must be one of straight, left, right, faster, brake "
                                                    "or (6, 3) waypoints, got 'sideways'"}
    # the socket closing closed the session
    wait_for(lambda: client.get(f"/v1/sessions/{session_id}").status_code == 404, 60)


def test_a_session_picture_is_the_frame_its_video_holds(client, engine):
    """The server decodes every picture one frame a call: a frame's picture is the same alone or in a video."""
    from PIL import Image

    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(3, seed=4)}, "seed": 5}).json()["id"]
    step = client.post(f"/v1/sessions/{session_id}/step", json={"action": "right", "frames": 2, "format": "png"})
    assert step.status_code == 200, step.text
    tokens = np.load(io.BytesIO(client.get(f"/v1/sessions/{session_id}/tokens").content))
    video = engine.tokenizer.decode_tokens(tokens, batch_size=1)  # the five frames in one call
    last = np.asarray(Image.open(io.BytesIO(base64.b64decode(step.json()["frames"][-1]["image"]))))
    assert np.array_equal(last, video[4])
    first = client.get(f"/v1/sessions/{session_id}/frames/1", params={"format": "png"})
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(first.content))), video[1])
    assert engine.warm_up_pictures() == 0.0  # nothing compiles on the CPU
    metrics = dict(line.split() for line in client.get("/metrics").text.splitlines() if not line.startswith("#"))
    assert float(metrics["terra_pictures_total"]) >= 3 and float(metrics["terra_engine_steps_total"]) > 0
    assert 0 < float(metrics["terra_engine_step_seconds_total"]) and metrics["terra_prompts_reused_total"] == "0"
    client.delete(f"/v1/sessions/{session_id}")


def test_a_tokens_step_answers_codes_and_decodes_no_picture(client, engine):
    """`"format": "tokens"`: each frame's message holds the frame's codes (those /tokens then holds) and no image,
    and no picture is decoded for it; /frames/{i} decodes that frame's picture when asked. The socket replays its
    held frames as ?format= says (tokens: codes, no picture; another format is closed with 4422)."""
    from PIL import Image
    from starlette.websockets import WebSocketDisconnect

    def pictures_decoded() -> float:
        lines = client.get("/metrics").text.splitlines()
        return float(dict(line.split() for line in lines if not line.startswith("#"))["terra_pictures_total"])

    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(2, seed=8)}, "seed": 9}).json()["id"]
    before = pictures_decoded()
    step = client.post(f"/v1/sessions/{session_id}/step", json={"action": "left", "frames": 2, "format": "tokens"})
    assert step.status_code == 200, step.text
    assert pictures_decoded() == before
    tokens = np.load(io.BytesIO(client.get(f"/v1/sessions/{session_id}/tokens").content))
    frames = step.json()["frames"]
    assert [frame["index"] for frame in frames] == [2, 3] and all("image" not in frame for frame in frames)
    assert all(frame["format"] == "tokens" for frame in frames)
    assert np.array_equal(np.array([frame["tokens"] for frame in frames]), tokens[2:4])
    later = client.get(f"/v1/sessions/{session_id}/frames/3", params={"format": "png"})
    assert pictures_decoded() == before + 1
    picture = np.asarray(Image.open(io.BytesIO(later.content)))
    assert np.array_equal(picture, engine.tokenizer.decode_tokens(tokens[3:4], batch_size=1)[0])
    bad = client.post(f"/v1/sessions/{session_id}/step", json={"format": "npy"})
    assert bad.status_code == 422 and bad.json()["error"] == {
        "field": "format", "message": "format must be jpeg, png or tokens, got 'npy'"}, bad.text
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect(f"/v1/sessions/{session_id}/stream?format=gif") as socket:
            socket.receive_json()
    assert refused.value.code == 4422 and refused.value.reason == "format must be jpeg, png or tokens, got 'gif'"
    # the same on the socket, its replay of the held frames too
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream?format=tokens") as socket:
        replayed = [socket.receive_json() for _ in range(4)]
        assert [m["index"] for m in replayed] == [0, 1, 2, 3] and all(m["replay"] for m in replayed)
        assert np.array_equal(np.array([m["tokens"] for m in replayed]), tokens)
        # each replayed frame where it was driven (the context's at the start), not where the session is now
        assert [(m["position"], m["speed_kmh"]) for m in replayed[2:]] == [(f["position"], f["speed_kmh"]) for f in frames]
        assert [m["position"] for m in replayed[:2]] == [[0.0, 0.0]] * 2 != [frames[-1]["position"]] * 2
        socket.send_json({"action": "right", "format": "tokens"})
        message = socket.receive_json()
        assert message["index"] == 4 and "image" not in message and len(message["tokens"]) == tokens.shape[1]
    assert pictures_decoded() == before + 1


def test_a_replayed_frame_carries_its_own_position_and_speed(client):
    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(2, seed=3)}}).json()["id"]
    step = client.post(f"/v1/sessions/{session_id}/step", json={"action": "faster", "frames": 2, "format": "tokens"})
    assert step.status_code == 200, step.text
    live = [(f["position"], f["speed_kmh"]) for f in step.json()["frames"]]
    assert live[0] != live[1]  # it moved and sped up
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream?format=tokens") as socket:
        replayed = [socket.receive_json() for _ in range(4)]
    assert [(m["position"], m["speed_kmh"]) for m in replayed[2:]] == live
    assert [(m["position"], m["speed_kmh"]) for m in replayed[:2]] == [([0.0, 0.0], replayed[0]["speed_kmh"])] * 2
    assert replayed[0]["speed_kmh"] < live[0][1]  # the context's speed: the one the session opened with
    client.delete(f"/v1/sessions/{session_id}")


def test_pictures_in_padded_batches_do_not_depend_on_their_batchmates(client, engine, monkeypatch):
    """`terra serve --picture-batch N`: every picture call padded to N frames, so a frame's picture is the same
    alone or decoded with others, as at the default of one frame a call."""
    from terra_cli.errors import InputError
    from terra_cli.server.loader import EngineConfig, check_engine_config

    assert engine.picture_batch == 1  # load_engine's default
    for bad in (0, 33):
        with pytest.raises(InputError, match=f"--picture-batch must be 1 to 32 frames, got {bad}"):
            check_engine_config(EngineConfig(picture_batch=bad))
    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(2, seed=6)}, "seed": 7}).json()["id"]
    assert client.post(f"/v1/sessions/{session_id}/step", json={"action": "left", "frames": 1}).status_code == 200
    tokens = np.load(io.BytesIO(client.get(f"/v1/sessions/{session_id}/tokens").content))
    client.delete(f"/v1/sessions/{session_id}")
    monkeypatch.setattr(engine, "picture_batch", 2)
    calls = []
    original = engine.tokenizer.decode_tokens
    monkeypatch.setattr(engine.tokenizer, "decode_tokens",
                        lambda rows, **kwargs: calls.append(kwargs) or original(rows, **kwargs))
    together = engine.decode(tokens)  # three frames: a batch of 2 and one padded to 2
    alone = [engine.decode(tokens[i:i + 1])[0] for i in range(len(tokens))]
    assert len(calls) == 4 and all(call == {"full_batches": True, "batch_size": 2} for call in calls)
    for i, picture in enumerate(alone):
        assert np.array_equal(picture, together[i]), i


def test_session_reset_video_frames_and_cap(client):
    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(2)}}).json()["id"]
    assert client.post(f"/v1/sessions/{session_id}/step", json={"action": "right"}).status_code == 200
    body = client.get(f"/v1/sessions/{session_id}").json()
    assert body["frames"] == 3 and body["path"][-1][1] < 0  # right: y (left) goes negative
    assert client.get(f"/v1/sessions/{session_id}/frames/2", params={"format": "png"}).content[:4] == b"\x89PNG"
    assert client.get(f"/v1/sessions/{session_id}/video").content[4:8] == b"ftyp"
    assert client.post(f"/v1/sessions/{session_id}/reset").json()["frames"] == 2
    too_many = client.post(f"/v1/sessions/{session_id}/step", json={"frames": 26})
    assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "frames"
    assert client.delete(f"/v1/sessions/{session_id}").status_code == 200
    assert client.post(f"/v1/sessions/{session_id}/step", json={}).status_code == 404


def test_a_draining_server_answers_new_work_503_and_health_says_so(engine):
    """A request that reaches the app once a stop signal has marked it draining (the signal handler
    sets it at once; uvicorn closes its listener and idle connections a moment later)."""
    api = side_app(engine)
    api.app.state.draining = True
    refused = api.post("/v1/videos", json={"actions": "left", "frames": 4})
    assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit()
    assert refused.json()["error"]["message"].startswith("the server is shutting down")
    health = api.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert api.get("/v1/videos").status_code == 200  # reading what is there still works


def test_idle_session_expires(client):
    sessions = client.app.state.sessions
    saved, sessions.timeout = sessions.timeout, 0.3
    try:
        session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(1)}}).json()["id"]
        assert client.get(f"/v1/sessions/{session_id}").status_code == 200  # it was there to expire
        wait_for(lambda: client.get(f"/v1/sessions/{session_id}").status_code == 404, 30)
    finally:
        sessions.timeout = saved


def test_disconnect_mid_stream_frees_the_session(client):
    session_id = client.post("/v1/sessions", json={"context": {"tokens": context_tokens(1)}}).json()["id"]
    with client.websocket_connect(f"/v1/sessions/{session_id}/stream") as socket:
        assert socket.receive_json()["type"] == "frame"  # the held context frame: the session is live
        socket.send_json({"action": "left", "frames": 3})
    wait_for(lambda: client.get(f"/v1/sessions/{session_id}").status_code == 404, 60)
    wait_for(lambda: client.app.state.engine.in_flight == 0, 60)


def test_api_key_is_required_when_set(engine):
    from starlette.websockets import WebSocketDisconnect

    key = "s3cret-0123456789abcdef"
    guarded = side_app(engine, api_key=key)
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/").status_code == 200  # the page asks for the key itself
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": key[:-1]}):
        reply = guarded.get("/v1/videos", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["field"] == "authorization"
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/v1/videos", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert guarded.get("/v1/videos", headers={"X-API-Key": key}).status_code == 200
    # ?key= is for the browser's WebSocket only: on HTTP it would land in access logs and history
    assert guarded.get(f"/v1/videos?key={key}").status_code == 401
    assert guarded.get(f"/metrics?key={key}").status_code == 401
    for url, code in (("/v1/sessions/s-x/stream", 4401), (f"/v1/sessions/s-x/stream?key={key[:-1]}", 4401),
                      (f"/v1/sessions/s-x/stream?key={key}", 4404)):  # past the key: no such session
        with pytest.raises(WebSocketDisconnect) as closed:
            with guarded.websocket_connect(url) as socket:
                socket.receive_json()
        assert closed.value.code == code


@pytest.mark.parametrize("key", ["", " ", "   \t", " s3cret-0123456789abcdef", "s3cret-0123456789abcdef\n", "s3cret"])
def test_blank_padded_or_short_api_keys_are_refused(key):
    from terra_cli.errors import InputError
    from terra_cli.server.app import Settings

    with pytest.raises(InputError, match="--api-key"):
        Settings(api_key=key)


def test_caps_answer_429_413_with_the_field(engine):
    from terra_cli.server.requests import Limits

    capped = side_app(engine, max_sessions=1, max_queued_jobs=1, max_upload_bytes=20_000)
    capped.app.state.sessions.sessions["s-held"] = None  # one session's place is taken
    full = capped.post("/v1/sessions", json={"context": {"tokens": context_tokens(1)}})
    assert full.status_code == 429 and int(full.headers["Retry-After"]) > 0
    job = capped.post("/v1/videos", json={"context": {"tokens": context_tokens(1)}, "actions": "left", "frames": 6})
    assert job.status_code == 202
    queued = capped.post("/v1/videos", json={"context": {"tokens": context_tokens(1)}, "actions": "left", "frames": 3})
    assert queued.status_code == 429 and "Retry-After" in queued.headers
    capped.delete(f"/v1/videos/{job.json()['id']}")
    big = capped.post("/v1/videos", json={"actions": "left", "context": {"images": ["A" * 30_000]}})
    assert big.status_code == 413 and big.json()["error"]["field"] == "body"
    pixels = side_app(engine, limits=Limits(max_image_pixels=1000))
    reply = pixels.post("/v1/videos", json={"actions": "left", "context": {"images": [png_b64(64, 36)]}})
    assert reply.status_code == 413 and reply.json()["error"]["field"] == "context.images[0]"
    assert "terra_requests_rejected_total 2" in capped.get("/metrics").text


BAD_VIDEOS = [
    ("body", "not json"),
    ("actions", {"frames": 5}),
    ("frames", {"actions": "left", "frames": "many"}),
    ("frames", {"actions": "left", "frames": 101}),
    ("frames", {"actions": "left", "frames": 3, "context": {"tokens": context_tokens(3)}}),
    ("surprise", {"actions": "left", "surprise": 1}),
    ("actions", {"actions": "zigzag"}),
    ("actions", {"actions": [[1, 2]]}),
    ("actions", {"actions": {"instruction_trajs": "no"}}),
    ("actions", {"actions": [[[0, 1, 0.45]] * 6] * 2, "frames": 10}),
    ("temperature", {"actions": "left", "temperature": 1e9}),
    ("top_p", {"actions": "left", "top_p": 0}),
    ("seed", {"actions": "left", "seed": -1}),
    ("speed", {"actions": "left", "speed": 1e6}),
    ("id", {"actions": "left", "id": "../etc"}),
    ("context", {"actions": "left", "context": "/etc/passwd"}),
    ("context", {"actions": "left", "context": 5}),
    ("context.images", {"actions": "left", "context": {"images": []}}),
    ("context.images[0]", {"actions": "left", "context": {"images": ["%%%"]}}),
    ("context.images[0]", {"actions": "left", "context": {"images": [base64.b64encode(b"not an image").decode()]}}),
    ("context.video", {"actions": "left", "context": {"video": base64.b64encode(b"not a video").decode()}}),
    ("context.tokens", {"actions": "left", "context": {"tokens": [[1, 2], [3]]}}),
    ("context.tokens", {"actions": "left", "context": {"tokens": "abc"}}),
    ("context.tokens", {"actions": "left", "context": {"tokens": [[1, 2]]}}),  # issue 38: these were 202, then failed
    ("context.tokens", {"actions": "left", "context": {"tokens": [[5000] * 576]}}),
    ("context.tokens", {"actions": "left", "context": {"tokens": [[-1] * 576]}}),
    ("context.tokens", {"actions": "left", "context": {"tokens": [[2**70] * 576]}}),
    ("context_frames", {"actions": "left", "context_frames": 0}),
    ("context_frames", {"actions": "left", "context": {"tokens": context_tokens(1)}, "context_frames": 2}),
    # issue 38: the field as the client named it, not pydantic's union branch; true is not a number
    ("id", {"actions": "left", "id": True}),
    ("id", {"actions": "left", "id": [1]}),
    ("seed", {"actions": "left", "seed": True}),
    ("temperature", {"actions": "left", "temperature": False}),
    ("frames", {"actions": "left", "frames": True}),
    ("actions", {"actions": 5}),
    ("actions", {"actions": [[[10**400, 0, 0.5]] + [[0, 0, 1]] * 5] * 3, "frames": 4}),  # was a 500: float overflow
    # was a 202, then a job that failed: no room in a round for a generated frame
    ("context_frames", {"actions": "left", "frames": SERVE_MAX_FRAMES + 2, "context": {"tokens": context_tokens(SERVE_MAX_FRAMES)}}),
]


@pytest.mark.parametrize("field,body", BAD_VIDEOS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_VIDEOS)])
def test_malformed_video_requests_are_4xx_naming_the_field(engine, field, body):
    api = side_app(engine)
    reply = (api.post("/v1/videos", content=body, headers={"Content-Type": "application/json"})
             if isinstance(body, str) else api.post("/v1/videos", json=body))
    assert 400 <= reply.status_code < 500, reply.text
    assert reply.json()["error"]["field"] == field, reply.json()


def test_validation_errors_name_the_field_in_each_part_of_the_body(engine):
    from terra_cli.server.app import field_of

    api = side_app(engine)
    for body, field in (("not json", "body"), ('{"actions": "left", "frames": "many"}', "frames")):
        reply = api.post("/v1/videos", content=body, headers={"Content-Type": "application/json"})
        answer = reply.json()
        assert reply.status_code == 422 and answer["error"]["field"] == field, answer
        assert answer["error"]["message"].startswith(f"{field}: ") and answer["errors"][0]["field"] == field, answer
    # pydantic's locations: where the field came from and the union member tried are not the client's
    assert field_of(("body", "actions", 2, "float")) == "actions[2]" and field_of(("query", "format")) == "format"
    assert field_of(("body",)) == "body" and field_of(("body", "seed", "int")) == "seed"


def test_malformed_session_requests(engine):
    api = side_app(engine)
    unknown = api.post("/v1/videos", json={"actions": "zigzag"})
    assert unknown.status_code == 422 and unknown.json()["error"]["message"].startswith("'zigzag' is not a preset (")
    for tokens in ([[1, 2]], [[5000] * 576], [[-1] * 576]):  # the same check as a video job's
        reply = api.post("/v1/sessions", json={"context": {"tokens": tokens}})
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "context.tokens"
    out_of_range = api.post("/v1/sessions", json={"context": {"tokens": [[5000] * 576]}})
    assert out_of_range.status_code == 422 and out_of_range.json()["error"]["field"] == "context.tokens"
    too_long = api.post("/v1/sessions", json={"context": {"tokens": context_tokens(SERVE_MAX_FRAMES)}})
    assert too_long.status_code == 422 and too_long.json()["error"]["field"] == "context_frames"
    assert api.post("/v1/sessions/s-missing/step", json={}).json()["error"]["field"] == "session_id"
    bad_step = api.post("/v1/sessions/s-missing/step", json={"action": 5})
    assert bad_step.status_code == 422 and bad_step.json()["error"]["field"] == "action", bad_step.json()
    bad_index = api.get("/v1/videos/v-missing/frames/abc")
    assert bad_index.status_code == 422 and bad_index.json()["error"]["field"] == "index", bad_index.json()
    assert api.get("/v1/videos/v-missing").status_code == 404


def test_paths_only_inside_data_root(engine, tmp_path):
    from PIL import Image

    from terra_cli.server.requests import Limits

    root = tmp_path / "root"
    root.mkdir()
    Image.new("RGB", (64, 36)).save(root / "ctx.png")
    (tmp_path / "secret.png").write_bytes((root / "ctx.png").read_bytes())
    api = side_app(engine, limits=Limits(data_root=root))
    outside = api.post("/v1/videos", json={"actions": "left", "context": "../secret.png", "frames": 3})
    assert outside.status_code == 403 and outside.json()["error"]["field"] == "context"
    missing = api.post("/v1/videos", json={"actions": "left", "context": "nope.png", "frames": 3})
    assert missing.status_code == 404
    np.save(root / "narrow.npy", np.zeros((1, 7), dtype=np.int64))
    narrow = api.post("/v1/videos", json={"actions": "left", "context": "narrow.npy", "frames": 3})
    assert narrow.status_code == 422 and narrow.json()["error"]["field"] == "context", narrow.text
    inside = api.post("/v1/videos", json={"actions": "left", "context": "ctx.png", "frames": 3})
    assert inside.status_code == 202, inside.text
    api.delete(f"/v1/videos/{inside.json()['id']}")
    time.sleep(0.1)


@pytest.mark.parametrize("field", ["context", "actions"])
def test_paths_that_are_not_plain_names_are_4xx_naming_the_field(engine, tmp_path, field):
    """Issue 38: a NUL byte, a 5000-character name or a symlink loop under --data-root was a 500."""
    from terra_cli.server.requests import Limits

    root = tmp_path / "root"
    root.mkdir()
    (root / "a.png").symlink_to(root / "b.png")
    (root / "b.png").symlink_to(root / "a.png")
    (root / "loop").symlink_to(root / "loop")
    api = side_app(engine, limits=Limits(data_root=root))
    for value, says in (("a\0b.png", "NUL"), ("x" * 5000 + ".png", "too long"), ("y/" * 2100 + "z.npy", "too long"),
                        ("a.png", "symbolic link loop"), ("loop/c.npy", "symbolic link loop")):
        body = {"actions": "left", "frames": 5, field: value}
        reply = api.post("/v1/videos", json=body)
        assert 400 <= reply.status_code < 500, (value[:20], reply.text)
        error = reply.json()["error"]
        assert error["field"] == field and says in error["message"], (value[:20], error)
        assert len(error["message"]) < 400


def _png_claiming(width: int, height: int) -> str:
    """A PNG header for a huge image with almost no data (a decompression bomb's shape), base64."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def test_decompression_bomb_is_refused_before_decoding(engine):
    reply = side_app(engine).post("/v1/videos", json={"actions": "left", "context": {"images": [_png_claiming(60000, 60000)]}})
    assert reply.status_code == 413 and reply.json()["error"]["field"] == "context.images[0]"


def test_fuzzed_bodies_never_get_a_5xx(engine):
    """Seeded random mutations of valid bodies on every POST route: each answer is a JSON 2xx/4xx."""
    rng = np.random.default_rng(27)
    api = side_app(engine, max_queued_jobs=1000)
    session_id = api.post("/v1/sessions", json={"context": {"tokens": context_tokens(1)}}).json()["id"]
    values = [None, True, -1, 0, 2**70, 1.5, float("1e308"), "", "left", "sample", "x" * 300, [], [1], [[1, 2, 3]] * 6,
              {}, {"images": 3}, {"tokens": [[-5] * 576]}, {"video": ""}, {"instruction_trajs": [[0]]}, "../../etc/passwd"]
    routes = {"/v1/videos": {"actions": "left", "frames": 4, "context": "sample", "seed": 1},
              "/v1/sessions": {"context": {"tokens": context_tokens(1)}, "seed": 2},
              f"/v1/sessions/{session_id}/step": {"action": "left", "frames": 1, "format": "jpeg"}}
    keys = ["actions", "frames", "context", "context_frames", "seed", "speed", "temperature", "top_k", "top_p", "id",
            "action", "format", "tokens", "bogus"]
    for _ in range(150):
        route = list(routes)[rng.integers(len(routes))]
        body = dict(routes[route])
        for _ in range(rng.integers(1, 3)):
            body[keys[rng.integers(len(keys))]] = values[rng.integers(len(values))]
        reply = api.post(route, json=body)
        assert reply.status_code < 500, (route, body, reply.text)
        payload = reply.json()
        if reply.status_code >= 400:
            assert payload["error"]["message"], payload
        elif route == "/v1/videos":
            api.delete(f"/v1/videos/{payload['id']}")
        elif route == "/v1/sessions":
            api.delete(f"/v1/sessions/{payload['id']}")
    wait_for(lambda: engine.in_flight == 0 and engine.queued_jobs == 0, 120)
