"""`/v1/videos` (jobs) and `/v1/sessions` (interactive driving), and the session WebSocket."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocketDisconnected

from terra_cli.media.files import read_npy
from terra_cli.server.requests import (PICTURE_FORMATS, STEP_FORMATS, FieldError, SessionBody, StepBody, VideoBody,
                                      check_context, check_format, parse_context, parse_video, sampling_of)
from terra_cli.server.sessions import SessionGone

videos = APIRouter(prefix="/v1/videos", tags=["videos"])
sessions = APIRouter(prefix="/v1/sessions", tags=["sessions"])
LOG = logging.getLogger("terra.serve")
MESSAGE_TOO_BIG = 1009  # the WebSocket close code for a message above the server's --ws-max-size


def _state(request):
    return request.app.state


def _job(request: Request, video_id: str):
    from terra_cli.server.app import ApiError

    job = _state(request).jobs.get(video_id)
    if job is None:
        raise ApiError(404, "video_id", f"no video job {video_id!r}")
    return job


@videos.post("", status_code=202, summary="Submit a video job (the fields of a scenario line)")
async def create_video(body: VideoBody, request: Request):
    # Images and videos in the body are decoded off the event loop: 24 large PNGs took seconds,
    # and /health, the streams and every other request waited for them.
    spec = await run_in_threadpool(parse_video, body, _state(request).settings.limits)
    check_context(spec.context, _state(request).engine.layout)
    job = _state(request).jobs.create(spec)
    return JSONResponse(job.public(), status_code=202, headers={"Location": f"/v1/videos/{job.id}"})


@videos.get("", summary="Every job the server still holds")
async def list_videos(request: Request):
    jobs = _state(request).jobs
    with jobs.lock:
        return {"videos": [j.public() for j in jobs.jobs.values()]}


@videos.get("/{video_id}", summary="A job's status and progress")
async def get_video(video_id: str, request: Request):
    return _job(request, video_id).public()


@videos.get("/{video_id}/content", summary="The finished mp4 (format=npy: its tokens, when asked for)")
async def video_content(video_id: str, request: Request, format: str = "mp4"):
    from terra_cli.server.app import ApiError

    job = _job(request, video_id)
    if job.status != "done":
        raise ApiError(409, "video_id", f"video job {video_id} is {job.status}, not done")
    if format == "mp4":
        return FileResponse(job.video, media_type="video/mp4", filename=f"{job.spec.label or job.id}.mp4")
    if format == "npy":
        if job.tokens is None:
            raise ApiError(409, "format", "this job kept no tokens: submit it with \"tokens\": true")
        return FileResponse(job.tokens, media_type="application/octet-stream", filename=f"{job.id}.npy")
    raise ApiError(422, "format", f"format must be mp4 or npy, got {format!r}")


@videos.get("/{video_id}/frames/{index}", summary="One frame of a finished job as PNG (jobs that kept tokens)")
async def video_frame(video_id: str, index: int, request: Request):
    from terra_cli.server.app import ApiError

    job = _job(request, video_id)
    if job.status != "done" or job.tokens is None:
        raise ApiError(409, "video_id", f"video job {video_id} is {job.status} or kept no tokens (\"tokens\": true)")
    tokens = read_npy(job.tokens, "the job's tokens")
    if not 0 <= index < tokens.shape[0]:
        raise FieldError("index", f"the video has frames 0..{tokens.shape[0] - 1}", 404)
    picture = await _state(request).engine.pictures.picture(tokens[index], "png")
    return Response(picture, media_type="image/png")


@videos.delete("/{video_id}", summary="Cancel a job (queued or running)")
async def cancel_video(video_id: str, request: Request):
    job = _state(request).jobs.cancel(video_id)
    if job is None:
        _job(request, video_id)
    return job.public()


# -- sessions -------------------------------------------------------------------------------


@sessions.post("", status_code=201, summary="Open a session on a context")
async def create_session(body: SessionBody, request: Request):
    state = _state(request)
    limits = state.settings.limits
    sampling = sampling_of(body)
    if not (np.isfinite(body.speed) and 0 <= body.speed <= 200):
        raise FieldError("speed", f"speed must be from 0 to 200 km/h, got {body.speed}")
    context = await run_in_threadpool(parse_context, body.context, body.context_frames, limits)
    check_context(context, state.engine.layout)
    images = context.images
    if context.tokens is None and images is None:
        from terra_cli.models.default import sample_context_frames

        images = list(sample_context_frames(context.count))
    session = await state.sessions.create(images, context.tokens, sampling, float(body.speed))
    return JSONResponse(session.public(), status_code=201, headers={"Location": f"/v1/sessions/{session.id}"})


@sessions.get("/{session_id}", summary="A session's frames so far, speed and driven path")
async def get_session(session_id: str, request: Request):
    return _state(request).sessions.get(session_id, touch=False).public()


@sessions.get("/{session_id}/frames/{index}", summary="One frame as an image")
async def session_frame(session_id: str, index: int, request: Request, format: str = "jpeg"):
    session = _state(request).sessions.get(session_id)
    if not 0 <= index < len(session.tokens):
        raise FieldError("index", f"the session holds frames 0..{len(session.tokens) - 1}", 404)
    check_format(format, PICTURE_FORMATS)
    return Response(await _state(request).sessions.picture(session, index, format), media_type=f"image/{format}")


@sessions.get("/{session_id}/tokens", summary="Every frame's tokens so far, context included (.npy)")
async def session_tokens(session_id: str, request: Request):
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.stack(_state(request).sessions.get(session_id).tokens).astype(np.int64))
    return Response(buffer.getvalue(), media_type="application/octet-stream")


@sessions.post("/{session_id}/step", summary="Generate the next frame(s) with an action")
async def step_session(session_id: str, body: StepBody, request: Request):
    state = _state(request)
    session = state.sessions.get(session_id)
    frames = await state.sessions.step(session, body.action, body.frames, body.format)
    return {"session": session.public(), "frames": frames}


@sessions.post("/{session_id}/fork", status_code=201,
               summary="A new session copying this one's frames, drawing with a branch seed")
async def fork_session(session_id: str, request: Request):
    state = _state(request)
    child = await state.sessions.fork(state.sessions.get(session_id))
    return JSONResponse(child.public(), status_code=201, headers={"Location": f"/v1/sessions/{child.id}"})


@sessions.post("/{session_id}/reset", summary="Back to the context frames")
async def reset_session(session_id: str, request: Request):
    state = _state(request)
    session = state.sessions.get(session_id)
    await state.sessions.reset(session)
    return session.public()


@sessions.get("/{session_id}/video", summary="The session so far as an mp4")
async def session_video(session_id: str, request: Request):
    from terra_cli.media.frames import write_video
    from terra_cli.pipeline.video import VIDEO_FPS

    state = _state(request)
    session = state.sessions.get(session_id)
    tokens = np.stack(session.tokens)

    def render() -> bytes:
        with tempfile.TemporaryDirectory(prefix="terra-session-") as folder:
            path = Path(folder) / "session.mp4"
            write_video(path, list(state.engine.decode(tokens)), fps=VIDEO_FPS)
            return path.read_bytes()

    data = await asyncio.get_running_loop().run_in_executor(state.engine.media, render)
    return Response(data, media_type="video/mp4",
                    headers={"Content-Disposition": f'attachment; filename="{session.id}.mp4"'})


@sessions.delete("/{session_id}", summary="Close a session")
async def delete_session(session_id: str, request: Request):
    state = _state(request)
    state.sessions.get(session_id)
    state.sessions.close(session_id)
    return {"id": session_id, "closed": True}


async def stream(websocket: WebSocket, session_id: str, format: str = "jpeg"):
    """Each frame is pushed the moment it is decoded; actions come in as {"action": ..., "frames": n}
    (optionally "type": "step") or {"type": "reset"}; anything else gets {"type": "error"} and the
    socket stays open. The held frames are replayed first in `format` (?format=: jpeg, png, or tokens,
    which decodes no picture). The socket closing, at any moment (a page reload during the replay of the
    held frames included), closes the session."""
    from terra_cli.server.app import websocket_allowed

    state = websocket.app.state
    session, refusal = None, None
    if not websocket_allowed(websocket):
        refusal = 4401, "missing or wrong API key"
    else:
        try:
            check_format(format, STEP_FORMATS)
            session = state.sessions.get(session_id)
        except FieldError as error:  # HTTP's field check, answered as a WebSocket close code can be
            refusal = 4422, error.message
        except SessionGone:
            refusal = 4404, "no such session"
    # Accepted first even when refused: a close before the handshake's accept reaches the client as
    # an HTTP 403, and the close code that says why is lost.
    await websocket.accept()
    if refusal is not None:
        await websocket.close(code=refusal[0], reason=refusal[1])
        return
    queue: asyncio.Queue = asyncio.Queue()
    session.listeners.add(queue)

    async def pump() -> None:
        while (message := await queue.get()) is not None:
            await websocket.send_json(message)
        await websocket.close(code=1000, reason="session closed")

    async def actions() -> None:
        while True:
            received = await websocket.receive()
            if received["type"] == "websocket.disconnect":
                if received.get("code") == MESSAGE_TOO_BIG:
                    LOG.warning("session %s: a message above the server's WebSocket size cap; connection closed "
                                "(%d)", session_id, MESSAGE_TOO_BIG)
                return
            try:
                message = socket_message(received)
                if message["type"] == "reset":
                    await state.sessions.reset(session)
                    await websocket.send_json({"type": "reset", "session": session.public()})
                    continue
                await state.sessions.step(session, message["action"], message["frames"], message["format"])
            except FieldError as exc:
                await websocket.send_json({"type": "error", "field": exc.field, "message": exc.message})
            except SessionGone:
                if session.closed:
                    return
                await websocket.send_json({"type": "error", "field": "action", "message": "reset while generating"})

    tasks: list[asyncio.Task] = []
    try:
        for index in range(len(session.tokens)):  # what the session holds already, once
            picture = None if format == "tokens" else await state.sessions.picture(session, index, format)
            await websocket.send_json(state.sessions.frame_message(session, index, picture, format) | {"replay": True})
        tasks = [asyncio.create_task(pump()), asyncio.create_task(actions())]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a client that left ends here quietly; anything else is logged by the server
    except (WebSocketDisconnect, WebSocketDisconnected):
        pass  # the client left (during the replay, or while a frame was sent)
    finally:
        for task in tasks:
            task.cancel()
        session.listeners.discard(queue)
        state.sessions.close(session_id)  # a client that goes away frees its session


STEP_FIELDS = {"type", "action", "frames", "format"}


def socket_message(received: dict) -> dict:
    """One WebSocket message as {"type": "step", "action", "frames", "format"} or {"type": "reset"},
    or FieldError naming what is wrong: binary frames, text that is not JSON (NaN and Infinity
    included, which JSON has not), nesting deeper than Python parses, unknown types and fields."""
    if received.get("text") is None:
        raise FieldError("message", "binary messages are not accepted: send JSON text")
    try:
        message = json.loads(received["text"], parse_constant=_no_constant)
    except RecursionError:
        raise FieldError("message", "the message is nested too deeply") from None
    except ValueError as exc:
        raise FieldError("message", f"the message is not JSON: {' '.join(str(exc).split())[:160]}") from None
    if not isinstance(message, dict):
        raise FieldError("message", "messages are JSON objects")
    kind = message.get("type", "step")
    if kind not in ("step", "reset"):
        raise FieldError("type", f"type must be step or reset, got {str(kind)[:40]!r}")
    if kind == "reset":
        return {"type": "reset"}
    unknown = sorted(str(k) for k in message if k not in STEP_FIELDS)
    if unknown:
        raise FieldError(unknown[0][:40], f"unknown field {unknown[0][:40]!r} (a step takes action, frames, format)")
    frames = message.get("frames", 1)
    if not isinstance(frames, int) or isinstance(frames, bool):
        raise FieldError("frames", f"frames must be a whole number, got {str(frames)[:40]}")
    fmt = message.get("format", "jpeg")
    if not isinstance(fmt, str):
        check_format(str(fmt)[:40], STEP_FORMATS)  # no JSON non-string reads as a format name
    return {"type": "step", "action": message.get("action", "straight"), "frames": frames, "format": fmt}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
