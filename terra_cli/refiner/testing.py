"""Tiny refiner checkpoints in Terra's exact format: a DeepSpeed-style `torch.save` of
`{"module": {"_forward_module.<sgm name>": tensor}}`, with the tensors Terra's file also holds
but refining never uses (keymap.IGNORED), for tests and smoke runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from terra_cli.refiner import keymap
from terra_cli.refiner.checkpoint import CONFIG_KEY, PREFIX, save_safetensors, sgm_state_dict
from terra_cli.refiner.config import RefinerConfig, tiny_refiner_config


def terra_state_dict(config: RefinerConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Terra's (sgm) names, unused extras included."""
    from terra_cli.refiner.autoencoder import build_vae
    from terra_cli.refiner.unet import build_unet

    torch.manual_seed(seed)
    unet = build_unet(config, "cpu", exact_cross_attention=False)
    vae = build_vae(config, "cpu")
    with torch.no_grad():  # diffusers leaves some layers at zero; make every tensor count in tests
        for p in unet.parameters():
            if not p.any():
                p.normal_(0.0, 0.02)
    state = sgm_state_dict(unet, vae, config)
    width = config.model_channels
    extras = {
        keymap.UNET + "cond_time_stack_embed.0.weight": torch.randn(4 * width, width),
        keymap.UNET + "cond_time_stack_embed.2.bias": torch.randn(4 * width),
        keymap.FIRST_STAGE + "encoder.conv_in.weight": torch.randn(config.vae_channels, 3, 3, 3),
        keymap.COND_ENCODER + "decoder.conv_in.weight": torch.randn(config.vae_channels, 4, 3, 3),
        keymap.COND_ENCODER + "post_quant_conv.weight": torch.randn(4, 4, 1, 1),
        "token_decoder.decoder.conv_in.weight": torch.randn(8, 8, 3, 3),
    }
    state.update(extras)
    return state


def write_tiny_refiner(path: Path, config: RefinerConfig | None = None, seed: int = 0,
                       state: dict[str, torch.Tensor] | None = None) -> Path:
    """Save a refiner checkpoint as Terra does (`.pt`), or as safetensors when `path` ends so."""
    config = config or tiny_refiner_config()
    state = terra_state_dict(config, seed) if state is None else state
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        save_safetensors(state, config, path)
    else:
        torch.save({"module": {PREFIX + k: v for k, v in state.items()}, CONFIG_KEY: json.dumps(config.to_dict())},
                   path)
    return path
