"""Strict safetensors checkpoints: config.json + `model.safetensors` (or shards with
`model.safetensors.index.json`), from a local directory or a hub repo id plus subfolder.

Shared by the image tokenizer and terra's world model (which imports it from here, so that this
package never imports terra_cli). Loading is strict: every expected key must be present with its
shape, and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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
