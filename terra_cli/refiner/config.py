"""The refiner's shapes and sampling settings, read from Terra's `configs/video_refiner/inference.yaml`
(turingmotors/ACT-Bench), as one frozen dataclass. `TERRA_REFINER` is Terra's, value for value;
`tiny_refiner_config` keeps every structural choice (4 levels, attention at the first three,
2 res blocks, 25-frame windows) with small widths, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
        known = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


TERRA_REFINER = RefinerConfig()


def tiny_refiner_config(**overrides) -> RefinerConfig:
    """Terra's structure at small widths (GroupNorm(32) needs multiples of 32): tests and smoke runs."""
    small = replace(TERRA_REFINER, model_channels=32, channel_mult=(1, 2, 2, 2), head_channels=32, context_dim=32,
                    adm_part=8, vae_channels=32, vae_mult=(1, 1, 2, 2), vae_res_blocks=1, height=32, width=64, steps=2)
    return replace(small, **overrides)
