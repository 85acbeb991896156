"""Faster equivalents of two of the refiner UNet's parts (issue 40), swapped in before it is compiled.

- `FramesPlaneConv`: a temporal res block's [3, 1, 1] Conv3d as a Conv2d with a [3, 1] kernel over
  (frames, height x width). A kernel one tap wide in height and width mixes nothing across them, so
  merging them into one axis is the same convolution; in channels-last memory the merge is a view,
  and cuDNN runs the plane convolution among its common 2-D NHWC kernels instead of its 3-D ones.
- `FlashSelfAttention`: the UNet's self-attention through FlashAttention-3 (vLLM's build, the kernel the
  single-stream decoder already runs) instead of torch's SDPA, which picks cuDNN's kernel here
  (313 TFLOP/s at the 64-channel heads, H200, 2026-11-27). Only on Hopper with vLLM's GPU build.

Each computes the same values as the part it replaces, up to float rounding, and keeps its
parameters' names, so checkpoints load the same way before or after the swap.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


class FramesPlaneConv(torch.nn.Module):
    """A Conv3d whose kernel is [k, 1, 1] (stride 1, no dilation or groups, padding [p, 0, 0]) on
    (B, C, T, H, W), computed as a Conv2d over (B, C, T, H*W). Holds the Conv3d's own parameters."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        if not plane_convertible(conv):
            raise ValueError(f"a Conv3d with kernel {tuple(conv.kernel_size)}, padding {conv.padding}, stride "
                             f"{conv.stride} is not a [k, 1, 1] convolution over frames")
        self.weight, self.bias = conv.weight, conv.bias
        self.padding = (conv.padding[0], 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        # flatten(3) is a view in NCDHW and in channels_last_3d; so is the unflatten after
        out = F.conv2d(x.flatten(3), self.weight.squeeze(-1), self.bias, padding=self.padding)
        return out.unflatten(3, (h, w))


def plane_convertible(conv) -> bool:
    return (isinstance(conv, torch.nn.Conv3d) and tuple(conv.kernel_size[1:]) == (1, 1)
            and tuple(conv.stride) == (1, 1, 1) and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1
            and not isinstance(conv.padding, str) and tuple(conv.padding[1:]) == (0, 0)
            and conv.padding_mode == "zeros")


def use_frames_plane_conv(unet) -> int:
    """Every [k, 1, 1] Conv3d of `unet` as a `FramesPlaneConv`; returns how many."""
    swapped = 0
    for parent in list(unet.modules()):
        for name, child in list(parent.named_children()):
            if plane_convertible(child):
                setattr(parent, name, FramesPlaneConv(child))
                swapped += 1
    return swapped


def flash_kernel(device) -> tuple:
    """vLLM's `flash_attn_varlen_func` and 3 where FlashAttention-3 runs on `device`; else (None, None)."""
    if torch.device(device).type != "cuda":
        return None, None
    return _flash_attention_3()


@functools.lru_cache(maxsize=None)
def _flash_attention_3() -> tuple:
    # looked up once a process, not at each of a UNet call's 32 attention calls
    from terra_cli.backends.flash_cache import vllm_flash_varlen

    return vllm_flash_varlen((3,)) or (None, None)


@torch.library.custom_op("terra::flash_self_attention", mutates_args=())
def flash_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: int, scale: float) -> torch.Tensor:
    """q, k, v (sequences * n, heads, d), each sequence's n tokens attending to its own, no mask."""
    kernel, version = flash_kernel(q.device)
    if kernel is None:
        raise RuntimeError("FlashAttention-3 is not available on this device")
    n = q.shape[0] // sequences
    starts = torch.arange(sequences + 1, dtype=torch.int32, device=q.device) * n
    return kernel(q, k, v, max_seqlen_q=n, cu_seqlens_q=starts, max_seqlen_k=n, cu_seqlens_k=starts,
                  softmax_scale=scale, causal=False, fa_version=version)


@flash_self_attention.register_fake
def _(q, k, v, sequences, scale):
    return torch.empty_like(q)


class FlashSelfAttention:
    """diffusers attention processor for the UNet's self-attention (3-D hidden states, no mask, no
    norms inside the attention): its projections as diffusers', the attention on FlashAttention-3."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if (encoder_hidden_states is not None or attention_mask is not None or hidden_states.ndim != 3
                or attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_q is not None
                or attn.norm_k is not None or attn.residual_connection):
            raise ValueError("FlashSelfAttention runs plain self-attention only")
        batch, tokens, _ = hidden_states.shape
        heads = attn.heads

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(batch * tokens, heads, x.shape[-1] // heads)

        out = flash_self_attention(split(attn.to_q(hidden_states)), split(attn.to_k(hidden_states)),
                                   split(attn.to_v(hidden_states)), batch, attn.scale)
        out = attn.to_out[1](attn.to_out[0](out.reshape(batch, tokens, -1)))
        return out / attn.rescale_output_factor


def use_flash_self_attention(unet) -> int:
    """FlashAttention-3 for every SDPA self-attention of `unet` (`SingleTokenCrossAttention` stays);
    returns how many."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    processors = {}
    for key, processor in unet.attn_processors.items():
        if isinstance(processor, AttnProcessor2_0) and ".attn1." in key:
            processor = FlashSelfAttention()
        processors[key] = processor
    unet.set_attn_processor(processors)
    return sum(isinstance(p, FlashSelfAttention) for p in processors.values())
