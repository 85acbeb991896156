"""What refining costs: FLOPs counted for Terra's refiner and scaled to other configs, and the refusal of
work a CPU would take over an hour on (unless `--allow-slow`)."""

from __future__ import annotations

import math
import time

import torch

from terra_cli.errors import InputError
from terra_cli.refiner.config import TERRA_REFINER, RefinerConfig
from terra_cli.refiner.windows import start_end_indices

# Counted with torch.utils.flop_counter for TERRA_REFINER (one 25-frame UNet call, single-token
# cross-attention), and for the VAE per 384x640 frame; see benchmarks/README.md.
TERRA_UNET_FLOPS = 28.34e12
TERRA_VAE_DECODE_FLOPS = 2.85e12
TERRA_VAE_ENCODE_FLOPS = 1.04e12
SLOW_CPU_SECONDS = 3600.0


def estimated_unet_flops(config: RefinerConfig) -> float:
    """FLOPs of one window's UNet call, scaled from the count for Terra's shapes."""
    h, w = config.latent_hw
    th, tw = TERRA_REFINER.latent_hw
    return (TERRA_UNET_FLOPS * (config.model_channels / TERRA_REFINER.model_channels) ** 2
            * (h * w) / (th * tw) * config.window / TERRA_REFINER.window)


def estimated_flops(config: RefinerConfig, frames: int, same_uncond: bool = True) -> float:
    windows = len(start_end_indices(frames, config.window, config.min_overlap))
    evals = config.steps * (1 if same_uncond else 2)
    pixels = config.height * config.width / (TERRA_REFINER.height * TERRA_REFINER.width)
    vae = frames * (TERRA_VAE_DECODE_FLOPS + TERRA_VAE_ENCODE_FLOPS) * pixels * (config.vae_channels / 128) ** 2
    return windows * evals * estimated_unet_flops(config) + vae


def cpu_flops_per_second() -> float:
    """A quick float32 matmul rate on this CPU, halved for the convolutions that dominate the UNet."""
    a = torch.randn(512, 512)
    a @ a
    started = time.perf_counter()
    for _ in range(4):
        a @ a
    seconds = max(time.perf_counter() - started, 1e-6)
    return 0.5 * 4 * 2 * 512 ** 3 / seconds


def check_cpu_time(config: RefinerConfig, frame_counts: list[int], device: str, allow_slow: bool) -> float:
    """On a CPU, refuse work estimated over an hour (unless allowed); returns the estimate (s, 0 on a GPU)."""
    if not device.startswith("cpu"):
        return 0.0
    flops = sum(estimated_flops(config, n) for n in frame_counts)
    seconds = flops / cpu_flops_per_second()
    if seconds > SLOW_CPU_SECONDS and not allow_slow:
        raise InputError(f"refining {sum(frame_counts)} frames on this CPU would take about {_duration(seconds)} "
                         f"({flops / 1e12:,.0f} TFLOP); use a GPU (--device cuda), or pass --allow-slow to run anyway")
    return seconds


def _duration(seconds: float) -> str:
    if seconds < 5400:
        return f"{math.ceil(seconds / 60)} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} hours"
    return f"{seconds / 86400:.0f} days"
