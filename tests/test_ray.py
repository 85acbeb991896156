"""Scenario runs on Ray (terra_cli/scenarios/ray_runner.py, ray_actor.py): a local cluster of two
nodes on this machine, the reference backend on a tiny model. Every run is checked against one
engine in this process: the same tokens, each scenario written once, nothing half-written."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from terra_cli.cli import app
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.scenarios.job import ScenarioJob, prepare_job, run_scenario_job
from terra_cli.models.resolve import ModelSpec
from terra_cli.pipeline.world_model import Engine
from terra_cli.scenarios.runner import RESULTS_NAME, read_results
from terra_cli.scenarios.spec import Defaults
from terra_cli.seeds import MAX_SEED

ray = pytest.importorskip("ray")
TOKENS = 16
SCENARIOS = 12
# The Ctrl-C tests' engines sleep this long after each frame: a scenario (2 frames) takes 6 s on either engine,
# so when the first results line appears at least 10 scenarios are left, 30 s of the two engines' work, and
# the signal lands mid-run whatever a loaded machine delays. (At 0.5 s, a loaded CI machine's runs had
# finished before the signal came.) Interrupted, a test waits for about one scenario only.
CTRL_C_FRAME_DELAY = "0=3.0,1=3.0"


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of two CPUs each, started once for the module (seconds each)."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    ray.init(address=nodes.address, log_to_driver=False, logging_level="ERROR")
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A scenario file, a tiny model, and what one engine in this process writes for it."""
    folder = tmp_path_factory.mktemp("ray")
    np.save(folder / "ctx.npy", np.random.default_rng(0).integers(0, 512, size=(2, TOKENS)))
    lines = [{"id": f"v{i}", "context": "ctx.npy", "actions": ["left", "right", "straight"][i % 3], "frames": 4,
              "seed": MAX_SEED - i} for i in range(SCENARIOS)]  # near the top: where a seed rule that drops bits shows
    (folder / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    (folder / "poison.jsonl").write_text("\n".join(map(json.dumps, [
        *lines[:4], {"id": "poison", "context": "ctx.npy", "actions": "left", "frames": 4}, *lines[4:]])) + "\n")
    model = write_tiny_checkpoint(folder / "model", tiny_config(image_tokens=TOKENS, layers=1))
    run_scenario_job(prepare_job(job(folder, "s.jsonl", "one", model)))
    return folder, model


def job(folder, scenarios, out, model):
    return ScenarioJob(folder / scenarios, folder / out, Defaults(), model=ModelSpec(str(model)),
                       engine=Engine("hf", "cpu"), decode=False)


def run(folder, model, out, scenarios="s.jsonl", engines=2, **kwargs):
    from terra_cli.scenarios.ray_runner import run_on_ray

    return run_on_ray(prepare_job(job(folder, scenarios, out, model)), "auto", engines, **kwargs)


def assert_written_once_as_one_engine(folder, out, ids):
    """Each id has one done line and its tokens equal the single-engine run's; no partial file."""
    records = read_results(folder / out / RESULTS_NAME)
    done = [r["id"] for r in records if r["status"] == "done"]
    assert sorted(done) == sorted(ids)
    for i in ids:
        np.testing.assert_array_equal(np.load(folder / out / f"{i}.npy"), np.load(folder / "one" / f"{i}.npy"))
    assert not [p.name for p in (folder / out).iterdir() if "partial" in p.name]
    return records


def test_two_nodes_write_what_one_engine_writes_and_a_rerun_resumes(cluster, work):
    folder, model = work
    events = []
    first = run(folder, model, "two", on_event=lambda kind, engine, payload: events.append(kind))
    assert first.done == SCENARIOS and first.failed == 0 and not first.errors
    records = assert_written_once_as_one_engine(folder, "two", [f"v{i}" for i in range(SCENARIOS)])
    assert {r["engine"] for r in records} <= {0, 1} and all(r["node"] for r in records)
    assert sum(row["scenarios"] for row in first.summary()) == SCENARIOS and "ready" in events
    again = run(folder, model, "two")
    assert again.resumed == SCENARIOS and again.done == 0
    assert len(read_results(folder / "two" / RESULTS_NAME)) == SCENARIOS


def test_a_slow_engine_takes_fewer_scenarios_and_a_poison_one_fails_alone(cluster, work, monkeypatch):
    """Engine 1 sleeps after every frame; a scenario that fails on each engine in turn is recorded
    as failed with every reason, and the others are written."""
    folder, model = work
    # engine 1: 4 s a scenario, engine 0: ~0.05 s; so wide that engine 0 starting late on a loaded
    # machine (seen with 0.5 s under CI's parallel workers) cannot let engine 1 catch up
    monkeypatch.setenv("TERRA_TEST_FRAME_DELAY", "1=2.0")
    monkeypatch.setenv("TERRA_RAY_TEST_FAIL", "poison")  # valid (token ranges are checked up front), fails on every engine
    result = run(folder, model, "slow", scenarios="poison.jsonl")
    shares = {row["engine"]: row["scenarios"] for row in result.summary()}
    assert result.done == SCENARIOS and result.failed == 1 and shares[1] < shares[0]
    loops = [row["engine_loop"] for row in result.summary()]
    # No WakeProbe unless a bench asks. (Engine 1 may have stepped not at all: when engine 0 is up
    # well before it, engine 0 takes every scenario: two of four runs of this test after the one before it.)
    assert loops[0]["steps"] > 0 and all("wakes" not in loop for loop in loops), loops
    failed = [r for r in read_results(folder / "slow" / RESULTS_NAME) if r["status"] == "failed"]
    assert [r["id"] for r in failed] == ["poison"]
    assert "failed 3 times" in failed[0]["reason"] and "engine 0" in failed[0]["reason"] \
        and "engine 1" in failed[0]["reason"]  # retried on the other engine
    assert_written_once_as_one_engine(folder, "slow", [f"v{i}" for i in range(SCENARIOS)])


def test_an_engine_that_cannot_start_is_named_with_its_cause_and_the_other_does_the_work(cluster, work, monkeypatch):
    """On four H100s engine 0's vLLM refused to start (the driver held memory on its GPU) and the
    run went on with three, silently. A constructor that raises is gone at once, not restarted,
    and the driver's line for it names the cause."""
    from terra_cli.scenarios.ray_hand_out import engine_event_line

    folder, model = work
    monkeypatch.setenv("TERRA_RAY_TEST_START_FAIL", "1")
    lines, kinds = [], []

    def on_event(kind, engine, payload):
        kinds.append((kind, engine.index if engine else None))
        if kind in ("ready", "dead", "lost"):
            lines.append(engine_event_line(kind, engine, payload))

    result = run(folder, model, "one-gone", on_event=on_event)
    assert ("dead", 1) in kinds and ("lost", 1) not in kinds and ("ready", 1) not in kinds
    assert "engine 1 is gone for good: RuntimeError: engine 1 cannot start (TERRA_RAY_TEST_START_FAIL)" in lines
    assert [e.status for e in result.engines] == ["alive", "dead"] and result.failed == 0
    records = assert_written_once_as_one_engine(folder, "one-gone", [f"v{i}" for i in range(SCENARIOS)])
    assert {r["engine"] for r in records} == {0}


def test_killed_engines_lose_nothing_and_rejoin(cluster, work, monkeypatch, tmp_path):
    """SIGKILL engine 1's process mid-run, then engine 0's once it has taken over: their open
    scenarios are handed out again, Ray restarts both, and both rejoin; every scenario is written
    once, with the tokens of an uninterrupted run. From engine 0's death on, both engines' frames wait
    for a gate file that opens once both have rejoined: the run cannot end on the first engine back
    before the other has rejoined, however long a restart takes on a loaded machine."""
    folder, model = work
    gate = tmp_path / "both-rejoined"
    gate.touch()  # open until neither engine is alive
    monkeypatch.setenv("TERRA_TEST_FRAME_DELAY", "0=0.25,1=0.25")
    monkeypatch.setenv("TERRA_TEST_FRAME_GATE", f"0={gate},1={gate}")
    pids, events = {}, []

    def on_event(kind, engine, payload):
        events.append((kind, engine.index if engine else None))
        if kind == "ready":
            pids[engine.index] = payload["pid"]
        victim = 1 if ("lost", 1) not in events else 0
        if kind == "written" and engine.index == victim and victim in pids:
            os.kill(pids.pop(victim), signal.SIGKILL)
        if kind == "lost" and engine.index == 0:
            gate.unlink(missing_ok=True)
        if ("rejoined", 0) in events and ("rejoined", 1) in events:
            gate.touch()

    result = run(folder, model, "killed", on_event=on_event)
    assert events.index(("lost", 1)) < events.index(("lost", 0))
    assert result.requeued >= 2 and result.failed == 0
    assert_written_once_as_one_engine(folder, "killed", [f"v{i}" for i in range(SCENARIOS)])
    assert ("rejoined", 0) in events and ("rejoined", 1) in events
    assert [e.restarts for e in result.engines] == [1, 1]


def test_a_restarted_engine_takes_back_the_scenarios_it_lost(cluster, work, monkeypatch, tmp_path):
    """Engine 1 is SIGKILLed as soon as it is ready, with its share of four scenarios open; engine
    0 is held after its first frame until engine 1 has written a scenario (a gate file, however
    long the restart takes on a loaded machine; a fixed 8 s a frame before, most of this test's
    time). The two lost scenarios go back to the queue for any engine, not only to the others:
    engine 1 rejoins and writes them while engine 0 still works on its own (on two H100s, the
    survivor redid a whole batch while the restarted engine stood idle)."""
    folder, model = work
    lines = (folder / "s.jsonl").read_text().splitlines()[:4]
    (folder / "four.jsonl").write_text("\n".join(lines) + "\n")
    gate = tmp_path / "engine-1-wrote"
    monkeypatch.setenv("TERRA_TEST_FRAME_GATE", f"0={gate}")
    killed = []

    def on_event(kind, engine, payload):
        if kind == "ready" and engine.index == 1 and not killed:
            killed.append(payload["pid"])
            os.kill(payload["pid"], signal.SIGKILL)
        elif kind == "written" and engine.index == 1:
            gate.touch()

    result = run(folder, model, "back", scenarios="four.jsonl", on_event=on_event)
    shares = {row["engine"]: row["scenarios"] for row in result.summary()}
    assert killed and result.engines[1].restarts == 1 and result.failed == 0
    assert gate.exists() and shares[1] >= 1 and shares[0] + shares[1] == 4
    assert_written_once_as_one_engine(folder, "back", [f"v{i}" for i in range(4)])


def test_ctrl_c_stops_the_actors_keeps_finished_scenarios_and_a_rerun_completes(cluster, work):
    folder, model = work
    out = folder / "cut"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERRA_TEST_FRAME_DELAY": CTRL_C_FRAME_DELAY,
           "RAY_ADDRESS": cluster.address}
    driver = subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "generate", "--scenarios", str(folder / "s.jsonl"), "--out-dir", str(out),
         "--model", str(model), "--backend", "hf", "--device", "cpu", "--no-decode", "--ray", "auto", "--engines", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 120
    while not read_results(out / RESULTS_NAME) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    output, _ = driver.communicate(timeout=60)
    assert driver.returncode == 130, output
    assert "interrupted: " in output and "run the same command again to resume" in output
    kept = [r["id"] for r in read_results(out / RESULTS_NAME)]
    assert 1 <= len(kept) < SCENARIOS
    assert_written_once_as_one_engine(folder, "cut", kept)
    deadline = time.monotonic() + 30  # the actors are gone: their CPUs come back
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 4
    resumed = run(folder, model, "cut")
    assert resumed.resumed == len(kept) and resumed.done == SCENARIOS - len(kept)
    assert_written_once_as_one_engine(folder, "cut", [f"v{i}" for i in range(SCENARIOS)])


def test_without_ray_installed_a_multi_engine_run_is_one_line(work, monkeypatch):
    folder, model = work
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    result = CliRunner().invoke(app, ["generate", "--scenarios", str(folder / "s.jsonl"), "--out-dir",
                                      str(folder / "noray"), "--model", str(model), "--backend", "hf", "--device",
                                      "cpu", "--no-decode", "--data-parallel", "2"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --data-parallel 2 runs on Ray, which is not installed: pip install 'terra-cli[ray]' "
        "(on the driver and on every node of the cluster)"]
    assert not (folder / "noray").exists()


def test_a_bad_address_is_one_line_within_a_bounded_time(work):
    folder, model = work
    address = "ray://127.0.0.1:1"  # nothing listens: refused at once, or else given up after the connect bound
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "terra_cli", "generate", "--scenarios", str(folder / "s.jsonl"), "--out-dir",
         str(folder / "bad"), "--model", str(model), "--backend", "hf", "--device", "cpu", "--no-decode",
         "--ray", address], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TERRA_RAY_CONNECT_TIMEOUT": "5"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot reach a Ray cluster at --ray {address}: Connection refused (start one with `ray start "
        "--head`, or pass --ray local for a cluster of this machine)")
    assert time.monotonic() - started < 60
    assert not (folder / "bad").exists()  # issue 38: the cluster is reached before --out-dir is made and locked


def test_sigint_to_a_data_parallel_driver_alone_stops_it(work):
    """Issue 38 (WARN): `kill -INT <driver pid>` on a --data-parallel 2 run (the driver starts its own
    local cluster) must stop it like Ctrl-C. (A driver started with `&` from a non-interactive shell
    inherits SIGINT ignored, as POSIX wants for background jobs; SIGTERM stops it there.)"""
    folder, model = work
    out = folder / "dp_sigint"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TERRA_TEST_FRAME_DELAY": CTRL_C_FRAME_DELAY}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen(
        [sys.executable, "-m", "terra_cli", "generate", "--scenarios", str(folder / "s.jsonl"), "--out-dir", str(out),
         "--model", str(model), "--backend", "hf", "--device", "cpu", "--no-decode", "--data-parallel", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 180
    while not read_results(out / RESULTS_NAME) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    output, _ = driver.communicate(timeout=120)
    assert driver.returncode == 130, output
    assert "interrupted: " in output
    assert 1 <= len(read_results(out / RESULTS_NAME)) < SCENARIOS


def test_an_engine_takes_new_work_while_its_finished_rollouts_videos_are_made(cluster, tmp_path, monkeypatch):
    """A rollout's place in the engine's batch frees when its tokens are done, not when its video
    is: one rollout in flight (a window of two calls), three scenarios, and no video may come back
    before the engine has generated all three (TERRA_RAY_TEST_HOLD_VIDEOS). If the finished
    rollouts' videos held their places, the third scenario would never be handed out and the
    held videos would fail after their 60 s limit. The tokenizer is a small one of Terra's frame
    size and codes (1024, 576 a frame): this test is about hand-out, not decoding."""
    from terra_cli.scenarios.ray_runner import run_on_ray
    from tokenizer_decoder import ImageTokenizer, small_config

    np.save(tmp_path / "ctx.npy", np.random.default_rng(0).integers(0, 1024, size=(1, 576)))
    lines = [{"id": f"h{i}", "context": "ctx.npy", "actions": "left", "frames": 2, "seed": i} for i in range(3)]
    (tmp_path / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    model = write_tiny_checkpoint(tmp_path / "m", tiny_config(image_vocab=1024, layers=1, max_frames=4))
    tokenizer = tmp_path / "tokenizer"
    ImageTokenizer.from_config(small_config(ch=32, ch_mult=(1,) * 5), seed=0, device="cpu").save_pretrained(tokenizer)
    monkeypatch.setenv("TERRA_RAY_TEST_HOLD_VIDEOS", "3")
    out = tmp_path / "out"
    job = ScenarioJob(tmp_path / "s.jsonl", out, Defaults(), model=ModelSpec(str(model), tokenizer=str(tokenizer)),
                      engine=Engine("hf", "cpu", "float32"), max_rollouts=1)
    run = run_on_ray(prepare_job(job), "auto", 1)
    records = read_results(out / RESULTS_NAME)
    assert sorted(r["id"] for r in records if r["status"] == "done") == ["h0", "h1", "h2"], records
    assert run.requeued == 0 and not run.errors
    for i in range(3):
        assert (out / f"h{i}.mp4").read_bytes()[4:8] == b"ftyp"
        assert np.load(out / f"h{i}.npy").shape == (2, 576)


def test_a_context_broken_after_validation_fails_its_scenario_alone(cluster, work, tmp_path):
    """The driver reads contexts ahead of the hand-out in threads (encoding.ReadAhead): a read
    that fails is that scenario's final failure, and every other scenario is written. One engine:
    the read is the driver's, and an engine start is seconds of CPU."""
    from terra_cli.scenarios.ray_runner import run_on_ray

    folder, model = work
    np.save(tmp_path / "ctx.npy", np.load(folder / "ctx.npy"))
    np.save(tmp_path / "broken.npy", np.load(folder / "ctx.npy"))
    lines = [json.loads(line) for line in (folder / "s.jsonl").read_text().splitlines()[:4]]
    lines.append({"id": "broken", "context": "broken.npy", "actions": "left", "frames": 4})
    (tmp_path / "s.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    prepared = prepare_job(job(tmp_path, "s.jsonl", "out", model))  # validated while it was whole
    (tmp_path / "broken.npy").write_bytes(b"\x93NUMPY" + b"\x00" * 10)
    result = run_on_ray(prepared, "auto", 1)
    assert result.done == 4 and result.failed == 1
    records = read_results(tmp_path / "out" / RESULTS_NAME)
    failed = [r for r in records if r["status"] == "failed"]
    assert [r["id"] for r in failed] == ["broken"] and "context unreadable" in failed[0]["reason"]
    for line in lines[:4]:
        np.testing.assert_array_equal(np.load(tmp_path / "out" / f"{line['id']}.npy"),
                                      np.load(folder / "one" / f"{line['id']}.npy"))


SIGTERM_PROBE = """
import os, signal, sys, time
import ray
from terra_cli.cli import _interrupt
from terra_cli.scenarios.ray_cluster import python_signal_handlers_kept
signal.signal(signal.SIGTERM, _interrupt)
with python_signal_handlers_kept():
    ray.init(address=sys.argv[1], include_dashboard=False, logging_level="ERROR", log_to_driver=False)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted as Ctrl-C")
finally:
    ray.shutdown()
"""


def test_sigterm_after_ray_starts_is_ctrl_c_not_a_native_abort(cluster):
    """SIGTERM on a Ray run (scenarios/ray_cluster.python_signal_handlers_kept): `ray.init` replaces the
    CLI's SIGTERM handler with a native one that dumps a stack and aborts; terra puts its own back, so
    `timeout` or a job scheduler stops a Ray run as Ctrl-C does (what is finished is written). The
    probe joins the module's cluster: joining installs the native handler as starting a local
    cluster does (without the guard the probe exits 15 on SIGTERM), in 3 s, not a start's 15."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_PROBE, cluster.address], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "interrupted as Ctrl-C"
    assert "SIGTERM received" not in done.stdout + done.stderr
