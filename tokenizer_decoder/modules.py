"""Terra's LFQ image tokenizer as torch modules: encoder, lookup-free quantizer, decoder.

Written for this project; the module tree and parameter names follow the reference design so that
the released `turing-motors/Terra` tokenizer weights (`lfq_tokenizer_B_256`, `lfq_tokenizer_B_256_ema`)
load without renaming.

What was matched, against Open-MAGVIT2 (TencentARC) `improved_model.py` / `lookup_free_quantize.py` /
`lfqgan.py`, versions "v2" (Sep 2024) and "v3" (Dec 2024), which agree on everything below:

* top level: `encoder`, `decoder`, `quantize` (the LFQ). No `quant_conv` / `post_quant_conv`: the
  decoder takes the +-1 codes directly. No parameters in `quantize`: its `mask`, `zero` and
  `codebook` buffers are registered `persistent=False` there, so they are not in a state dict. A
  checkpoint that carries them anyway is accepted when their values agree with ours (see
  `tokenizer.py`), and refused when `quantize.mask` shows the other bit order.
* ResBlock: `norm1` GroupNorm(32, in, eps 1e-6), swish, `conv1` 3x3 no bias, `norm2` GroupNorm(32, out),
  swish, `conv2` 3x3 no bias; `nin_shortcut` 1x1 no bias when in != out (the `conv_shortcut` variant
  is never enabled in the reference configs and is not built here).
* Encoder: `conv_in` 3x3 no bias; `down.{i}.block.{j}` (ch*in_ch_mult[i] -> ch*ch_mult[i]);
  `down.{i}.downsample` stride-2 3x3 conv *with* bias on all but the last level; `mid_block.{j}`;
  `norm_out` GroupNorm; swish; `conv_out` 1x1 *with* bias to z_channels.
* Decoder: `conv_in` 3x3 with bias; `mid_block.{j}`; for each level from the deepest up:
  `adaptive.{i}` (AdaptiveGroupNorm: `gn` GroupNorm(32, eps 1e-6, affine=False) -- no parameters --
  then `gamma`/`beta` Linear(z_channels -> C) with bias, applied to the per-channel std and mean of
  the quantized latent over space), `up.{i}.block.{j}`, and `up.{i}.upsample.conv1` (3x3 with bias
  to 4C, then depth-to-space in DCR order) on all but level 0; `norm_out`; swish; `conv_out` 3x3
  with bias to RGB. `adaptive` and `up` are indexed by level (index 0 = full resolution).
* The std in AdaptiveGroupNorm is sqrt(var + 1e-6) with torch's default *unbiased* variance (the
  reference calls `Tensor.var(dim=-1)`; its comment says "not unbias" but the call is unbiased).
* Depth-to-space is the DCR ("depth-column-row") variant: output[c, 2h+i, 2w+j] =
  input[(2i+j)*C + c, h, w]. This differs from `torch.pixel_shuffle` (CRD) and matters for the
  released weights.
* LFQ: code = +1 where the latent is > 0, else -1; index = sum_i bit_i * 2**i with channel 0 the
  least significant bit (v2/v3 `mask = 2 ** arange(codebook_dim)`); tokens are row-major over the
  latent grid (`b (h w)`), matching `get_codebook_entry(indices, (b, h, w, c))`.

What could not be verified here (no network access to the hub): the released files themselves.
Terra ships them as `transformers` remote code (`AutoModel.from_pretrained(..., trust_remote_code=True)`)
whose source is not public outside the hub. The layout above is the one Open-MAGVIT2's VQModel saves
(minus the training-only `loss.*` / `model_ema.*` entries), which Terra's port is expected to keep.
Open-MAGVIT2's first release (Jun 2024, "128_B"/"256_B" configs) differed in two ways: no
`decoder.adaptive.*` layers and the opposite (MSB-first) bit order. A checkpoint of that kind fails
the strict load (missing `decoder.adaptive.*`) instead of silently producing wrong tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TokenizerConfig
from .errors import CheckpointError

GN_GROUPS = 32
GN_EPS = 1e-6


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def group_norm(channels: int, affine: bool = True) -> nn.GroupNorm:
    return nn.GroupNorm(GN_GROUPS, channels, eps=GN_EPS, affine=affine)


class ResBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        skip = self.nin_shortcut(x) if self.in_channels != self.out_channels else x
        return h + skip


class Encoder(nn.Module):
    def __init__(self, config: TokenizerConfig):
        super().__init__()
        ch, mult, n_res = config.ch, config.ch_mult, config.num_res_blocks
        self.conv_in = nn.Conv2d(config.in_channels, ch, 3, padding=1, bias=False)
        self.down = nn.ModuleList()
        width = ch
        for level, m in enumerate(mult):
            stage = nn.Module()
            stage.block = nn.ModuleList()
            for _ in range(n_res):
                stage.block.append(ResBlock(width, ch * m))
                width = ch * m
            if level < len(mult) - 1:
                stage.downsample = nn.Conv2d(width, width, 3, stride=2, padding=1)
            self.down.append(stage)
        self.mid_block = nn.ModuleList(ResBlock(width, width) for _ in range(n_res))
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, config.z_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for stage in self.down:
            for block in stage.block:
                x = block(x)
            if hasattr(stage, "downsample"):
                x = stage.downsample(x)
        for block in self.mid_block:
            x = block(x)
        return self.conv_out(swish(self.norm_out(x)))


class AdaptiveGroupNorm(nn.Module):
    """GroupNorm without affine, re-scaled and shifted by linear maps of the latent's spatial std / mean."""

    def __init__(self, z_channels: int, channels: int):
        super().__init__()
        self.gn = group_norm(channels, affine=False)
        self.gamma = nn.Linear(z_channels, channels)
        self.beta = nn.Linear(z_channels, channels)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        flat = z.flatten(2)
        std = (flat.var(dim=-1, correction=1) + GN_EPS).sqrt()
        mean = flat.mean(dim=-1)
        scale = self.gamma(std)[:, :, None, None]
        shift = self.beta(mean)[:, :, None, None]
        return self.gn(x) * scale + shift


def depth_to_space(x: torch.Tensor, block: int = 2) -> torch.Tensor:
    """DCR depth-to-space: channel (i*block + j)*C + c goes to pixel offset (i, j) of output channel c."""
    b, c, h, w = x.shape
    out_c = c // (block * block)
    x = x.reshape(b, block, block, out_c, h, w)
    x = x.permute(0, 3, 4, 1, 5, 2)  # b, out_c, h, i, w, j
    return x.reshape(b, out_c, h * block, w * block)


class Upsampler(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels * 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return depth_to_space(self.conv1(x), 2)


class Decoder(nn.Module):
    def __init__(self, config: TokenizerConfig):
        super().__init__()
        ch, mult, n_res, zc = config.ch, config.ch_mult, config.num_res_blocks, config.z_channels
        width = ch * mult[-1]
        self.conv_in = nn.Conv2d(zc, width, 3, padding=1)
        self.mid_block = nn.ModuleList(ResBlock(width, width) for _ in range(n_res))
        adaptive: list[nn.Module] = [None] * len(mult)  # type: ignore[list-item]
        up: list[nn.Module] = [None] * len(mult)  # type: ignore[list-item]
        for level in reversed(range(len(mult))):
            adaptive[level] = AdaptiveGroupNorm(zc, width)
            stage = nn.Module()
            stage.block = nn.ModuleList()
            for _ in range(n_res):
                stage.block.append(ResBlock(width, ch * mult[level]))
                width = ch * mult[level]
            if level > 0:
                stage.upsample = Upsampler(width)
            up[level] = stage
        self.up = nn.ModuleList(up)
        self.adaptive = nn.ModuleList(adaptive)
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, config.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(z)
        for block in self.mid_block:
            x = block(x)
        for level in reversed(range(len(self.up))):
            x = self.adaptive[level](x, z)
            stage = self.up[level]
            for block in stage.block:
                x = block(x)
            if level > 0:
                x = stage.upsample(x)
        return self.conv_out(swish(self.norm_out(x)))


# ---------------------------------------------------------------------------------------------
# Lookup-free quantization: one bit per latent channel, channel 0 the least significant.

def bit_weights(bits: int, device=None) -> torch.Tensor:
    return 2 ** torch.arange(bits, dtype=torch.long, device=device)


def codes_to_indices(codes: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """+-1 (or any real) codes -> int64 indices; `dim` is the bit axis, which is reduced away."""
    bits = (codes > 0).long().movedim(dim, -1)
    return (bits * bit_weights(bits.shape[-1], bits.device)).sum(-1)


def indices_to_bits(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """int indices -> bool bits in a new last axis, least significant first."""
    return (indices.long().unsqueeze(-1) & bit_weights(bits, indices.device)) != 0


def indices_to_codes(indices: torch.Tensor, bits: int, dtype=torch.float32) -> torch.Tensor:
    """int indices (...) -> +-1 codes (..., bits)."""
    return indices_to_bits(indices, bits).to(dtype) * 2 - 1


class LookupFreeQuantizer(nn.Module):
    """Sign quantization to {-1, +1}; holds no state (the reference's buffers are non-persistent)."""

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits
        self.codebook_size = 2**bits

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, bits, h, w) latents -> (+-1 codes of the same shape and dtype, (B, h*w) int64 indices)."""
        one = torch.ones((), dtype=z.dtype, device=z.device)
        codes = torch.where(z > 0, one, -one)
        indices = codes_to_indices(codes, dim=1).flatten(1)
        return codes, indices

    def indices_to_latent(self, indices: torch.Tensor, hw: tuple[int, int], dtype=torch.float32) -> torch.Tensor:
        """(B, h*w) indices -> (B, bits, h, w) codes."""
        b = indices.shape[0]
        h, w = hw
        codes = indices_to_codes(indices.reshape(b, h, w), self.bits, dtype)
        return codes.permute(0, 3, 1, 2).contiguous()

    def expected_buffers(self) -> dict[str, torch.Tensor]:
        """The values the reference's non-persistent buffers hold, for checking checkpoints that carry them."""
        return {"mask": bit_weights(self.bits), "zero": torch.tensor(0.0)}


class LFQTokenizerModel(nn.Module):
    """encoder -> quantize -> decoder, with the reference's attribute names."""

    def __init__(self, config: TokenizerConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = LookupFreeQuantizer(config.z_channels)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encoder(pixels)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(codes)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, indices = self.quantize(self.encode(pixels))
        return self.decode(codes), indices


def expected_shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}


def build_model(config: TokenizerConfig, device: str | torch.device = "cpu") -> LFQTokenizerModel:
    with torch.device(device):
        return LFQTokenizerModel(config)


# The reference LFQ's buffers are non-persistent, so a checkpoint should not carry them; when one
# does (a port that made them persistent), they are checked against what they must hold and dropped.
OPTIONAL_QUANTIZE_KEYS = ("quantize.mask", "quantize.zero", "quantize.codebook", "quantize.pre_mask", "quantize.post_mask")


def drop_optional_quantize_buffers(state: dict[str, torch.Tensor], config: TokenizerConfig, directory) -> None:
    """Check and remove `quantize.*` buffers a port may have saved; refuse ones that disagree with us."""
    bits = config.z_channels
    lsb_first = 2 ** torch.arange(bits, dtype=torch.long)
    for key in OPTIONAL_QUANTIZE_KEYS:
        if key not in state:
            continue
        value = state.pop(key)
        if key == "quantize.mask":
            v = value.long().flatten()
            if v.numel() == bits and torch.equal(v, lsb_first.flip(0)):
                raise CheckpointError(
                    f"tokenizer checkpoint {directory}: quantize.mask is most-significant-bit first "
                    "(Open-MAGVIT2's first release); this build reads channel 0 as the least significant bit"
                )
            if not torch.equal(v, lsb_first):
                raise CheckpointError(f"tokenizer checkpoint {directory}: quantize.mask {v.tolist()} is not 2**arange({bits})")
        elif key == "quantize.codebook":
            if tuple(value.shape) != (config.codebook_size, bits):
                raise CheckpointError(
                    f"tokenizer checkpoint {directory}: quantize.codebook has shape {tuple(value.shape)}, "
                    f"config wants ({config.codebook_size}, {bits})"
                )
            probe = torch.tensor([0, 1, config.codebook_size - 1, config.codebook_size // 3])
            if not torch.equal(value[probe].float(), indices_to_codes(probe, bits)):
                raise CheckpointError(f"tokenizer checkpoint {directory}: quantize.codebook is not the +-1 bit table")


__all__ = [
    "AdaptiveGroupNorm", "Decoder", "Encoder", "LFQTokenizerModel", "LookupFreeQuantizer", "ResBlock",
    "Upsampler", "build_model", "codes_to_indices", "depth_to_space", "expected_shapes",
    "indices_to_bits", "indices_to_codes", "swish",
]
