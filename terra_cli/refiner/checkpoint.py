"""Finding and reading the refiner's weights, strictly and without running pickle.

Terra ships `turing-motors/Terra`, file `video_refiner/refiner_model.pt`: a DeepSpeed-style
`torch.save` of `{"module": {"_forward_module.<sgm name>": tensor, ...}}`. We read it with
`torch.load(weights_only=True)`, which unpickles tensors and plain containers only and refuses
anything else. If Terra's file holds more than that (we could not download it to check), loading
stops with one line offering `terra refine convert --trust-checkpoint SRC DST.safetensors`: a
one-time conversion that runs the full unpickler on a file the user vouches for and writes the
tensors as safetensors, which load directly afterwards.

Loading is strict (see `load_weights`): every checkpoint tensor is either used or listed in
`keymap.IGNORED` with its reason, every parameter of our modules is filled, shapes must match,
and every error names the key.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from terra_cli.errors import InputError
from terra_cli.refiner import keymap
from terra_cli.refiner.config import TERRA_REFINER, RefinerConfig
from tokenizer_decoder.checkpoint import looks_like_hub_id, read_state_dict, resolve_checkpoint_dir
from tokenizer_decoder.errors import CheckpointError

REFINER_SUBFOLDER = "video_refiner"
REFINER_FILE = "refiner_model.pt"
CONVERTED_FILE = "refiner_model.safetensors"
PREFIX = "_forward_module."
CONFIG_KEY = "terra_refiner_config"  # our addition: small test checkpoints say their shapes; Terra's file has none


def resolve_refiner_file(spec: str) -> Path:
    """--refiner: a .pt/.safetensors file, a folder holding one (or a snapshot of turing-motors/Terra
    with video_refiner/ inside), or a hub id resolved through the local Hugging Face cache."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for folder in (path / REFINER_SUBFOLDER, path):
            for name in (CONVERTED_FILE, REFINER_FILE):
                if (folder / name).is_file():
                    return folder / name
        raise InputError(f"--refiner {spec}: no {CONVERTED_FILE} or {REFINER_FILE} in it or in its "
                         f"{REFINER_SUBFOLDER}/ folder")
    if not looks_like_hub_id(spec):
        raise InputError(f"--refiner {spec} does not exist (give the refiner's .pt or .safetensors, a folder, "
                         "or turing-motors/Terra)")
    repo = "/".join(spec.strip("/").split("/")[:2])
    sub = "/".join(spec.strip("/").split("/")[2:]) or REFINER_SUBFOLDER
    folder = resolve_checkpoint_dir(repo, sub, required_file=REFINER_FILE)
    return folder / REFINER_FILE


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], RefinerConfig]:
    """sgm-named tensors (DeepSpeed prefixes removed) and the shapes they were made for."""
    path = Path(path)
    if path.suffix == ".safetensors":
        state = read_state_dict([path])
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return state, _config_from(meta.get(CONFIG_KEY), path)
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes), not a refiner checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch's zip format, or a legacy pickle
        raise CheckpointError(f"{path} is not a torch checkpoint (neither torch's zip format nor a pickle); "
                              "give Terra's refiner .pt or a converted .safetensors")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds more than tensors (pickled objects terra will not execute: "
            f"{str(exc).splitlines()[0][:160]}); if you trust the file, convert it once: "
            f"terra refine convert --trust-checkpoint {path} {path.with_suffix('.safetensors')}"
        ) from exc
    except Exception as exc:  # a damaged file fails anywhere inside torch.load (IndexError, KeyError, ...)
        detail = str(exc).splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read {path} as a torch checkpoint: {detail}") from exc
    return _unwrap(raw, path)


def _unwrap(raw, path: Path) -> tuple[dict[str, torch.Tensor], RefinerConfig]:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a refiner checkpoint (a {type(raw).__name__}, not a dict)")
    config = _config_from(raw.get(CONFIG_KEY), path)
    module = raw.get("module", raw.get("state_dict", raw))
    if not isinstance(module, dict):
        raise CheckpointError(f"{path}: 'module' is a {type(module).__name__}, not a dict of tensors")
    state = {}
    for key, value in module.items():
        if key == CONFIG_KEY:
            continue
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {key!r} of the weights is a {type(value).__name__}, not a tensor")
        state[key.replace(PREFIX, "")] = value
    return state, config


def _config_from(text, path: Path) -> RefinerConfig:
    if text is None:
        return TERRA_REFINER
    try:
        return RefinerConfig.from_dict(json.loads(text))
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: bad {CONFIG_KEY} ({exc})") from exc


def expected_names(unet: torch.nn.Module, vae: torch.nn.Module, config: RefinerConfig) -> dict[str, tuple]:
    """checkpoint name -> (module, parameter name) for every tensor our modules need."""
    names = {}
    for key in unet.state_dict():
        names[keymap.UNET + keymap.unet_name(key, config)] = (unet, key)
    for key in vae.state_dict():
        names[keymap.vae_name(key, config)] = (vae, key)
    return names


def load_weights(unet, vae, state: dict[str, torch.Tensor], config: RefinerConfig, where: str, dtype=None) -> list[str]:
    """Fill `unet` and `vae` (built on the meta device) from sgm-named `state`; return the ignored
    names. Raises CheckpointError naming missing, unexpected and mis-shaped tensors."""
    wanted = expected_names(unet, vae, config)
    missing = sorted(set(wanted) - set(state))
    ignored = sorted(k for k in state if k not in wanted and keymap.ignored_reason(k) is not None)
    unexpected = sorted(k for k in state if k not in wanted and keymap.ignored_reason(k) is None)
    targets = {id(unet): unet.state_dict(), id(vae): vae.state_dict()}
    filled: dict[int, dict[str, torch.Tensor]] = {id(unet): {}, id(vae): {}}
    mismatched, wrong_dtype = [], []
    for name, (module, key) in wanted.items():
        if name not in state:
            continue
        tensor = state[name]
        if keymap.is_conv_attention(name) and tensor.ndim == 4 and tensor.shape[2:] == (1, 1):
            tensor = tensor[:, :, 0, 0]
        want = targets[id(module)][key]
        if tuple(tensor.shape) != tuple(want.shape):
            mismatched.append(f"{name} {tuple(tensor.shape)} (refiner config wants {tuple(want.shape)})")
            continue
        if tensor.is_floating_point() != want.is_floating_point() or tensor.is_complex():
            wrong_dtype.append(f"{name} is {str(tensor.dtype).removeprefix('torch.')} (wants a "
                              f"{'floating-point' if want.is_floating_point() else str(want.dtype)} tensor)")
            continue
        filled[id(module)][key] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    problems = []
    if missing:
        problems.append(f"missing: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected (neither used nor known to be unused): {_some(unexpected)}")
    if mismatched:
        problems.append("shape mismatch: " + "; ".join(mismatched[:3]) + (" ..." if len(mismatched) > 3 else ""))
    if wrong_dtype:
        problems.append("dtype mismatch: " + "; ".join(wrong_dtype[:3]) + (" ..." if len(wrong_dtype) > 3 else ""))
    if problems:
        raise CheckpointError(f"refiner checkpoint {where} does not fit Terra's refiner: " + " | ".join(problems))
    unet.load_state_dict(filled[id(unet)], strict=True, assign=True)
    vae.load_state_dict(filled[id(vae)], strict=True, assign=True)
    return ignored


def sgm_state_dict(unet, vae, config: RefinerConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our modules' weights under Terra's (sgm) names and shapes: what `load_weights` reads back.
    `dtype`: floating-point tensors cast to it, on the CPU."""
    state = {}
    for module, name_of in ((unet, lambda key: keymap.UNET + keymap.unet_name(key, config)),
                            (vae, lambda key: keymap.vae_name(key, config))):
        for key, value in module.state_dict().items():
            name = name_of(key)
            if keymap.is_conv_attention(name):  # Terra's VAE attention projections are 1x1 convolutions
                value = value[:, :, None, None]
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            state[name] = value.to("cpu", cast, copy=True).contiguous()
    return state


def save_safetensors(state: dict[str, torch.Tensor], config: RefinerConfig, path: Path) -> None:
    """sgm-named tensors as the safetensors file `terra refine convert` makes, its shapes in the metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"format": "pt", CONFIG_KEY: json.dumps(config.to_dict())})


def _some(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def ignored_summary(ignored: list[str]) -> str:
    """One line per ignored prefix: how many tensors, and why."""
    counts: dict[str, int] = {}
    for name in ignored:
        for prefix, _ in keymap.IGNORED:
            if name.startswith(prefix):
                counts[prefix] = counts.get(prefix, 0) + 1
    return "; ".join(f"{counts[p]} x {p}* ({why})" for p, why in keymap.IGNORED if p in counts)


def convert_checkpoint(src: Path, dst: Path, *, trust: bool, overwrite: bool = False) -> int:
    """Run the full unpickler on `src` (only with trust=True) and write its tensors as safetensors.
    Returns the number of tensors written."""
    from terra_cli.media.atomic import atomic_path

    if not trust:
        raise InputError("converting runs pickle code from the file: pass --trust-checkpoint if you trust "
                         f"{src} (e.g. it came from turing-motors/Terra)")
    if Path(dst).suffix != ".safetensors":
        raise InputError(f"the converted file must end in .safetensors, got {dst}")
    try:
        raw = torch.load(src, map_location="cpu", weights_only=False)  # the user vouched for this file
    except Exception as exc:
        raise CheckpointError(f"cannot read {src}: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from exc
    state, config = _unwrap(raw, Path(src))
    with atomic_path(Path(dst), overwrite) as tmp:
        mode = tmp.stat().st_mode & 0o777  # what the umask gives: safetensors writes a new 0600 file
        save_safetensors(state, config, tmp)
        tmp.chmod(mode)
    return len(state)
