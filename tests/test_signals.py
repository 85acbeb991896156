"""SIGTERM (what `timeout` and job schedulers send) behaves like Ctrl-C: finished frames are kept
with --save-tokens, no temporary file is left, exit 130."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

pytestmark = pytest.mark.slow


def test_sigterm_saves_finished_frames_and_leaves_no_partial_file(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "wm", tiny_config(layers=1))
    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, 576)))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "generate", "--model", str(model), "--context-tokens", str(tmp_path / "ctx.npy"),
         "--actions", "left", "--frames", "25", "--backend", "hf", "--device", "cpu", "--no-decode",
         "--save-tokens", str(out / "tokens.npy")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if (out / "tokens.npy").exists():
            break
        # The progress bar shows the first finished frame ("1/23") only on a terminal; wait a while.
        if time.monotonic() > deadline - 110:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    saved = np.load(out / "tokens.npy")
    assert saved.shape[1] == 576 and 2 <= saved.shape[0] < 25
    np.testing.assert_array_equal(saved[:2], np.load(tmp_path / "ctx.npy"))
    assert sorted(p.name for p in out.iterdir()) == ["tokens.npy"]  # no .partial file left
