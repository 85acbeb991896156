"""Finding and loading checkpoints in Terra's layout: config.json + safetensors (one file, or shards
with `model.safetensors.index.json`), from a local directory or a hub repo id plus subfolder.

Loading is strict: every key the model expects must be present with its shape, and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, LlamaActionConfig
from .errors import TerraError

TERRA_HUB_ID = "turing-motors/Terra"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(TerraError):
    """A checkpoint that cannot be found or does not match the model it should fill."""


def looks_like_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not os.path.exists(spec)


def resolve_checkpoint_dir(
    spec: str | os.PathLike,
    subfolder: str | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    required_file: str = "config.json",
) -> Path:
    """A local directory holding `required_file`, for a local path or a hub repo id.

    Hub ids go through `huggingface_hub.snapshot_download`, which serves from the local cache
    when the files are there (and with HF_HUB_OFFLINE=1 never touches the network).
    """
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; pass the directory that holds {required_file}")
        candidates = [path / subfolder, path] if subfolder else [path]
        for candidate in candidates:
            if (candidate / required_file).is_file():
                return candidate
        where = path / subfolder if subfolder else path
        raise CheckpointError(f"{where} has no {required_file}: is this a Terra checkpoint directory?")
    if not looks_like_hub_id(str(spec)):
        raise CheckpointError(f"model path {spec} does not exist")
    return _download_from_hub(str(spec), subfolder, revision=revision, cache_dir=cache_dir, required_file=required_file)


def _download_from_hub(repo_id, subfolder, *, revision, cache_dir, required_file) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = [f"{subfolder}/*"] if subfolder else None
    try:
        root = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached; "
            f"download it on a connected machine (`hf download {repo_id}`) and copy the cache, "
            "or pass a local directory"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointError(f"could not fetch {repo_id} from the hub: {exc}") from exc
    folder = root / subfolder if subfolder else root
    if not (folder / required_file).is_file():
        raise CheckpointError(f"{repo_id}{'/' + subfolder if subfolder else ''} has no {required_file}")
    return folder


def load_config(checkpoint_dir: Path) -> LlamaActionConfig:
    config_path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{config_path} is missing") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    model_type = raw.get("model_type")
    if model_type != LlamaActionConfig.model_type:
        raise CheckpointError(f"{config_path} has model_type {model_type!r}; a Terra world model has 'llama_action'")
    try:
        return LlamaActionConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index (no weight_map)") from exc
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
    elif (checkpoint_dir / WEIGHTS_NAME).is_file():
        files = [checkpoint_dir / WEIGHTS_NAME]
    else:
        raise CheckpointError(f"{checkpoint_dir} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{checkpoint_dir} lacks the shard(s) its index names: {', '.join(missing)}")
    return files


def _describe(keys: set[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def read_state_dict(files: list[Path], dtype: torch.dtype | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key in tensors:
                    raise CheckpointError(f"key {key} appears in more than one shard")
                t = f.get_tensor(key)
                tensors[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return tensors


def check_state_dict(expected: dict[str, torch.Size], found: dict[str, torch.Tensor], where: str) -> None:
    """Raise a CheckpointError naming missing, unexpected and mis-shaped keys."""
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    problems = []
    if missing:
        problems.append(f"missing keys: {_describe(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_describe(unexpected)}")
    mismatched = [
        f"{k} {tuple(found[k].shape)} (config wants {tuple(expected[k])})"
        for k in sorted(set(expected) & set(found))
        if tuple(found[k].shape) != tuple(expected[k])
    ]
    if mismatched:
        problems.append("shape mismatch: " + "; ".join(mismatched[:4]) + (" ..." if len(mismatched) > 4 else ""))
    if problems:
        raise CheckpointError(f"{where} does not match its config: " + " | ".join(problems))


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
