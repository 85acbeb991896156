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
from .files import check_input_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# A config or index larger than this is not one (Terra's index is ~40 KB): refuse before parsing.
MAX_JSON_BYTES = 64 * 2**20
# A safetensors header (JSON) above this is damaged or hostile (Terra's is ~30 KB).
MAX_HEADER_BYTES = 100 * 2**20
# A world model's weights are all floating point: an integer tensor there is a damaged or foreign file.
FLOAT_DTYPES = ("F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64")
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


def read_json_object(path: Path, what: str = "file") -> dict:
    """A JSON object from `path`, or a CheckpointError naming the file and what is wrong with it
    (missing, too large, not UTF-8, not JSON, nested too deeply, numbers too large, not an object)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing")
    check_input_file(path, what, max_bytes=MAX_JSON_BYTES, error=CheckpointError)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}); the {what} must be JSON") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError as exc:
        raise CheckpointError(f"{path} is nested too deeply to be a {what}") from exc
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise CheckpointError(f"{path} is not a valid {what}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object (the {what}), got a JSON {type(raw).__name__}")
    return raw


def check_safetensors_header(path: Path, floating_only: bool = False) -> dict:
    """Check a safetensors file's header before any tensor is read: a sane 8-byte length, a JSON
    object header, and for every tensor a known dtype, a shape of non-negative integers and data
    offsets that match that shape and lie inside the file; with `floating_only`, floating-point
    tensors only (a world model has nothing else; the tokenizer may carry integer buffers).
    Returns the header."""
    path = Path(path)
    size = check_input_file(path, "weights file", error=CheckpointError)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
            n = int.from_bytes(head, "little")
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path} is damaged: its header claims {n} bytes but the file has {size} "
                                      "(truncated, or not a safetensors file)")
            text = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path} is damaged: its header is not JSON") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is damaged: its header is not a JSON object")
    data_size = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        where = f"{path}: tensor {key!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} has no dtype/shape/data_offsets entry")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}")
        if floating_only and dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where} has dtype {dtype}; a world model's weights are floating point "
                                  f"({', '.join(FLOAT_DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{where} has shape {shape!r}; expected a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise CheckpointError(f"{where} has data_offsets {offsets!r}; expected [begin, end]")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_size or end - begin != numel * SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(f"{where} is damaged: data_offsets {offsets} do not fit shape {shape} {dtype} "
                                  f"inside the file ({data_size} data bytes; truncated?)")
    return header


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
        weight_map = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} is not a safetensors index: 'weight_map' must be a non-empty object "
                                  "of tensor name -> shard file name")
        bad = [v for v in weight_map.values() if not isinstance(v, str)]
        if bad:
            raise CheckpointError(f"{index}: weight_map values must be shard file names, got {bad[0]!r}")
        files = [confined_shard(checkpoint_dir, name, index) for name in sorted(set(weight_map.values()))]
    elif (checkpoint_dir / WEIGHTS_NAME).is_file():
        files = [checkpoint_dir / WEIGHTS_NAME]
    else:
        raise CheckpointError(f"{checkpoint_dir} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{checkpoint_dir} lacks the shard(s) its index names: {', '.join(missing)}")
    return files


def confined_shard(checkpoint_dir: Path, name: str, index: Path) -> Path:
    """A shard named by an index, which must be a plain file name inside the checkpoint folder:
    no absolute paths, no `..`, no sub-folders, nothing a symlink leads out of the folder."""
    if not name or name != Path(name).name or name in (".", ".."):
        raise CheckpointError(f"{index} names shard {name!r}; shards must be plain file names inside {checkpoint_dir} "
                              "(no folders, '..' or absolute paths)")
    shard = checkpoint_dir / name
    root = checkpoint_dir.resolve()
    if shard.exists() and root not in shard.resolve().parents:
        raise CheckpointError(f"{index} names shard {name!r}, which leads outside {checkpoint_dir} (a symlink?)")
    return shard


def _describe(keys: set[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def read_state_dict(files: list[Path], dtype: torch.dtype | None = None, device: str = "cpu",
                    floating_only: bool = False) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        check_safetensors_header(file, floating_only)
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
        except Exception as exc:  # safetensors raises its own SafetensorError for damaged files
            raise CheckpointError(f"cannot read {file} as safetensors: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
        with handle as f:
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
