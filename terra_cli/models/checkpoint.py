"""World-model checkpoints in Terra's layout: its config.json, and saving in that layout.

Finding a directory (local or hub id) and strict safetensors loading are shared with the image
tokenizer and live in `tokenizer_decoder.checkpoint`; they are re-exported here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from huggingface_hub.errors import StrictDataclassError

from terra_cli.models.config import ConfigError, LlamaActionConfig, check_config_schema
from tokenizer_decoder import checkpoint as _shared
from tokenizer_decoder.checkpoint import (  # noqa: F401  (re-exported)
    INDEX_NAME,
    WEIGHTS_NAME,
    check_state_dict,
    looks_like_hub_id,
    read_json_object,
    resolve_checkpoint_dir,
    weight_files,
)
from tokenizer_decoder.errors import CheckpointError  # noqa: F401

TERRA_HUB_ID = "turing-motors/Terra"


def read_state_dict(files: list[Path], dtype: torch.dtype | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A world model's tensors, strictly: every one floating point (an int32 tensor is refused
    from the header, before torch fails on it)."""
    return _shared.read_state_dict(files, dtype, device, floating_only=True)


def load_config(checkpoint_dir: Path) -> LlamaActionConfig:
    config_path = Path(checkpoint_dir) / "config.json"
    raw = read_json_object(config_path, "world-model config")
    model_type = raw.get("model_type")
    if model_type != LlamaActionConfig.model_type:
        raise CheckpointError(f"{config_path} has model_type {model_type!r}; a Terra world model has 'llama_action'")
    check_config_schema(raw, config_path)
    try:
        return LlamaActionConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError, StrictDataclassError, ArithmeticError, AttributeError, KeyError) as exc:
        raise CheckpointError(f"{config_path}: {' '.join(str(exc).split())}") from exc


def save_checkpoint(model: torch.nn.Module, config, out_dir: Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json + safetensors in Terra's layout (sharded with an index if asked)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
