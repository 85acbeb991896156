"""The refiner's KL autoencoder: diffusers' `AutoencoderKLTemporalDecoder` with SVD's VAE shapes
(128 wide, [1, 2, 4, 4], two res blocks, 4 latent channels, scale_factor 0.18215), not diffusers'
defaults.

Two of Terra's modules share it (see keymap.py): the concat condition is encoded by the
conditioner's `AutoencoderKLModeOnly` (encoder + quant_conv, the posterior's mode, scale factor
1: the condition latents are NOT multiplied by 0.18215, as in SVD), and sampled latents are
decoded by the first stage's temporal `VideoDecoder` after dividing by 0.18215.

What `en_and_decode_n_samples_a_time: 1` means for the temporal decoder: `decode_first_stage`
splits the latents into chunks of that many frames, and its overlapping branch runs only when
`overlap (3) < n_samples`, which 1 is not; so every latent frame is decoded alone with
`timesteps=1`. The decoder's [3, 1, 1] time convolutions then see a one-frame clip (zero
padding: only their centre taps act) and no frame is blended with its neighbours. We decode the
same way, as independent one-frame clips (`num_frames=1`), several frames per call.

Terra runs both without autocast (`disable_first_stage_autocast`, `disable_encoder_autocast`):
the condition encoder in bf16 (the conditioner is cast with `.bfloat16()`), the first stage in
the dtype it was built in (float32). Read literally, generate.py hands bf16 latents to that
float32 decoder; we cast latents to the decoder's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from terra_cli.refiner.config import RefinerConfig


def build_vae(config: RefinerConfig, device="meta", dtype=torch.float32):
    from terra_cli.refiner import require_diffusers

    require_diffusers()
    from diffusers import AutoencoderKLTemporalDecoder

    with torch.device(device):
        vae = AutoencoderKLTemporalDecoder(**config.vae_kwargs())
    # a few parameters (the blend factors) are made with torch.Tensor([...]), which ignores the
    # device context: move everything where it belongs.
    vae = torch.nn.Module.to(vae, device=device, dtype=dtype)  # (ModelMixin.to warns about dtypes)
    return vae.eval().requires_grad_(False)


def condition_pixels(frames: torch.Tensor, config: RefinerConfig) -> torch.Tensor:
    """Token-decoder output (N, 3, h, w) in about [-1, 1] -> (N, 3, height, width), resized
    bilinearly (torchvision's F.resize on tensors; upscaling, so its antialias does nothing) and
    clamped to [-1, 1], as generate.py does."""
    if frames.shape[-2:] != (config.height, config.width):
        frames = F.interpolate(frames.float(), size=(config.height, config.width), mode="bilinear",
                               align_corners=False, antialias=False)
    return frames.clamp(-1.0, 1.0)


@torch.inference_mode()
def encode_condition(vae, pixels: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1] -> (N, 4, H/8, W/8): encoder, quant_conv, the posterior's mode."""
    dtype = vae.quant_conv.weight.dtype
    outs = []
    for part in pixels.split(chunk):
        moments = vae.quant_conv(vae.encoder(part.to(vae.device, dtype)))
        outs.append(moments.chunk(2, dim=1)[0])
    return torch.cat(outs)


class CenterTapTimeConv(torch.nn.Conv3d):
    """A [3, 1, 1] time convolution that, on a one-frame clip, runs as the 1x1 convolution of its centre
    taps: the outer taps only ever multiply the zero padding, so the sum is the same with 11.6% fewer
    FLOPs in the decoder and 2D kernels instead of 3D ones (-9% a frame on an H200, with channels-last
    -10%: benchmarks/README.md, 2026-11-29). Longer clips run the whole convolution. Same parameters
    and state-dict keys as the Conv3d whose class it takes over (`use_center_taps`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] == 1:
            return F.conv2d(x.squeeze(2), self.weight[:, :, 1], self.bias).unsqueeze(2)
        return super().forward(x)


def use_center_taps(decoder) -> int:
    """The decoder's [3, 1, 1] time convolutions (zero-padded by one frame) as `CenterTapTimeConv`s;
    returns how many. Idempotent."""
    moved = 0
    for module in decoder.modules():
        if (isinstance(module, torch.nn.Conv3d) and module.kernel_size == (3, 1, 1) and module.padding == (1, 0, 0)
                and module.padding_mode == "zeros" and module.stride == (1, 1, 1) and module.dilation == (1, 1, 1)
                and module.groups == 1):
            module.__class__ = CenterTapTimeConv
            moved += 1
    return moved


def one_frame_clips(vae):
    """The VAE's decoder over one-frame clips, latents (B, 4, h, w) -> pixels (B, 3, H, W): what
    `decode_latents` calls, and what `compiled.compile_vae_decoder` compiles."""
    return lambda latents: vae.decode(latents, num_frames=1).sample


@torch.inference_mode()
def decode_latents(vae, latents: torch.Tensor, config: RefinerConfig, chunk: int = 4,
                   on_frames=None, decoder=None, memory_format=torch.contiguous_format) -> torch.Tensor:
    """(N, 4, h, w) sampled latents -> (N, 3, H, W) pixels clamped to [-1, 1], each frame decoded
    as its own one-frame clip (Terra's en_and_decode_n_samples_a_time = 1). `decoder`: a compiled
    `one_frame_clips` (static shapes): a last, shorter chunk is padded to `chunk` frames for it.
    `memory_format`: the latents' order in the call (channels_last for a decoder whose weights are)."""
    from tokenizer_decoder.tokenizer import pad_batch

    dtype = vae.decoder.conv_in.weight.dtype
    decode = decoder if decoder is not None else one_frame_clips(vae)
    outs = []
    for part in (latents / config.scale_factor).split(chunk):
        count = part.shape[0]
        if decoder is not None:
            part = pad_batch(part, chunk)
        part = part.to(vae.device, dtype).contiguous(memory_format=memory_format)
        outs.append(decode(part)[:count].float().clamp(-1.0, 1.0))
        if on_frames is not None:
            on_frames(count)
    return torch.cat(outs)
