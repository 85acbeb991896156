"""The CLI keeps vLLM's INFO logs out of the terminal unless `--verbose`; library use keeps vLLM's defaults."""

import importlib.util
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from terra_cli.cli import app, quiet_vllm_logging

from conftest import REPO


def test_quiet_vllm_logging_sets_warning_only_when_unset():
    env = {}
    quiet_vllm_logging(False, env)
    assert env == {"VLLM_LOGGING_LEVEL": "WARNING"}

    env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    quiet_vllm_logging(False, env)
    assert env == {"VLLM_LOGGING_LEVEL": "DEBUG"}  # the user's choice wins

    env = {"VLLM_LOGGING_LEVEL": ""}
    quiet_vllm_logging(False, env)
    assert env == {"VLLM_LOGGING_LEVEL": "WARNING"}  # empty is unset (vLLM would reject "")

    env = {}
    quiet_vllm_logging(True, env)
    assert env == {}  # --verbose: vLLM's own default, INFO

    env = {"VLLM_LOGGING_LEVEL": "ERROR"}
    quiet_vllm_logging(True, env)
    assert env == {"VLLM_LOGGING_LEVEL": "ERROR"}


@pytest.mark.parametrize(
    "argv, preset, expected",
    [
        ([], None, "WARNING"),
        (["--verbose"], None, None),
        ([], "INFO", "INFO"),
        (["--verbose"], "ERROR", "ERROR"),
    ],
)
def test_root_callback_sets_the_level_before_any_command(monkeypatch, tiny_checkpoint, argv, preset, expected):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", preset or "")  # recorded, so the level set here is undone afterwards
    if preset is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    result = CliRunner().invoke(app, [*argv, "info", str(tiny_checkpoint)])
    assert result.exit_code == 0, result.output
    assert os.environ.get("VLLM_LOGGING_LEVEL") == expected


def _python(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_importing_the_library_keeps_vllm_defaults():
    result = _python(
        "import os, terra_cli, terra_cli.cli, terra_cli.pipeline, terra_cli.world_model\n"
        "print(repr(os.environ.get('VLLM_LOGGING_LEVEL')))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("verbose", [False, True])
def test_vllm_honours_the_level(verbose):
    # The real vLLM logger, set up the way an engine sets it up (LoggingConfig from the environment),
    # without starting an engine. vLLM logs to stdout by default.
    result = _python(
        "from terra_cli.cli import quiet_vllm_logging\n"
        f"quiet_vllm_logging({verbose})\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger\n"
        "configure_logging(LoggingConfig())\n"
        "log = init_logger('vllm.terra_test')\n"
        "log.info('terra-info-mark')\n"
        "log.warning('terra-warning-mark')\n"
    )
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-3000:]
    assert "terra-warning-mark" in said
    assert ("terra-info-mark" in said) == verbose, said[-3000:]
