"""`terra serve`: load the world model once, then serve jobs, sessions and the driving page."""

from __future__ import annotations

import errno
import ipaddress
import math
import signal
import socket
from pathlib import Path
from typing import Optional

import typer

from terra_cli.cli import options as opts
from terra_cli.cli.app import app, friendly_errors, say
from terra_cli.errors import InputError

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@app.command(
    epilog=(
        "Examples:\n\n"
        "  terra serve                                   # terra-mini on http://127.0.0.1:8000 (page at /)\n\n"
        "  terra serve --model turing-motors/Terra --max-sessions 64 --port 8080\n\n"
        "  terra serve --host 0.0.0.0 --api-key \"$(cat key.txt)\"   # other hosts need a key\n\n"
        "  terra generate out.mp4 --actions left --server http://127.0.0.1:8000   # no start-up per call\n\n"
        "Docs: docs/serving.md (the page, the HTTP/WebSocket API, safety)"
    )
)
@friendly_errors
def serve(
    model: Optional[str] = opts.model_option(),
    variant: str = opts.variant_option(),
    tokenizer: Optional[str] = opts.tokenizer_option(),
    backend: str = opts.backend_option(),
    device: str = opts.device_option(),
    dtype: str = opts.dtype_option(),
    threads: int = typer.Option(0, min=0, help="CPU threads for the reference backend (0: torch's default)."),
    kv_cache_dtype: str = opts.kv_cache_dtype_option(),
    quantization: str = opts.quantization_option(),
    attention: str = opts.attention_option(),
    draft: str = opts.draft_option(),
    draft_tokens: int = opts.draft_tokens_option(),
    torch_compile: Optional[bool] = opts.torch_compile_option(),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TERRA_API_KEY", show_default=False, help="Clients send it as 'Authorization: Bearer KEY' (the page asks for it). Also read from TERRA_API_KEY."),
    max_sessions: int = typer.Option(32, "--max-sessions", min=1, help="Open sessions at most; more get 429."),
    session_timeout: float = typer.Option(300.0, "--session-timeout", min=0.1, help="Seconds an idle session lives."),
    max_queued_jobs: int = typer.Option(64, "--max-queued-jobs", min=1, help="Video jobs queued or running at most; more get 429."),
    max_in_flight: int = typer.Option(128, "--max-in-flight", min=1, help="Rollouts at once (sessions + jobs): vLLM's engine; --backend single-stream runs up to 32 sessions' frames as rows of one batch, a session's next frame joining within 16 steps (auto picks it on a GPU at 32 or fewer)."),
    picture_batch: int = typer.Option(1, "--picture-batch", min=1, max=32, help="Frames in every picture decode, padded: 4 to 8 for a server of many sessions (32 sessions on an H100, fp8: 0.58 frames/s each at 4, 0.57 at 8, 0.55 at 16; bf16: 0.46 at 8 against 0.42 at 1), 1 for one (its every picture decodes the whole batch). A picture is the same whatever was decoded beside it."),
    max_frames: int = typer.Option(100, "--max-frames", min=2, max=100, help="Frames per video or session at most."),
    max_upload_mb: float = typer.Option(32.0, "--max-upload-mb", min=0.001, help="Request body size cap in MiB."),
    max_image_pixels: int = typer.Option(4096 * 4096, "--max-image-pixels", min=1, help="Pixels per uploaded image at most."),
    data_root: Optional[Path] = typer.Option(None, "--data-root", help="Let clients name files (contexts, actions) under this folder; without it no path is accepted."),
    drain_grace: float = typer.Option(30.0, "--drain-grace", min=0, help="On SIGTERM: seconds to let work in flight finish before cancelling it."),
):
    """Serve a warm world model: video jobs, interactive sessions (HTTP and WebSocket) and a page to drive it at /."""
    import uvicorn

    from terra_cli.backends.base import weights_note
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.server.app import Settings, create_app
    from terra_cli.server.loader import EngineConfig, check_engine_config, load_engine
    from terra_cli.server.requests import Limits

    from terra_cli.server.app import check_api_key

    check_api_key(api_key)
    if not is_loopback(host) and not api_key:
        raise InputError(f"--host {host} is reachable from other machines: pass --api-key KEY (or TERRA_API_KEY), "
                         "or bind 127.0.0.1")
    if data_root is not None and not data_root.is_dir():
        raise InputError(f"--data-root {data_root} is not a folder")
    for name, value in (("--drain-grace", drain_grace), ("--session-timeout", session_timeout),
                        ("--max-upload-mb", max_upload_mb)):
        if not math.isfinite(value):
            raise InputError(f"{name} must be a finite number, got {value}")
    check_port_free(host, port)  # a busy port fails here, not after the engine has loaded
    config = EngineConfig(model, variant, tokenizer, backend, device, dtype,
                          engine_options(kv_cache_dtype, quantization, draft, draft_tokens, torch_compile, attention),
                          threads, max_in_flight, max_sessions, picture_batch)
    check_engine_config(config)  # a typo fails here, before the engine loads
    limits = Limits(max_frames=max_frames, max_image_pixels=max_image_pixels,
                    data_root=data_root.resolve() if data_root else None)
    settings = Settings(api_key=api_key, max_sessions=max_sessions, session_timeout=session_timeout,
                        max_queued_jobs=max_queued_jobs, max_upload_bytes=int(max_upload_mb * 1024 * 1024),
                        limits=limits, drain_grace=drain_grace)
    say(f"loading the engine ({config.backend} backend) ...")
    engine = load_engine(config)
    web = create_app(engine, settings)
    server = draining_server(uvicorn.Config(web, host=host, port=port, log_level="warning", ws="auto",
                                           timeout_graceful_shutdown=max(int(drain_grace), 1)), web)
    shown = f"[{host}]" if ":" in host else host
    say(f"terra serve: {engine.name} backend{weights_note(engine.quantization)}, up to {max_sessions} sessions; page "
        f"http://{shown}:{port}/ , "
        f"API docs http://{shown}:{port}/docs" + (" (API key required)" if api_key else ""))
    # uvicorn re-raises the signal it drained on; after a drain that is a clean exit, not an interrupt.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    say("terra serve: drained and stopped")


def check_port_free(host: str, port: int) -> None:
    """Bind and release `host:port` as uvicorn will (SO_REUSEADDR), or one line saying why not."""
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise InputError(f"--host {host} is not an address of this machine ({exc})") from None
    family, kind, proto, _, address = addresses[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"--port {port} on {host} is in use (another server?): pick another --port, "
                                 "or stop what listens there") from None
            raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def draining_server(config, web):
    """uvicorn's Server, but a stop signal marks the app as draining at once: POSTs get 503 and
    open sessions close while uvicorn waits for connections and the app finishes its jobs."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            web.state.draining = True
            loop = getattr(web.state, "loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(web.state.sessions.close_all)
            super().handle_exit(sig, frame)

    return DrainingServer(config)
