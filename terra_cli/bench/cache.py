"""Folders the bench builds once and reuses (random Terra-size weights, a random tokenizer), safe
when several runs build the same one at once: one bench per GPU of a host is the normal thing.

Each run builds into its own temporary folder beside the entry and renames it into place. A
complete entry is only ever placed by that rename, so when another run placed it first, that
entry is as good as ours: ours is dropped and theirs used (no lock to go stale after a kill).
"""

from __future__ import annotations

import errno
import gc
import os
import tempfile
from pathlib import Path
from typing import Callable

from terra_cli.errors import InputError

COMPLETE_MARKER = "config.json"  # every entry holds one, and holds it only once it is in place


def is_complete(entry: Path) -> bool:
    return (entry / COMPLETE_MARKER).is_file()


def foreign_files(target: Path) -> str:
    return f"{target} holds files terra did not write; move them away or point TERRA_CACHE at another folder"


def cached_folder(target: Path, build: Callable[[Path], None], log: Callable[[str], None], what: str) -> Path:
    """`target`, built by `build(folder)` unless a complete entry is there (or arrives while we build)."""
    if is_complete(target):
        log(f"{what}: {target} (reused)")
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        # Not an entry of ours (those only ever arrive complete): someone else's files, never replaced.
        raise InputError(foreign_files(target))
    log(f"building {what} -> {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        built = Path(tmp) / "entry"
        build(built)
        try:
            os.replace(built, target)
        except OSError as exc:
            # ENOTEMPTY / EEXIST: a non-empty folder is already there, which only another run's rename puts
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not is_complete(target):  # foreign files arrived while we built
                raise InputError(foreign_files(target)) from exc
            log(f"{what}: another run placed {target} first; using it")
    return target


def write_random_terra_checkpoint(out_dir: Path, device: str, seed: int = 0) -> Path:
    """Terra's exact released config with random weights (transformers' init), in bf16."""
    import torch

    from terra_cli.models.checkpoint import save_checkpoint
    from terra_cli.models.config import LlamaActionConfig
    from terra_cli.models.modeling_hf import build_model
    from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG

    config = LlamaActionConfig.from_dict(dict(TERRA_WORLD_MODEL_CONFIG))
    torch.manual_seed(seed)
    model = build_model(config, device=device, dtype=torch.bfloat16)
    save_checkpoint(model, config, out_dir, max_shard_bytes=1 << 30)
    del model
    if str(device).startswith("cuda"):
        # Built in the process that then starts the engines (a Ray driver shares GPU 0 with engine
        # 0): torch's cache kept the 9.5 GB of the build, and vLLM refused to start beside it.
        gc.collect()
        torch.cuda.empty_cache()
    return out_dir


def random_model_cache() -> Path:
    """Where the bench keeps its random Terra-size checkpoint (TERRA_CACHE, else ~/.cache/terra)."""
    from terra_cli.runtime import terra_cache_dir

    return terra_cache_dir()


def random_terra_checkpoint(device: str, seed: int, log: Callable[[str], None] = print) -> Path:
    """Terra's config with random bf16 weights, written once per seed and reused: vLLM's compile
    cache is keyed by the model path, so a fresh temporary directory each run would recompile
    every time (benchmarks/README.md, start-up)."""
    return cached_folder(random_model_cache() / f"random-terra-seed{seed}",
                         lambda folder: write_random_terra_checkpoint(folder, device, seed), log,
                         "random Terra-size model (Terra's released config, 2.04B parameters, bf16)")


def bench_layout(model: str | None):
    """The frame layout of the model a bench will run: --model's, or Terra's for the random
    checkpoint, known before that is built (minutes, 4 GB), so a bench's checks come first."""
    from terra_cli.models.checkpoint import load_config
    from terra_cli.models.config import LlamaActionConfig
    from terra_cli.models.resolve import resolve_world_model_dir
    from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG

    if model:
        return load_config(resolve_world_model_dir(model)).layout
    return LlamaActionConfig.from_dict(dict(TERRA_WORLD_MODEL_CONFIG)).layout


def check_frames(model: str | None, frames: int, context_frames: int) -> int:
    """A bench's --frames and --context-frames against the round rules of the model it will run,
    before any model is built or loaded; the model's frames a round."""
    from terra_cli.pipeline import inputs
    from terra_cli.pipeline.rounds import plan_rounds

    if context_frames < 1:
        raise InputError(f"--context-frames must be at least 1, got {context_frames}")
    inputs.check_frame_count(frames, context_frames)
    round_frames = bench_layout(model).max_frames
    plan_rounds(context_frames, frames, round_frames)
    return round_frames


def check_engine_run(model: str | None, backend: str, options, device: str | None, frames: int,
                     context_frames: int) -> None:
    """A scenario-shaped bench's engine and frames, as the product's request layer checks them,
    before any model is built or loaded."""
    from terra_cli.pipeline.engine_request import check_backend_options, resolve_backend_name
    from terra_cli.runtime import resolve_device

    check_frames(model, frames, context_frames)
    check_backend_options(resolve_backend_name(backend), options, resolve_device(device))
