"""SIGTERM on a Ray run (scenarios/ray_cluster.python_signal_handlers_kept): `ray.init` replaces the
CLI's SIGTERM handler with a native one that dumps a stack and aborts; terra puts its own back, so
`timeout` or a job scheduler stops a Ray run as Ctrl-C does (what is finished is written)."""

import subprocess
import sys

import pytest

pytest.importorskip("ray")

PROBE = """
import os, signal, time
import ray
from terra_cli.cli import _interrupt
from terra_cli.scenarios.ray_cluster import python_signal_handlers_kept
signal.signal(signal.SIGTERM, _interrupt)
with python_signal_handlers_kept():
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted as Ctrl-C")
finally:
    ray.shutdown()
"""


def test_sigterm_after_ray_starts_is_ctrl_c_not_a_native_abort():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "interrupted as Ctrl-C"
    assert "SIGTERM received" not in done.stdout + done.stderr
