"""Terra's image tokenizer and decoder: 288x512 RGB frames <-> 18x32 = 576 lookup-free-quantized tokens.

Importing this package does not import the CLI (`terra_cli.cli`); it needs torch, numpy, pillow and
safetensors only. See `modules.py` for which reference names and semantics were matched.
"""

from .config import TERRA_TOKENIZER_CONFIG, TokenizerConfig, small_config
from .modules import (
    LFQTokenizerModel,
    LookupFreeQuantizer,
    build_model,
    codes_to_indices,
    depth_to_space,
    indices_to_bits,
    indices_to_codes,
)
from .tokenizer import (
    DEFAULT_BATCH_SIZE,
    FRAME_HEIGHT,
    FRAME_WIDTH,
    ImageTokenizer,
    TokenizerInputError,
    pick_device,
    psnr,
)

TERRA_HUB_SUBFOLDER = "lfq_tokenizer_B_256"
TERRA_HUB_SUBFOLDER_EMA = "lfq_tokenizer_B_256_ema"

__all__ = [
    "DEFAULT_BATCH_SIZE", "FRAME_HEIGHT", "FRAME_WIDTH", "ImageTokenizer", "LFQTokenizerModel",
    "LookupFreeQuantizer", "TERRA_HUB_SUBFOLDER", "TERRA_HUB_SUBFOLDER_EMA", "TERRA_TOKENIZER_CONFIG",
    "TokenizerConfig", "TokenizerInputError", "build_model", "codes_to_indices", "depth_to_space",
    "indices_to_bits", "indices_to_codes", "pick_device", "psnr", "small_config",
]
