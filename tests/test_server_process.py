"""A real `terra serve` process (uvicorn on 127.0.0.1): `terra generate --server` writes what a local
run writes, its errors are the local run's one-liners, and SIGTERM drains (new work refused, the
job in flight finished or cancelled within the grace period, exit 0). The server decodes with
conftest's frame_tokenizer (Terra's frame size and codes; a third of the embedded one's decode time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import invoke_terra
from server_helpers import serve_checkpoint, wait_for

pytest.importorskip("uvicorn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError):
        return None


def _post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, frame_tokenizer):
    folder = tmp_path_factory.mktemp("served")
    checkpoint = serve_checkpoint(folder / "model")
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    log = open(folder / "serve.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "serve", "--model", str(checkpoint), "--tokenizer", frame_tokenizer,
         "--backend", "hf", "--threads", "1", "--port", str(port), "--drain-grace", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or _get(url + "/health"), 180, 0.5)
        assert process.poll() is None, (folder / "serve.log").read_text()
        yield url, process, checkpoint, folder / "serve.log"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()


def test_generate_on_the_server_writes_what_a_local_run_writes(served, tmp_path, frame_tokenizer):
    url, _, checkpoint, _ = served
    remote = invoke_terra("generate", tmp_path / "remote.mp4", "--actions", "left", "--frames", 4, "--seed", 7,
                          "--save-tokens", tmp_path / "remote.npy", "--save-frames", tmp_path / "frames", "--server", url)
    assert remote.returncode == 0, remote.stdout
    assert "backend hf (server)" in remote.stdout and "video -> " in remote.stdout
    assert (tmp_path / "remote.mp4").read_bytes()[4:8] == b"ftyp"
    assert len(list((tmp_path / "frames").glob("*.png"))) == 4
    local = invoke_terra("generate", "--model", checkpoint, "--tokenizer", frame_tokenizer, "--backend", "hf",
                         "--threads", 1, "--actions", "left", "--frames", 4, "--seed", 7, "--no-decode",
                         "--save-tokens", tmp_path / "local.npy")
    assert local.returncode == 0, local.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "remote.npy"), np.load(tmp_path / "local.npy"))
    again = invoke_terra("generate", tmp_path / "remote.mp4", "--actions", "left", "--frames", 4, "--server", url)
    assert again.returncode == 2 and "--overwrite" in again.stdout  # checked here, before anything is sent


@pytest.mark.parametrize("args,message", [
    (["--model", "x"], "--model is the server's choice"),
    (["--frames", 101], "above the supported maximum"),
])
def test_generate_on_the_server_errors_are_one_line(served, tmp_path, args, message):
    url = served[0]
    result = invoke_terra("generate", tmp_path / "o.mp4", "--actions", "left", "--server", url, *args)
    assert result.returncode == 2 and message in result.stdout and "Traceback" not in result.stdout


def test_generate_against_no_server(tmp_path):
    result = invoke_terra("generate", tmp_path / "o.mp4", "--actions", "left", "--server", f"http://127.0.0.1:{_free_port()}")
    assert result.returncode == 2 and "cannot reach --server" in result.stdout


def test_sigterm_drains_and_exits_0(served):
    url, process, _, log = served
    status, job = _post(url + "/v1/videos", {"actions": "straight", "frames": 8, "context": "sample"})
    assert status == 202, job
    wait_for(lambda: (_get(f"{url}/v1/videos/{job['id']}") or {}).get("status") == "running", 120, 0.2)
    process.send_signal(signal.SIGTERM)  # what a request that arrives now is answered: tests/test_server.py
    assert process.wait(timeout=120) == 0, log.read_text()
    assert "drained and stopped" in log.read_text()


@pytest.mark.parametrize("args,message", [
    (["--host", "0.0.0.0"], "pass --api-key"),
    (["--host", "0.0.0.0", "--api-key", " "], "--api-key (or TERRA_API_KEY) is blank"),
    (["--host", "0.0.0.0", "--api-key", " padded-key-0123456789 "], "starts or ends with whitespace"),
    (["--api-key", "short"], "use at least 16"),
    (["--host", "192.168.1.5", "--port", "9"], "pass --api-key"),
    (["--data-root", "/nonexistent/x"], "is not a folder"),
    (["--backend", "hf", "--kv-cache-dtype", "fp8"], "not for the hf backend"),
    (["--drain-grace", "inf"], "--drain-grace must be a finite number"),
    (["--max-upload-mb", "inf"], "--max-upload-mb must be a finite number"),
    (["--session-timeout", "nan"], "--session-timeout"),
    (["--host", "no-such-host.invalid", "--api-key", "0123456789abcdef"], "is not an address of this machine"),
])
def test_serve_refuses_before_loading(args, message):
    result = invoke_terra("serve", *args)
    assert result.returncode == 2 and message in result.stdout and "Traceback" not in result.stdout


def test_a_bad_picture_stream_switch_is_refused_before_loading(monkeypatch):
    monkeypatch.setenv("TERRA_PICTURE_STREAM", "low")
    result = invoke_terra("serve")
    assert result.returncode == 2 and "TERRA_PICTURE_STREAM='low': use high, normal, shared" in result.stdout
    assert "Traceback" not in result.stdout and "loading the engine" not in result.stdout


def test_a_busy_port_is_refused_before_the_engine_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke_terra("serve", "--port", str(port))
    assert result.returncode == 2 and f"--port {port} on 127.0.0.1 is in use" in result.stdout, result.stdout
    assert "loading the engine" not in result.stdout and "Traceback" not in result.stdout
