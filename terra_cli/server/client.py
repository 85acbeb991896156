"""`terra generate --server URL`: the same `VideoRequest` a local run makes, sent to `terra serve`.

Contexts and actions travel as data (images as PNG, tokens and waypoints as arrays), never as
paths. The outputs are checked before anything is sent, written atomically like a local run's,
and server-side problems become the same one-line errors. Standard library only (urllib); the
API key, when the server wants one, comes from TERRA_API_KEY.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

from terra_cli.errors import InputError
from terra_cli.pipeline.video import Observer, VideoRequest

POLL_SECONDS = 0.1


@dataclass
class RemoteResult:
    frames: int
    context_frames: int
    generated_frames: int
    rounds: int
    generation_seconds: float
    backend: str
    model: str
    written: list[str]

    @property
    def seconds_per_frame(self) -> float:
        return self.generation_seconds / max(self.generated_frames, 1)


class Remote:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--server must be an http(s):// URL of a running `terra serve`, got {url!r}")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.api_key = api_key if api_key is not None else os.environ.get("TERRA_API_KEY")

    def call(self, method: str, path: str, body: dict | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise InputError(f"--server {self.url}: {_server_message(exc)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"cannot reach --server {self.url} ({reason}); is `terra serve` running there?") from None

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        return json.loads(self.call(method, path, body))


def _server_message(exc: urllib.error.HTTPError) -> str:
    try:
        error = json.loads(exc.read())["error"]
        field = error.get("field")
        message = error.get("message", "")
        text = message if not field or message.startswith(field) else f"{field}: {message}"
    except (ValueError, KeyError, TypeError, AttributeError):
        text = exc.reason
    retry = exc.headers.get("Retry-After") if exc.headers else None
    return f"{exc.code} {text}" + (f" (retry after {retry} s)" if retry else "")


def request_body(request: VideoRequest) -> dict:
    from PIL import Image

    if request.context_tokens is not None:
        context = {"tokens": np.asarray(request.context_tokens).tolist()}
    elif request.context_images is not None:
        encoded = []
        for picture in request.context_images:
            buffer = io.BytesIO()
            Image.fromarray(np.asarray(picture, dtype=np.uint8)).save(buffer, format="PNG")
            encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
        context = {"images": encoded}
    else:
        context = "sample"
    body = {"context": context, "actions": np.asarray(request.actions, dtype=np.float64).tolist(),
            "frames": request.frames, "seed": request.sampling.seed, "temperature": request.sampling.temperature,
            "top_k": request.sampling.top_k, "top_p": request.sampling.top_p,
            "tokens": request.outputs.tokens is not None or request.outputs.frames_dir is not None}
    if request.context_frames is not None:
        body["context_frames"] = request.context_frames
    return body


def generate_remote(url: str, request: VideoRequest, observer: Observer | None = None) -> RemoteResult:
    """Run `request` on the server at `url` and write its outputs here."""
    from terra_cli.media.atomic import atomic_path, atomic_save_npy
    from terra_cli.pipeline.rounds import plan_rounds

    observer = observer or Observer()
    request.check()
    remote = Remote(url)
    health = remote.json("GET", "/health")
    from terra_cli.backends.base import weights_note

    weights = weights_note(health.get("quantization"))
    observer.message(f"server: {remote.url} ({health.get('backend')} backend{weights}, model {health.get('model', '?')})")
    job = remote.json("POST", "/v1/videos", request_body(request))
    started = time.perf_counter()
    try:
        with observer.frames(request.frames - job["context_frames"], health.get("image_tokens", 576)) as frame_done:
            seen = 0
            while job["status"] not in ("done", "failed", "cancelled"):
                time.sleep(POLL_SECONDS)
                job = remote.json("GET", f"/v1/videos/{job['id']}")
                for index in range(seen, job["generated_frames"]):
                    frame_done(job["context_frames"] + index, np.zeros(0))
                seen = max(seen, job["generated_frames"])
    except KeyboardInterrupt:
        remote.call("DELETE", f"/v1/videos/{job['id']}")
        raise
    seconds = job.get("generation_seconds") or time.perf_counter() - started  # the engine's time, as locally
    if job["status"] != "done":
        raise InputError(f"--server {remote.url}: the job {job['status']}" + (f": {job['error']}" if job.get("error") else ""))
    outputs, written = request.outputs, []
    tokens = None
    if job.get("tokens"):
        tokens = np.load(io.BytesIO(remote.call("GET", f"/v1/videos/{job['id']}/content?format=npy")), allow_pickle=False)
    if outputs.tokens is not None:
        atomic_save_npy(outputs.tokens, tokens, overwrite=outputs.overwrite)
        written.append(f"tokens -> {outputs.tokens}")
    if outputs.frames_dir is not None:
        from terra_cli.media.frames import write_frame_folder
        from PIL import Image

        pictures = [np.asarray(Image.open(io.BytesIO(remote.call("GET", f"/v1/videos/{job['id']}/frames/{i}"))))
                    for i in range(tokens.shape[0])]
        write_frame_folder(outputs.frames_dir, pictures, overwrite=outputs.overwrite)
        written.insert(0, f"frames -> {outputs.frames_dir}/")
    if outputs.video is not None:
        data = remote.call("GET", f"/v1/videos/{job['id']}/content")
        with atomic_path(outputs.video, overwrite=outputs.overwrite) as tmp:
            tmp.write_bytes(data)
        written.insert(0, f"video -> {outputs.video}")
    rounds = len(plan_rounds(job["context_frames"], request.frames, health.get("round_frames") or 25))
    return RemoteResult(request.frames, job["context_frames"], job["generated_frames"], rounds, seconds,
                        f"{health.get('backend')} (server)", health.get("model", "?"), written)
