"""Terra's refiner checkpoint names (sgm, as in Stability's generative-models / Vista) for every
parameter of our diffusers modules, and the checkpoint tensors we leave out, with the reason.

The checkpoint is a DeepSpeed dict: `{"module": {"_forward_module.<name>": tensor}}`, where
<name> is a `DiffusionEngine` attribute path. What lives there, and where it goes:

| Terra (sgm) | ours (diffusers) |
| --- | --- |
| `model.diffusion_model.*` (VideoUNet) | `UNetSpatioTemporalConditionModel` |
| `conditioner.embedders.3.encoder.{encoder,quant_conv}.*` (the concat-condition encoder, `AutoencoderKLModeOnly`) | `AutoencoderKLTemporalDecoder.{encoder,quant_conv}` |
| `first_stage_model.decoder.*` (`VideoDecoder`) | `AutoencoderKLTemporalDecoder.decoder` |

The names were checked against diffusers' SVD conversion (`scripts/convert_svd_to_diffusers.py`,
diffusers main of 2026-08): run on a tiny state dict named by this map, its UNet converter gives
exactly diffusers' parameter names and tensors. Its VAE converter needs three of its own slips
undone first (it puts `spatial_res_block.` into the 2-D encoder's res blocks and after
`temporal_res_block.`, and nests `time_mixer.mix_factor` under `spatial_res_block`), after which
it agrees too, except where Terra's own modules say otherwise: the temporal decoder's last 3-D
convolution is an `AE3DConv` in Terra's `temporal_ae.py`, so it is `decoder.conv_out.time_mix_conv`
(the script reads `decoder.time_mix_conv`).
"""

from __future__ import annotations

import re

from terra_cli.refiner.config import RefinerConfig

UNET = "model.diffusion_model."
COND_ENCODER = "conditioner.embedders.3.encoder."
FIRST_STAGE = "first_stage_model."

# Checkpoint tensors that are never used when refining, and why (strict loading names them).
IGNORED = (
    (FIRST_STAGE + "encoder.", "the first stage's encoder only encodes training targets (encode_first_stage)"),
    (COND_ENCODER + "decoder.", "the condition encoder (AutoencoderKLModeOnly) is only ever asked to encode"),
    (COND_ENCODER + "post_quant_conv.", "belongs to the condition encoder's unused decoder"),
    (UNET + "cond_time_stack_embed.", "Vista's embedding for frames marked in cond_mask; Terra's cond_mask is all zeros"),
    ("token_decoder.", "Terra's generate.py replaces the token decoder after loading with the world model's "
                       "paired tokenizer (lfq_tokenizer_B_256 for v1, _ema for v2); terra uses that tokenizer"),
    ("model_ema.", "EMA copy; inference.yaml sets use_ema: False"),
)

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))
_VAE_TEMPORAL = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"))
_VAE_ATTENTION = (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out"))


def _swap(rest: str, pairs) -> str:
    for ours, theirs in pairs:
        if rest == ours or rest.startswith(ours + "."):
            return theirs + rest[len(ours):]
    raise KeyError(rest)


def _unet_resnet(rest: str) -> str:
    if rest.startswith("spatial_res_block."):
        return _swap(rest[len("spatial_res_block."):], _RESNET)
    if rest.startswith("temporal_res_block."):
        return "time_stack." + _swap(rest[len("temporal_res_block."):], _RESNET)
    if rest == "time_mixer.mix_factor":
        return rest
    raise KeyError(rest)


def _unet_attention(rest: str) -> str:
    rest = re.sub(r"^temporal_transformer_blocks\.", "time_stack.", rest)
    return re.sub(r"^time_pos_embed\.linear_([12])\.", lambda m: f"time_pos_embed.{2 * int(m.group(1)) - 2}.", rest)


def unet_name(key: str, config: RefinerConfig) -> str:
    """sgm name (without `model.diffusion_model.`) of a diffusers UNet parameter."""
    per_level = config.num_res_blocks + 1
    fixed = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
             "add_embedding.linear_2": "label_emb.0.2", "conv_norm_out": "out.0", "conv_out": "out.2"}
    module, _, leaf = key.rpartition(".")
    if module in fixed:
        return f"{fixed[module]}.{leaf}"
    m = re.match(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)$", key)
    if m:
        side, block, kind, index, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        if side == "down":
            if kind == "downsamplers":
                return f"input_blocks.{1 + block * per_level + config.num_res_blocks}.0.op.{rest.removeprefix('conv.')}"
            where = f"input_blocks.{1 + block * per_level + index}"
        else:
            if kind == "upsamplers":
                has_attention = (len(config.channel_mult) - 1 - block) < config.attention_levels
                return f"output_blocks.{block * per_level + config.num_res_blocks}.{2 if has_attention else 1}.{rest}"
            where = f"output_blocks.{block * per_level + index}"
        return f"{where}.0.{_unet_resnet(rest)}" if kind == "resnets" else f"{where}.1.{_unet_attention(rest)}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", key)
    if m:
        kind, index, rest = m.groups()
        if kind == "attentions":
            return f"middle_block.1.{_unet_attention(rest)}"
        return f"middle_block.{2 * int(index)}.{_unet_resnet(rest)}"
    raise KeyError(key)


def _vae_attention(rest: str) -> str:
    return _swap(rest, _VAE_ATTENTION)


def vae_name(key: str, config: RefinerConfig) -> str:
    """Full checkpoint name of a diffusers AutoencoderKLTemporalDecoder parameter."""
    levels = len(config.vae_mult)
    if key.startswith("quant_conv."):
        return COND_ENCODER + key
    if key.startswith("encoder."):
        rest = key[len("encoder."):]
        fixed = {"conv_norm_out": "norm_out"}
        module, _, leaf = rest.rpartition(".")
        if module in fixed:
            return f"{COND_ENCODER}encoder.{fixed[module]}.{leaf}"
        m = re.match(r"down_blocks\.(\d+)\.(resnets|downsamplers)\.(\d+)\.(.+)$", rest)
        if m:
            level, kind, index, tail = m.groups()
            if kind == "downsamplers":
                rest = f"down.{level}.downsample.{tail}"
            else:
                rest = f"down.{level}.block.{index}.{tail.replace('conv_shortcut', 'nin_shortcut')}"
        m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", rest)
        if m:
            kind, index, tail = m.groups()
            rest = f"mid.attn_1.{_vae_attention(tail)}" if kind == "attentions" else f"mid.block_{int(index) + 1}.{tail}"
        return f"{COND_ENCODER}encoder.{rest}"
    if not key.startswith("decoder."):
        raise KeyError(key)
    rest = key[len("decoder."):]
    fixed = {"conv_norm_out": "norm_out", "time_conv_out": "conv_out.time_mix_conv"}
    module, _, leaf = rest.rpartition(".")
    if module in fixed:
        return f"{FIRST_STAGE}decoder.{fixed[module]}.{leaf}"
    m = re.match(r"(mid_block|up_blocks\.(\d+))\.(resnets|attentions|upsamplers)\.(\d+)\.(.+)$", rest)
    if m:
        block, level, kind, index, tail = m.groups()
        if kind == "attentions":
            return f"{FIRST_STAGE}decoder.mid.attn_1.{_vae_attention(tail)}"
        where = f"mid.block_{int(index) + 1}" if level is None else f"up.{levels - 1 - int(level)}.block.{index}"
        if kind == "upsamplers":
            return f"{FIRST_STAGE}decoder.up.{levels - 1 - int(level)}.upsample.{tail}"
        if tail.startswith("spatial_res_block."):
            tail = tail[len("spatial_res_block."):].replace("conv_shortcut", "nin_shortcut")
        elif tail.startswith("temporal_res_block."):
            tail = "time_stack." + _swap(tail[len("temporal_res_block."):], _VAE_TEMPORAL)
        elif tail == "time_mixer.mix_factor":
            tail = "mix_factor"
        return f"{FIRST_STAGE}decoder.{where}.{tail}"
    return f"{FIRST_STAGE}decoder.{rest}"


def ignored_reason(name: str) -> str | None:
    for prefix, reason in IGNORED:
        if name.startswith(prefix):
            return reason
    return None


def is_conv_attention(name: str) -> bool:
    """sgm's VAE attention uses 1x1 convolutions where diffusers has linear layers."""
    return bool(re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", name))
