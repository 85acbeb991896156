"""The session WebSocket against a real uvicorn server (in a thread, with the `websockets` client):
what a browser or a hostile client can send. A client that leaves at any moment closes its
session without a traceback; an over-size message is closed with 1009 and one log line; binary
frames, text that is not JSON, NaN/Infinity, deep nesting and unknown types get a
{"type": "error"} message and the socket stays usable."""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request

import pytest

from server_helpers import SERVE_MAX_FRAMES, context_tokens, serve_checkpoint, wait_for

pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def problems(self) -> list[str]:
        """Log lines at WARNING or above, and any that carry a traceback."""
        return [f"{r.name}: {r.getMessage()}" + (" [traceback]" if r.exc_info else "")
                for r in self.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.fixture(scope="module")
def server(tmp_path_factory, frame_tokenizer):
    import uvicorn

    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, load_engine

    engine = load_engine(EngineConfig(model=str(serve_checkpoint(tmp_path_factory.mktemp("ws") / "model")),
                                      tokenizer=frame_tokenizer, backend="hf", device="cpu", dtype="float32",
                                      threads=1))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    records = Records()
    logging.getLogger().addHandler(records)
    # log_config=None: uvicorn's loggers propagate to the root, where the handler sees every line
    app = create_app(engine, Settings(max_sessions=4, session_timeout=120))
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="info", ws="auto",
                            ws_max_size=1 << 20)
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    wait_for(lambda: served.started, 60)
    yield {"http": f"http://127.0.0.1:{port}", "ws": f"ws://127.0.0.1:{port}", "records": records, "app": app}
    served.should_exit = True
    thread.join(timeout=60)
    logging.getLogger().removeHandler(records)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _session(server, frames: int = SERVE_MAX_FRAMES - 1) -> str:
    return _post(server["http"] + "/v1/sessions", {"context": {"tokens": context_tokens(frames)}})["id"]


def _quiet_since(server, mark: int) -> list[str]:
    return server["records"].problems()[mark:]


def test_a_client_leaving_during_the_replay_closes_its_session_quietly(server):
    for _ in range(3):  # a page reload: connect, leave before the held frames have all arrived
        mark = len(server["records"].problems())
        session_id = _session(server)
        with websockets_sync.connect(f"{server['ws']}/v1/sessions/{session_id}/stream"):
            pass  # closes at once, while the server decodes and sends the held frames
        wait_for(lambda: _status(f"{server['http']}/v1/sessions/{session_id}") == 404, 60)
        assert _quiet_since(server, mark) == []
    assert len(server["app"].state.sessions) == 0  # no --max-sessions place held by a client that left


def test_an_oversized_message_closes_with_1009_and_one_log_line(server):
    from websockets.exceptions import ConnectionClosed

    mark = len(server["records"].problems())
    session_id = _session(server, 1)
    with websockets_sync.connect(f"{server['ws']}/v1/sessions/{session_id}/stream", max_size=None) as client:
        assert json.loads(client.recv(timeout=30))["replay"] is True
        client.send(json.dumps({"action": "x" * (2 << 20)}))
        with pytest.raises(ConnectionClosed) as closed:
            client.recv(timeout=30)
    assert closed.value.rcvd is None or closed.value.rcvd.code == 1009
    wait_for(lambda: _status(f"{server['http']}/v1/sessions/{session_id}") == 404, 60)
    lines = _quiet_since(server, mark)
    assert len(lines) == 1 and "1009" in lines[0] and "[traceback]" not in lines[0], lines


def test_a_refused_socket_gets_its_close_code_not_an_http_403(server):
    """Through a real server: a close before the handshake's accept would reach the client as HTTP 403."""
    from websockets.exceptions import ConnectionClosed

    session_id = _session(server, 1)
    for path, code, reason in ((f"/v1/sessions/s-nope/stream", 4404, "no such session"),
                               (f"/v1/sessions/{session_id}/stream?format=gif", 4422,
                                "format must be jpeg, png or tokens, got 'gif'")):
        with websockets_sync.connect(server["ws"] + path) as client:
            with pytest.raises(ConnectionClosed) as closed:
                client.recv(timeout=30)
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (code, reason)


@pytest.mark.parametrize("payload, field", [
    (b"\x00\x01binary", "message"),
    ("not json", "message"),
    ('{"action": "left", "frames": Infinity}', "message"),
    ('{"action": "left", "frames": NaN}', "message"),
    ("[" * 100_000 + "]" * 100_000, "message"),
    ('["left"]', "message"),
    ('{"type": "bogus"}', "type"),
    ('{"type": "step", "frames": 2.5}', "frames"),
    ('{"type": "step", "frames": true}', "frames"),
    ('{"action": "left", "surprise": 1}', "surprise"),
    ('{"action": "sideways"}', "action"),
    ('{"frames": 100}', "frames"),
    ('{"action": "left", "format": 5}', "format"),
    ('{"action": "left", "format": "gif"}', "format"),
])
def test_malformed_messages_get_an_error_message_and_the_socket_stays_open(server, payload, field):
    mark = len(server["records"].problems())
    session_id = _session(server, 1)
    with websockets_sync.connect(f"{server['ws']}/v1/sessions/{session_id}/stream") as client:
        assert json.loads(client.recv(timeout=30))["replay"] is True
        client.send(payload)
        reply = json.loads(client.recv(timeout=30))
        assert reply["type"] == "error" and reply["field"] == field, reply
        client.send(json.dumps({"type": "reset"}))  # still open, still answering
        assert json.loads(client.recv(timeout=30))["type"] == "reset"
    wait_for(lambda: _status(f"{server['http']}/v1/sessions/{session_id}") == 404, 60)
    assert _quiet_since(server, mark) == []


@pytest.mark.parametrize("route", ["/v1/videos", "/v1/sessions"])
def test_uploaded_images_are_decoded_off_the_event_loop(server, monkeypatch, route):
    """Issue 38: 24 large PNGs in one body were decoded on the event loop and /health stalled for
    seconds. Here the decode waits until /health has answered: on the loop, it never could."""
    import base64
    import io

    from PIL import Image

    from terra_cli.server import requests as bodies

    decoding, health_answered = threading.Event(), threading.Event()
    real_decode = bodies.decode_image

    def decode_after_health(*args, **kwargs):
        decoding.set()
        health_answered.wait(30)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(bodies, "decode_image", decode_after_health)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 36), (90, 120, 160)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    body = {"context": {"images": [image]}}
    if route == "/v1/videos":
        body.update(actions="left", frames=3)
    replies = []
    upload = threading.Thread(target=lambda: replies.append(_post(server["http"] + route, body)))
    upload.start()
    try:
        assert decoding.wait(30)
        with urllib.request.urlopen(server["http"] + "/health", timeout=10) as response:
            assert response.status == 200
    finally:
        health_answered.set()
        upload.join(60)
    assert replies and replies[0]["id"], replies
    if route == "/v1/videos":
        urllib.request.urlopen(urllib.request.Request(f"{server['http']}/v1/videos/{replies[0]['id']}",
                                                      method="DELETE"), timeout=10).close()
    else:
        urllib.request.urlopen(urllib.request.Request(f"{server['http']}/v1/sessions/{replies[0]['id']}",
                                                      method="DELETE"), timeout=10).close()
