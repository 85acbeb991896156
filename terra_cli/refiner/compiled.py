"""The refiner's UNet and VAE decoder under torch.compile: which mode a run gets, where Inductor
keeps its cache.

`--refiner-compile auto` (the default) compiles on a GPU with Inductor's default mode and runs
eager on a CPU, where compiling a UNet costs minutes that a tiny smoke test never earns back;
`none` keeps eager anywhere (debugging). `reduce-overhead` adds CUDA graphs; `max-autotune`
autotunes the kernels and also captures CUDA graphs; `max-autotune-no-cudagraphs` autotunes
without them.

Shapes stay static: the UNet is compiled with `dynamic=False` and every call gets the run's
windows per call (a short last group is padded, `VideoRefiner.sample_windows`), so a run compiles
once. A compiled run also compiles the VAE's decoder (`compile_vae_decoder`), always in
Inductor's default mode (`VAE_DECODER_MODE`) whatever the UNet's, on chunks of `vae_chunk`
frames (a short last chunk padded). The compiled code is cached on disk by Inductor (its FX
graph and autotuning caches): under terra's cache folder (`runtime.terra_cache_dir()`/inductor)
unless TORCHINDUCTOR_CACHE_DIR is set, so only the first run on a machine pays the full compile.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

from terra_cli.errors import InputError

COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# The VAE decoder's mode in every compiled run: the one measured (bench probe, H200, 2026-11-27:
# 21.4 ms a frame against 34.7 eager). CUDA graphs would need their own step marks between its
# calls and the UNet's, and autotuning its convolutions is not measured: neither is taken.
VAE_DECODER_MODE = "default"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def check_compile_mode(mode: str) -> str:
    mode = str(mode).strip().lower()
    if mode not in COMPILE_MODES:
        raise InputError(f"--refiner-compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


def resolve_compile_mode(mode: str, device: str) -> str:
    """`auto` -> `default` on CUDA, `none` elsewhere; other modes as given."""
    mode = check_compile_mode(mode)
    if mode != "auto":
        return mode
    return "default" if str(device).startswith("cuda") else "none"


def uses_cuda_graphs(mode: str) -> bool:
    return mode in CUDA_GRAPH_MODES


def _set_by_user(value: str | None) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR holds a folder someone chose: Inductor writes its default
    (/tmp/torchinductor_USER) into the variable itself the first time it looks, which importing
    diffusers' UNet already does, so that value counts as unset."""
    if not value:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(value) != os.path.abspath(default_cache_dir())


def inductor_cache_dir(environ=None) -> Path:
    """Where Inductor caches compiled code: TORCHINDUCTOR_CACHE_DIR if someone set it, else terra's
    cache folder."""
    from terra_cli.runtime import terra_cache_dir

    environ = os.environ if environ is None else environ
    given = environ.get(INDUCTOR_CACHE_ENV)
    return Path(given) if _set_by_user(given) else terra_cache_dir(environ) / "inductor"


def use_inductor_cache(environ=None) -> Path:
    """Point Inductor's cache at terra's cache folder unless TORCHINDUCTOR_CACHE_DIR names another.
    Inductor reads the variable each time it looks for its cache, so this holds from the next compile."""
    environ = os.environ if environ is None else environ
    folder = inductor_cache_dir(environ)
    environ[INDUCTOR_CACHE_ENV] = str(folder)
    return folder


@contextlib.contextmanager
def tracing_quietly():
    """While Dynamo traces the UNet: diffusers' up-sampling blocks call `is_torch_version`, an
    `lru_cache`-wrapped pure function, and Dynamo warns once per call site that it traces through
    the cache (seen in every compiled run's log, 2026-11-27). Tracing through a pure function is
    correct, so that warning is silenced. So is Inductor's advice, on a card with TF32, to compute
    float32 matmuls in TF32 (seen in the refiner bench's log, 2026-11-28): the refiner keeps Terra's
    float32 math, and taking the advice would change the refined pixels. Every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools\.lru_cache`-wrapped function",
                                category=UserWarning)
        warnings.filterwarnings("ignore", message=r"TensorFloat32 tensor cores for float32 matrix multiplication "
                                                  r"available but not enabled", category=UserWarning)
        yield


def compile_unet(unet, mode: str):
    """torch.compile of the UNet with static shapes, Inductor's cache under terra's cache folder."""
    import torch

    use_inductor_cache()
    return torch.compile(unet, mode=mode, dynamic=False)


def compile_vae_decoder(vae, mode: str = VAE_DECODER_MODE):
    """torch.compile of the VAE's one-frame-clip decoder (static shapes: `decode_latents` pads a
    short last chunk for it), in float32 as the eager decoder. A compiled run decodes with it
    (`VideoRefiner.prepare_vae_decoder`): eager, decoding is ~40% of a refined sample's time.
    `terra bench --refiner` times it beside the eager decoder."""
    import torch

    from terra_cli.refiner.autoencoder import one_frame_clips

    use_inductor_cache()
    return torch.compile(one_frame_clips(vae), mode=mode, dynamic=False)
