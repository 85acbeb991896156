"""The refiner's shapes and sampling settings, read from Terra's `configs/video_refiner/inference.yaml`
(turingmotors/ACT-Bench), as one frozen dataclass. `TERRA_REFINER` is Terra's, value for value;
`tiny_refiner_config` keeps every structural choice (4 levels, attention at the first three,
2 res blocks, 25-frame windows) with small widths, for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Inclusive ranges a checkpoint's config may ask for. The upper bounds are far above Terra's and
# only keep a hostile or broken file from asking for memory no machine has (a `window` of 0 made
# the window plan grow without end).
INT_RANGES = {
    "in_channels": (1, 64), "out_channels": (1, 64), "model_channels": (1, 4096), "attention_levels": (0, 8),
    "num_res_blocks": (1, 8), "head_channels": (1, 4096), "context_dim": (1, 16384), "adm_part": (1, 4096),
    "vae_channels": (1, 4096), "vae_res_blocks": (1, 8), "latent_channels": (1, 64), "window": (1, 100),
    "height": (1, 4096), "width": (1, 4096), "min_overlap": (0, 99), "fps_id": (0, 1_000_000),
    "motion_bucket_id": (0, 1_000_000), "steps": (1, 1000),
}
POSITIVE_FLOATS = ("scale_factor", "sigma_min", "sigma_max", "rho")
FINITE_FLOATS = ("cond_aug", "min_scale", "max_scale")
MULTIPLIERS = ("channel_mult", "vae_mult")
GROUP_NORM_GROUPS = 32  # diffusers' default in both the UNet and the VAE


@dataclass(frozen=True)
class RefinerConfig:
    # denoiser: sgm VideoUNet = diffusers UNetSpatioTemporalConditionModel
    in_channels: int = 8  # 4 noisy latents + 4 concat-condition latents
    out_channels: int = 4
    model_channels: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 4)
    attention_levels: int = 3  # attention_resolutions [4, 2, 1]: levels 0-2 have transformers, level 3 none
    num_res_blocks: int = 2
    head_channels: int = 64
    context_dim: int = 1024
    adm_part: int = 256  # each of cond_aug, fps_id, motion_bucket_id: a 256-wide sinusoidal embedding
    # autoencoders: sgm Encoder / VideoDecoder = diffusers AutoencoderKLTemporalDecoder
    vae_channels: int = 128
    vae_mult: tuple[int, ...] = (1, 2, 4, 4)
    vae_res_blocks: int = 2
    latent_channels: int = 4
    scale_factor: float = 0.18215
    # video
    window: int = 25  # frames refined together (num_frames)
    height: int = 384  # VIDEO_REFINER_HEIGHT / _WIDTH in Terra's generate.py
    width: int = 640
    min_overlap: int = 3  # generate.py passes --num_overlapping_frames (3) as min_overlap_frames
    # conditioning (generate.py's video_refiner_decode)
    fps_id: int = 9
    motion_bucket_id: int = 127
    cond_aug: float = 0.0
    # sampler: EulerEDMSampler + EDMDiscretization + VScalingWithEDMcNoise + LinearPredictionGuider
    steps: int = 15
    sigma_min: float = 0.002
    sigma_max: float = 700.0
    rho: float = 7.0
    min_scale: float = 1.5
    max_scale: float = 3.0

    def __post_init__(self):
        check_config(self)

    @property
    def adm_in_channels(self) -> int:
        return 3 * self.adm_part

    @property
    def block_out_channels(self) -> tuple[int, ...]:
        return tuple(self.model_channels * m for m in self.channel_mult)

    @property
    def attention_heads(self) -> tuple[int, ...]:
        return tuple(c // self.head_channels for c in self.block_out_channels)

    @property
    def latent_hw(self) -> tuple[int, int]:
        f = 2 ** (len(self.vae_mult) - 1)
        return self.height // f, self.width // f

    def unet_kwargs(self) -> dict:
        """diffusers UNetSpatioTemporalConditionModel arguments."""
        levels = len(self.channel_mult)
        cross = ["CrossAttnDownBlockSpatioTemporal" if i < self.attention_levels else "DownBlockSpatioTemporal"
                 for i in range(levels)]
        up = ["CrossAttnUpBlockSpatioTemporal" if i < self.attention_levels else "UpBlockSpatioTemporal"
              for i in reversed(range(levels))]
        return dict(
            sample_size=self.latent_hw[0], in_channels=self.in_channels, out_channels=self.out_channels,
            down_block_types=tuple(cross), up_block_types=tuple(up), block_out_channels=self.block_out_channels,
            addition_time_embed_dim=self.adm_part, projection_class_embeddings_input_dim=self.adm_in_channels,
            layers_per_block=self.num_res_blocks, cross_attention_dim=self.context_dim,
            transformer_layers_per_block=1, num_attention_heads=self.attention_heads, num_frames=self.window,
        )

    def vae_kwargs(self) -> dict:
        """diffusers AutoencoderKLTemporalDecoder arguments (SVD's VAE, not diffusers' defaults)."""
        return dict(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(self.vae_mult),
            block_out_channels=tuple(self.vae_channels * m for m in self.vae_mult),
            layers_per_block=self.vae_res_blocks, latent_channels=self.latent_channels,
            sample_size=self.height, scaling_factor=self.scale_factor, force_upcast=True,
        )

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, raw: dict) -> "RefinerConfig":
        """ValueError naming the field for anything but known fields of the right type and range."""
        if not isinstance(raw, dict):
            raise ValueError(f"a {type(raw).__name__}, not a JSON object")
        unknown = sorted(str(k) for k in raw if k not in cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: RefinerConfig) -> None:
    """Every field's type and range, then what the fields must agree on, before anything is built."""
    for name, (low, high) in INT_RANGES.items():
        value = getattr(config, name)
        if not _is_int(value) or not low <= value <= high:
            raise ValueError(f"{name} is {value!r}: it must be a whole number from {low} to {high}")
    for name in POSITIVE_FLOATS + FINITE_FLOATS:
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)) \
                or (name in POSITIVE_FLOATS and value <= 0):
            raise ValueError(f"{name} is {value!r}: it must be a finite number" +
                             (" above 0" if name in POSITIVE_FLOATS else ""))
    for name in MULTIPLIERS:
        value = getattr(config, name)
        if not isinstance(value, tuple) or not 1 <= len(value) <= 8 or not all(_is_int(m) and 1 <= m <= 16 for m in value):
            raise ValueError(f"{name} is {value!r}: it must be 1 to 8 whole numbers from 1 to 16")
    widths = {"model_channels": config.block_out_channels,
              "vae_channels": tuple(config.vae_channels * m for m in config.vae_mult)}
    for name, channels in widths.items():
        if any(c % GROUP_NORM_GROUPS for c in channels):
            raise ValueError(f"{name} {getattr(config, name)} gives widths {channels}: each must be a multiple "
                             f"of {GROUP_NORM_GROUPS} (GroupNorm)")
    if config.attention_levels > len(config.channel_mult):
        raise ValueError(f"attention_levels {config.attention_levels} is more than the "
                         f"{len(config.channel_mult)} levels of channel_mult")
    if any(c % config.head_channels for c in config.block_out_channels[:config.attention_levels]):
        raise ValueError(f"head_channels {config.head_channels} does not divide the attention widths "
                         f"{config.block_out_channels[:config.attention_levels]}")
    if config.in_channels != 2 * config.latent_channels or config.out_channels != config.latent_channels:
        raise ValueError(f"in_channels {config.in_channels} / out_channels {config.out_channels} must be twice / "
                         f"once latent_channels {config.latent_channels} (noisy latents + the condition's)")
    stride = 2 ** (len(config.vae_mult) - 1)
    if config.height % stride or config.width % stride:
        raise ValueError(f"height {config.height} and width {config.width} must be multiples of {stride} "
                         "(the VAE's downsampling)")
    if config.min_overlap >= config.window:
        raise ValueError(f"min_overlap {config.min_overlap} must be less than window {config.window}")
    if config.sigma_min >= config.sigma_max:
        raise ValueError(f"sigma_min {config.sigma_min} must be below sigma_max {config.sigma_max}")


TERRA_REFINER = RefinerConfig()


def tiny_refiner_config(**overrides) -> RefinerConfig:
    """Terra's structure at small widths (GroupNorm(32) needs multiples of 32): tests and smoke runs."""
    small = replace(TERRA_REFINER, model_channels=32, channel_mult=(1, 2, 2, 2), head_channels=32, context_dim=32,
                    adm_part=8, vae_channels=32, vae_mult=(1, 1, 2, 2), vae_res_blocks=1, height=32, width=64, steps=2)
    return replace(small, **overrides)
