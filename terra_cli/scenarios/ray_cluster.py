"""Joining or starting the Ray cluster of a scenario run, and planning its engines on it."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator

from terra_cli.errors import InputError, import_extra
from terra_cli.scenarios.job import PreparedJob

CONNECT_SECONDS = float(os.environ.get("TERRA_RAY_CONNECT_TIMEOUT", "30"))
INSTALL_HINT = "pip install 'terra-cli[ray]' (on the driver and on every node of the cluster)"


def require_ray(reason: str):
    return import_extra("ray", f"{reason} runs on Ray, which is not installed: {INSTALL_HINT}")


def connect(ray, address: str | None, *, cpus: int, gpus: int, verbose: bool = False) -> bool:
    """Join the cluster at `address` (auto, ray://host:port, host:port) within CONNECT_SECONDS,
    or start a local one (None). True when this call started Ray (and must shut it down)."""
    if ray.is_initialized():
        return False
    common = dict(include_dashboard=False, log_to_driver=verbose, logging_level="INFO" if verbose else "ERROR")
    if address is None:
        ray.init(address="local", num_cpus=cpus, num_gpus=gpus, **common)  # never a cluster found running
        return True
    unreachable = _port_closed(address)
    if unreachable:
        raise InputError(f"cannot reach a Ray cluster at --ray {address}: {unreachable} (start one with "
                         "`ray start --head`, or pass --ray local for a cluster of this machine)")
    outcome: dict = {}

    def join() -> None:
        try:
            ray.init(address=address, **common)
            outcome["ok"] = True
        except BaseException as exc:  # reported below, one line
            outcome["error"] = " ".join(str(exc).split())[:300]

    thread = threading.Thread(target=join, name="terra-ray-connect", daemon=True)
    thread.start()
    thread.join(CONNECT_SECONDS)
    if "ok" not in outcome:
        why = outcome.get("error") or f"no answer within {CONNECT_SECONDS:.0f} s"
        raise InputError(f"cannot reach a Ray cluster at --ray {address}: {why} (start one with `ray start --head`, "
                         "or pass --ray local for a cluster of this machine)")
    return False


def _port_closed(address: str) -> str | None:
    """Why HOST:PORT (or ray://HOST:PORT) takes no TCP connection, found within a few seconds;
    None when it does, or for `auto`, which Ray resolves and refuses quickly itself."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=min(CONNECT_SECONDS, 5)).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def plan_engines(ray, prepared: PreparedJob, cap: int | None) -> tuple[int, str, dict]:
    """(engines, device, actor resources): one per GPU of the cluster; on a CPU-only cluster (or
    --device cpu), one per node unless --engines says otherwise."""
    if cap is not None and cap < 1:
        raise InputError(f"--engines must be at least 1, got {cap}")
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus and prepared.job.engine.device != "cpu":
        if cap is not None and cap > gpus:
            raise InputError(f"{cap} engines need {cap} GPUs; the Ray cluster has {gpus}")
        return cap or gpus, "cuda", {"num_gpus": 1}
    if prepared.device.startswith("cuda"):
        raise InputError(f"--device {prepared.job.engine.device}: the Ray cluster has no GPU (pass --device cpu to run "
                         "on its CPUs)")
    cpus = int(resources.get("CPU", 0))
    count = cap or max(1, sum(1 for node in ray.nodes() if node.get("Alive")))
    if count > cpus:
        raise InputError(f"{count} CPU engines need {count} CPUs; the Ray cluster has {cpus}")
    return count, "cpu", {"num_cpus": 1}


TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


@contextlib.contextmanager
def python_signal_handlers_kept() -> Iterator[None]:
    """`ray.init` installs its own native handler for SIGTERM, which prints a stack dump and ends the
    process at once. terra's CLI turns SIGTERM (`timeout`, job schedulers) and SIGHUP into Ctrl-C so
    that what is finished gets written: put its Python handlers back once Ray is up."""
    import signal

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    kept = {name: signal.getsignal(getattr(signal, name)) for name in TERMINATING_SIGNALS if hasattr(signal, name)}
    try:
        yield
    finally:
        for name, handler in kept.items():
            if callable(handler) or handler in (signal.SIG_IGN, signal.SIG_DFL):
                signal.signal(getattr(signal, name), handler)


@dataclass(frozen=True)
class EnginePlan:
    engines: int
    device: str  # cpu or cuda
    resources: dict  # each actor's: num_gpus=1, or num_cpus=1


@contextlib.contextmanager
def ray_cluster(prepared: PreparedJob, address: str | None = None, engines: int | None = None,
                verbose: bool = False) -> Iterator[EnginePlan]:
    """Connected to (or running) a cluster, with the engines planned on it; a local cluster
    started here is shut down on the way out."""
    from terra_cli.runtime import cuda_device_count

    if prepared.job.videos_at_end:  # one engine's writer threads hold its videos; Ray's engines hand theirs back
        raise InputError("--videos-at-end is for one engine without Ray: drop it with --ray or --data-parallel")
    reason = f"--data-parallel {engines}" if address is None and engines and engines > 1 else "--ray"
    ray = require_ray(reason)

    if address is None and prepared.device.startswith("cuda:"):
        raise InputError(f"several engines spread over all visible GPUs; drop --device {prepared.job.engine.device} "
                         "(choose GPUs with CUDA_VISIBLE_DEVICES)")
    local_gpus = cuda_device_count() if address is None and prepared.device != "cpu" else 0
    with python_signal_handlers_kept():
        started_here = connect(ray, address, cpus=max(engines or 1, os.cpu_count() or 1), gpus=local_gpus,
                               verbose=verbose)
    try:
        yield EnginePlan(*plan_engines(ray, prepared, engines))
    finally:
        if started_here:
            ray.shutdown()
