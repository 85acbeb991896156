"""Terra's image tokenizer and decoder: 288x512 RGB frames <-> 18x32 = 576 lookup-free-quantized tokens.

This package does not import terra_cli; it needs torch, numpy, pillow and safetensors only. Names
are loaded on first use, so `tokenizer_decoder.errors` is cheap to import (the CLI's --help needs
it without torch). See `modules.py` for which reference names and semantics were matched.
"""

from importlib import import_module

TERRA_HUB_SUBFOLDER = "lfq_tokenizer_B_256"
TERRA_HUB_SUBFOLDER_EMA = "lfq_tokenizer_B_256_ema"

_WHERE = {
    "TERRA_TOKENIZER_CONFIG": "config", "TokenizerConfig": "config", "small_config": "config",
    "LFQTokenizerModel": "modules", "LookupFreeQuantizer": "modules", "build_model": "modules",
    "codes_to_indices": "modules", "depth_to_space": "modules", "indices_to_bits": "modules",
    "indices_to_codes": "modules",
    "DEFAULT_BATCH_SIZE": "tokenizer", "FRAME_HEIGHT": "tokenizer", "FRAME_WIDTH": "tokenizer",
    "ImageTokenizer": "tokenizer", "pick_device": "tokenizer", "psnr": "tokenizer",
    "CheckpointError": "errors", "TokenizerInputError": "errors", "UserError": "errors",
}

__all__ = sorted([*_WHERE, "TERRA_HUB_SUBFOLDER", "TERRA_HUB_SUBFOLDER_EMA"])


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
