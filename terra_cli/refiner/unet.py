"""The refiner's denoiser network: diffusers' `UNetSpatioTemporalConditionModel` in Terra's shapes.

Terra's VideoUNet is SVD's: in 8 / out 4 channels, 320 wide, channel_mult [1, 2, 4, 4], two res
blocks per level, spatial + temporal transformers (64-channel heads) at the first three levels,
`context_dim` 1024, `adm_in_channels` 768, temporal res blocks with [3, 1, 1] kernels blended
with the spatial ones by a learned sigmoid ("learned_with_images"). diffusers' model is the same
network (its SVD defaults are exactly these numbers); we pass them explicitly.

What `context` the UNet sees: no cross-attention embedder is configured, and Terra's
`OpenAIWrapper.forward` then sets `c["crossattn"]` to zeros of shape (B*T, 1, context_dim): one
all-zero token. Every cross-attention (`attn2`, spatial and temporal; the temporal blocks take
the first frame's context, as `use_spatial_context: True` says) therefore attends to a single
key: the softmax weight is exactly 1 whatever the query, so the block returns
to_out(to_v(context)) for every token. We pass the same zero token (`zero_context`).
`SingleTokenCrossAttention` computes that closed form instead of the attention (same result: one
key gives weight 1 exactly; it skips to_q/to_k, the attention and to_out over every token). It is
on by default and `exact_cross_attention=False` turns it off for comparison.

The ADM vector: Terra's conditioner concatenates the 256-wide sinusoidal embeddings of cond_aug,
fps_id and motion_bucket_id in that order (SVD's order is fps, motion, cond_aug), so
`added_time_ids` carries (cond_aug, fps_id, motion_bucket_id) = (0, 9, 127), raw (diffusers'
SVD pipeline subtracts 1 from fps; Terra passes fps_id 9 itself).
"""

from __future__ import annotations

import torch

from terra_cli.refiner.config import RefinerConfig


class SingleTokenCrossAttention:
    """diffusers attention processor for cross-attention over a one-token context: softmax over a
    single key is 1, so the output is to_out(to_v(context)) broadcast over the query tokens."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if encoder_hidden_states is None or encoder_hidden_states.shape[1] != 1 or attention_mask is not None:
            raise ValueError("SingleTokenCrossAttention needs a one-token context and no mask")
        value = attn.to_v(encoder_hidden_states)
        out = attn.to_out[1](attn.to_out[0](value))
        if attn.residual_connection:
            raise ValueError("SingleTokenCrossAttention does not handle residual connections")
        return (out / attn.rescale_output_factor).expand(-1, hidden_states.shape[1], -1)


def build_unet(config: RefinerConfig, device="meta", dtype=torch.float32, exact_cross_attention: bool = True):
    """The UNet with Terra's shapes; on the meta device its weights come from `load_weights`."""
    from terra_cli.refiner import require_diffusers

    require_diffusers()
    from diffusers import UNetSpatioTemporalConditionModel

    with torch.device(device):
        unet = UNetSpatioTemporalConditionModel(**config.unet_kwargs())
    # a few parameters (the blend factors) are made with torch.Tensor([...]), which ignores the
    # device context: move everything where it belongs.
    unet = torch.nn.Module.to(unet, device=device, dtype=dtype)  # (ModelMixin.to warns about dtypes)
    if exact_cross_attention:
        use_single_token_cross_attention(unet)
    return unet.eval().requires_grad_(False)


def use_single_token_cross_attention(unet) -> None:
    from diffusers.models.attention_processor import AttnProcessor2_0

    processors = {name: SingleTokenCrossAttention() if ".attn2." in name else AttnProcessor2_0()
                  for name in unet.attn_processors}
    unet.set_attn_processor(processors)


def sdpa_backend(name: str):
    """A `runtime.REFINER_ATTENTION_BACKENDS` name -> torch's SDPBackend; None for default (torch's choice)."""
    from torch.nn.attention import SDPBackend

    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return backends[name]


class PinnedSdpaAttention:
    """diffusers attention processor: its AttnProcessor2_0 (torch SDPA) with SDPA held to one backend
    (an SDPBackend) for the call. `sdpa_kernel` sets process-wide flags for the span of the `with` and
    restores them after: eager, that is this attention call; under torch.compile Dynamo traces the
    `with` into the graph (torch's SDPAKernelVariable), the backend is fixed when the graph is traced
    and the flags restored there, so the compiled UNet's calls change no flags at all."""

    def __init__(self, backend):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.backend, self.sdpa = backend, AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([self.backend]):
            return self.sdpa(attn, hidden_states, encoder_hidden_states, attention_mask, temb, **kwargs)


def use_sdpa_backend(unet, name: str) -> int:
    """Hold every SDPA attention of the UNet (not `SingleTokenCrossAttention`, which runs none) to the
    backend `name` (`sdpa_backend`); "default" puts back torch's choice. Returns how many it holds."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    backend = sdpa_backend(name)
    processors = {}
    for key, processor in unet.attn_processors.items():
        if isinstance(processor, (AttnProcessor2_0, PinnedSdpaAttention)):
            processor = AttnProcessor2_0() if backend is None else PinnedSdpaAttention(backend)
        processors[key] = processor
    unet.set_attn_processor(processors)
    return sum(isinstance(p, PinnedSdpaAttention) for p in processors.values())


def use_channels_last(unet) -> int:
    """The UNet's convolution weights in channels-last order (4D: channels_last; the temporal blocks'
    [3, 1, 1] Conv3d: channels_last_3d), the order cuDNN's fast convolutions read, so that with
    channels-last inputs (`channels_last_frames`) no layout copies surround them. Same values; returns
    how many weights it reordered."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    moved = 0
    with torch.inference_mode(False), torch.no_grad():
        for module in unet.modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)) and weight is not None:
                module.weight.data = weight.data.contiguous(memory_format=formats[weight.dim()])
                moved += 1
    return moved


def channels_last_frames(sample: torch.Tensor) -> torch.Tensor:
    """Windows (B, F, C, H, W) stored with channels innermost, so that the (B*F, C, H, W) the UNet
    flattens them to (a view) is channels_last. Same values."""
    return sample.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


def zero_context(batch: int, config: RefinerConfig, device, dtype) -> torch.Tensor:
    """What Terra's wrapper hands the UNet as cross-attention context: one zero token per video."""
    return torch.zeros(batch, 1, config.context_dim, device=device, dtype=dtype)


def added_time_ids(batch: int, config: RefinerConfig, device, dtype) -> torch.Tensor:
    """(cond_aug, fps_id, motion_bucket_id) per video, in Terra's conditioner order."""
    ids = torch.tensor([config.cond_aug, float(config.fps_id), float(config.motion_bucket_id)], dtype=dtype,
                       device=device)
    return ids.expand(batch, 3)
