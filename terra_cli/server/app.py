"""The FastAPI app: `create_app(engine, settings)` wires jobs, sessions, operations and the page.

Every error a client can cause is a 4xx JSON body {"error": {"field": ..., "message": ...}};
anything else is a 500 with a one-line message, never a trace. The API key (when set) is checked
in constant time by an injected dependency; the page and /health are public.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from terra_cli.errors import InputError
from terra_cli.server.engine import EngineService
from terra_cli.server.jobs import QueueFull, VideoJobs
from terra_cli.server.requests import FieldError, Limits
from terra_cli.server.sessions import Sessions, SessionsFull, SessionGone

RETRY_AFTER_S = 5
# A key anyone could guess (one space, "test") would open a public server; 16 characters is what
# `openssl rand -hex 8` gives, the least a careless user is asked for.
MIN_API_KEY_CHARS = 16


def check_api_key(key: str | None) -> str | None:
    """The key as given, or InputError if it is blank, padded with whitespace or too short."""
    if key is None:
        return None
    if not key.strip():
        raise InputError("--api-key (or TERRA_API_KEY) is blank: give a real key, e.g. \"$(openssl rand -hex 16)\"")
    if key != key.strip():
        raise InputError("--api-key (or TERRA_API_KEY) starts or ends with whitespace: clients could not send it "
                         "back exactly; remove it")
    if len(key) < MIN_API_KEY_CHARS:
        raise InputError(f"--api-key (or TERRA_API_KEY) has {len(key)} characters: use at least "
                         f"{MIN_API_KEY_CHARS}, e.g. \"$(openssl rand -hex 16)\"")
    return key


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None
    max_sessions: int = 32
    session_timeout: float = 300.0
    max_queued_jobs: int = 64
    max_upload_bytes: int = 32 * 1024 * 1024
    limits: Limits = Limits()
    drain_grace: float = 30.0
    workdir: Path | None = None

    def __post_init__(self):
        check_api_key(self.api_key)


class ApiError(Exception):
    def __init__(self, status: int, field: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field, message, headers


def error_body(field: str | None, message: str) -> dict:
    return {"error": {"field": field, "message": message}}


def key_matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def presented_key(headers, query=None) -> str | None:
    """The key a client sent. `?key=` only where a header cannot be sent (the browser's WebSocket):
    elsewhere it would put keys into access logs and browser history."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key") or (query.get("key") if query is not None else None)


def create_app(engine: EngineService, settings: Settings = Settings()) -> FastAPI:
    workdir_holder = None
    workdir = settings.workdir
    if workdir is None:
        workdir_holder = tempfile.TemporaryDirectory(prefix="terra-serve-")
        workdir = Path(workdir_holder.name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        expiry = asyncio.create_task(_expire_forever(app.state.sessions))
        try:
            yield
        finally:
            app.state.draining = True
            expiry.cancel()
            await drain(app, settings.drain_grace)
            await asyncio.get_running_loop().run_in_executor(None, engine.close)
            if workdir_holder is not None:
                workdir_holder.cleanup()

    app = FastAPI(title="terra serve", version="1", lifespan=lifespan,
                  description="A warm Terra world model: video jobs, interactive sessions, a page to drive at /.")
    app.state.engine = engine
    app.state.settings = settings
    app.state.draining = False
    app.state.jobs = VideoJobs(engine, workdir, max_queued=settings.max_queued_jobs)
    app.state.sessions = Sessions(engine, max_sessions=settings.max_sessions, timeout=settings.session_timeout,
                                  max_frames=settings.limits.max_frames)
    app.state.rejected = 0
    install_errors(app)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.method in ("POST", "PUT", "PATCH"):
            if app.state.draining:
                return _json(503, error_body(None, "the server is shutting down; try another"),
                             {"Retry-After": str(RETRY_AFTER_S)})
            length = request.headers.get("content-length")
            if length is None and request.headers.get("transfer-encoding"):
                return _json(411, error_body("body", "send a Content-Length"))
            if length is not None and (not length.isdigit() or int(length) > settings.max_upload_bytes):
                return _json(413, error_body("body", f"the request body is above this server's cap of "
                                                     f"{settings.max_upload_bytes} bytes"))
        return await call_next(request)

    from terra_cli.server import routes

    auth = [Depends(require_key(settings))]
    app.include_router(routes.videos, dependencies=auth)
    app.include_router(routes.sessions, dependencies=auth)
    app.add_api_websocket_route("/v1/sessions/{session_id}/stream", routes.stream)

    @app.get("/health", tags=["operations"])
    async def health():
        failure = engine.failure
        body = {"status": "failed" if failure else "draining" if app.state.draining else "ok",
                "backend": engine.name, "quantization": engine.quantization, "model": engine.model_label,
                "max_frames": settings.limits.max_frames, "round_frames": engine.layout.max_frames,
                "image_tokens": engine.layout.image_tokens,
                "sessions": len(app.state.sessions), "queued_jobs": engine.queued_jobs}
        return _json(503 if failure or app.state.draining else 200, body)

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse, dependencies=auth)
    async def metrics():
        return PlainTextResponse(prometheus_text(app), media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        types = {"app.js": "text/javascript", "style.css": "text/css"}
        if name not in types:
            raise ApiError(404, "name", f"no static file {name!r}")
        return Response(_static(name), media_type=types[name])

    return app


def _static(name: str) -> str:
    return resources.files("terra_cli.server").joinpath("static", name).read_text(encoding="utf-8")


def _json(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def require_key(settings: Settings):
    async def check(request: Request) -> None:
        if settings.api_key is None:
            return
        if not key_matches(presented_key(request.headers), settings.api_key):
            raise ApiError(401, "authorization", "missing or wrong API key (send Authorization: Bearer KEY)",
                           {"WWW-Authenticate": "Bearer"})

    return check


def websocket_allowed(websocket: WebSocket) -> bool:
    settings: Settings = websocket.app.state.settings
    return settings.api_key is None or key_matches(presented_key(websocket.headers, websocket.query_params),
                                                   settings.api_key)


def field_of(loc) -> str:
    """The request field a pydantic error location names: `id`, `actions[2]`, `index`. Where the
    field came from (body, path, query) and the union member that was tried (`str`, `int`,
    `function-before[...]`) are pydantic's, not the client's."""
    parts = [p for p in loc if p not in ("body", "path", "query")]
    if not parts:
        return "body"
    return str(parts[0]) + "".join(f"[{p}]" for p in parts[1:] if isinstance(p, int))


def install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _json(exc.status, error_body(exc.field, exc.message), exc.headers)

    @app.exception_handler(FieldError)
    async def field_error(request, exc: FieldError):
        return _json(exc.status, error_body(exc.field, exc.message))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        def field(error: dict) -> str:  # a JSON syntax error's location is a character offset, not a field
            return "body" if error.get("type") == "json_invalid" else field_of(error.get("loc", ()))

        first = exc.errors()[0] if exc.errors() else {}
        message = first.get("msg", "invalid request")
        return _json(422, {"error": {"field": field(first), "message": f"{field(first)}: {message}"},
                           "errors": [{"field": field(e), "message": e.get("msg")} for e in exc.errors()[:20]]})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _json(exc.status_code, error_body(None, str(exc.detail)), getattr(exc, "headers", None))

    @app.exception_handler(QueueFull)
    async def queue_full(request, exc):
        app.state.rejected += 1
        return _json(429, error_body(None, str(exc)), {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(SessionsFull)
    async def sessions_full(request, exc):
        app.state.rejected += 1
        return _json(429, error_body(None, str(exc)), {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(SessionGone)
    async def session_gone(request, exc):
        return _json(404, error_body("session_id", f"no open session {exc} (closed, expired or reset)"))

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        return _json(500, error_body(None, f"internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))


async def _expire_forever(sessions: Sessions) -> None:
    while True:
        await asyncio.sleep(min(1.0, max(sessions.timeout / 4, 0.05)))
        sessions.expire()


async def drain(app: FastAPI, grace: float) -> None:
    """Refuse new work (the caller set draining), let jobs finish within `grace`, cancel the rest."""
    jobs: VideoJobs = app.state.jobs
    deadline = asyncio.get_running_loop().time() + grace
    while jobs.active() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    jobs.cancel_all()
    app.state.sessions.close_all()


def prometheus_text(app: FastAPI) -> str:
    engine: EngineService = app.state.engine
    stats, loop = engine.stats, engine.driver.loop
    rows = [
        ("terra_frames_generated_total", "counter", "Frames generated since start.", stats.frames),
        ("terra_frames_per_second", "gauge", "Frames generated per second over the last 10 s.",
         round(stats.frames_per_second(), 4)),
        ("terra_session_frames_sent_total", "counter", "Session frames delivered.", app.state.sessions.frames_sent),
        ("terra_sessions", "gauge", "Open sessions.", len(app.state.sessions)),
        ("terra_jobs_active", "gauge", "Video jobs queued or running.", app.state.jobs.active()),
        ("terra_queue_depth", "gauge", "Video jobs waiting for the engine.", engine.queued_jobs),
        ("terra_in_flight", "gauge", "Rollouts in the engine.", engine.in_flight),
        ("terra_engine_utilisation", "gauge", "Fraction of time since start with work in the engine.",
         round(stats.utilisation(), 4)),
        ("terra_requests_rejected_total", "counter", "Requests refused with 429 (caps).", app.state.rejected),
        ("terra_pictures_total", "counter", "Session frames decoded to pictures.", engine.pictures.pictures),
        ("terra_picture_batches_total", "counter", "Tokenizer calls that decoded them.", engine.pictures.calls),
        ("terra_picture_seconds_total", "counter", "Seconds the media thread spent decoding and encoding them.",
         round(engine.pictures.seconds, 3)),
        ("terra_engine_batches_total", "counter", "Batches run one at a time (reference and single-stream backends).",
         loop.batches),
        ("terra_engine_batched_jobs_total", "counter", "Jobs in those batches.", loop.batched_jobs),
        ("terra_engine_steps_total", "counter", "Decode steps the engine ran.", loop.steps),
        ("terra_engine_step_seconds_total", "counter", "Seconds the engine thread spent in its steps.", round(loop.step_s, 3)),
        ("terra_engine_admit_seconds_total", "counter", "Seconds it spent taking in jobs.", round(loop.admit_s, 3)),
        ("terra_engine_frame_seconds_total", "counter", "Seconds it spent handing finished frames on.",
         round(loop.frames_s, 3)),
        ("terra_prompts_reused_total", "counter", "Rollouts that started from the frames a row already held "
         "(single-stream row batches).", getattr(getattr(engine.backend, "rows", None), "prompts_reused", 0)),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
