import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
