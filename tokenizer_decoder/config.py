"""The image tokenizer's config: a small dataclass read from / written to `config.json`.

The released `turing-motors/Terra` tokenizers are `transformers` remote-code models whose config
nests Open-MAGVIT2's `ddconfig` under `encoder_decoder_config` (Terra's own `generate.py` reads
`tokenizer.config.encoder_decoder_config["ch_mult"]` and `["z_channels"]`). We read that layout,
Open-MAGVIT2's own nesting (`ddconfig`, or a whole `model.init_args` block turned into JSON), and a
flat layout; the codebook size is taken from `codebook_size`, `n_embed` or `vocab_size` wherever
one of them sits, and must be 2**z_channels (lookup-free quantization has one bit per channel).

We write:

    {
      "model_type": "terra_lfq_tokenizer",
      "encoder_decoder_config": {"double_z": false, "z_channels": 18, "resolution": 256,
                                  "in_channels": 3, "out_ch": 3, "ch": 128,
                                  "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 2},
      "n_embed": 262144,
      "embed_dim": 18
    }
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError

CONFIG_NAME = "config.json"
MODEL_TYPE = "terra_lfq_tokenizer"

_NESTED_KEYS = ("encoder_decoder_config", "ddconfig")
_CODEBOOK_KEYS = ("codebook_size", "n_embed", "vocab_size")


@dataclass(frozen=True)
class TokenizerConfig:
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    z_channels: int = 18
    in_channels: int = 3
    out_ch: int = 3
    codebook_size: int = 2**18
    resolution: int = 256  # training crop size; informational only (the model is fully convolutional)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "ch_mult", tuple(int(m) for m in self.ch_mult))
        for name in ("ch", "num_res_blocks", "z_channels", "in_channels", "out_ch", "codebook_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.ch_mult or any(m <= 0 for m in self.ch_mult):
            raise ValueError(f"ch_mult must be a non-empty list of positive integers, got {list(self.ch_mult)}")
        # Upper bounds far above Terra's tokenizer (ch 128, 2 blocks, 5 levels): a hostile config
        # must not make the tokenizer allocate without end.
        for name, value, high in (("ch", self.ch, 1024), ("num_res_blocks", self.num_res_blocks, 16),
                                  ("in_channels", self.in_channels, 16), ("out_ch", self.out_ch, 16),
                                  ("len(ch_mult)", len(self.ch_mult), 8), ("max(ch_mult)", max(self.ch_mult), 16)):
            if value > high:
                raise ValueError(f"{name} is {value}; expected at most {high}")
        if self.z_channels > 62:
            raise ValueError(f"z_channels {self.z_channels} is too large for int64 token indices")
        if self.codebook_size != 2**self.z_channels:
            raise ValueError(
                f"codebook_size {self.codebook_size} must be 2**z_channels = {2**self.z_channels} "
                "for lookup-free quantization"
            )
        widths = {self.ch * m for m in self.ch_mult}
        bad = sorted(w for w in widths if w % 32)
        if bad:
            raise ValueError(f"channel widths {bad} (ch x ch_mult) must be multiples of 32 for GroupNorm(32)")

    # ------------------------------------------------------------------------------------------
    @property
    def downsample_factor(self) -> int:
        """Spatial reduction: one stride-2 stage per level but the last."""
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def codebook_bits(self) -> int:
        return self.z_channels

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.downsample_factor
        return math.ceil(height / f), math.ceil(width / f)

    def encoder_decoder_config(self) -> dict[str, Any]:
        return {
            "double_z": False,
            "z_channels": self.z_channels,
            "resolution": self.resolution,
            "in_channels": self.in_channels,
            "out_ch": self.out_ch,
            "ch": self.ch,
            "ch_mult": list(self.ch_mult),
            "num_res_blocks": self.num_res_blocks,
        }

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.extra.items() if k not in _NESTED_KEYS and k not in _CODEBOOK_KEYS}
        out.setdefault("model_type", MODEL_TYPE)
        out["encoder_decoder_config"] = self.encoder_decoder_config()
        out["n_embed"] = self.codebook_size
        out["embed_dim"] = self.z_channels
        return out

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TokenizerConfig":
        """Build from any of the layouts named in the module docstring; ValueError when it does not fit."""
        if not isinstance(raw, dict):
            raise ValueError("the config must be a JSON object")
        if raw.get("model_type") == "llama_action":
            raise ValueError("this is a Terra world-model config (model_type 'llama_action'), not an image tokenizer")
        top = raw
        # Open-MAGVIT2's training config turned into JSON: {"model": {"init_args": {"ddconfig": ..., "n_embed": ...}}}
        model = raw.get("model")
        if isinstance(model, dict):
            top = model.get("init_args") or model.get("params") or model
        dd = None
        for key in _NESTED_KEYS:
            if isinstance(top.get(key), dict):
                dd = top[key]
                break
        if dd is None:
            dd = top  # flat layout
        if "z_channels" not in dd or "ch" not in dd:
            raise ValueError(
                "no encoder/decoder settings found (expected 'encoder_decoder_config' with ch, ch_mult, "
                "num_res_blocks, z_channels): is this an image-tokenizer config?"
            )
        if dd.get("double_z"):
            raise ValueError("double_z is true: that is a KL autoencoder, not a lookup-free-quantization tokenizer")
        z_channels = dd["z_channels"]
        codebook = None
        for where in (top, dd, top.get("quantizer_config") or {}, raw):
            for key in _CODEBOOK_KEYS:
                if isinstance(where, dict) and where.get(key) is not None:
                    codebook = where[key]
                    break
            if codebook is not None:
                break
        embed_dim = top.get("embed_dim")
        if embed_dim is not None and embed_dim != z_channels:
            raise ValueError(f"embed_dim {embed_dim} differs from z_channels {z_channels}; Terra's LFQ has no projection")
        kwargs = dict(
            ch=dd["ch"],
            ch_mult=tuple(dd.get("ch_mult", cls.ch_mult)),
            num_res_blocks=dd.get("num_res_blocks", cls.num_res_blocks),
            z_channels=z_channels,
            in_channels=dd.get("in_channels", cls.in_channels),
            out_ch=dd.get("out_ch", dd.get("out_channels", cls.out_ch)),
            codebook_size=codebook if codebook is not None else 2**z_channels,
            resolution=dd.get("resolution", cls.resolution),
        )
        known = {*_NESTED_KEYS, *_CODEBOOK_KEYS, "embed_dim", "model", *kwargs, "double_z", "out_channels"}
        extra = {k: v for k, v in raw.items() if k not in known} if top is raw else {}
        return cls(**kwargs, extra=extra)

    @classmethod
    def load(cls, directory: str | Path) -> "TokenizerConfig":
        from .checkpoint import read_json_object

        path = Path(directory) / CONFIG_NAME
        raw = read_json_object(path, "tokenizer config")
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    def as_plain_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["ch_mult"] = list(self.ch_mult)
        return d


# Terra's released `lfq_tokenizer_B_256` (and `_ema`): Open-MAGVIT2's "256_B" setting.
TERRA_TOKENIZER_CONFIG = TokenizerConfig()


def small_config(ch: int = 32, z_channels: int = 10, num_res_blocks: int = 1, ch_mult=(1, 1, 2, 2, 4)) -> TokenizerConfig:
    """A small random-weights config with Terra's 16x downsampling, for tests and smoke runs."""
    return TokenizerConfig(ch=ch, ch_mult=tuple(ch_mult), num_res_blocks=num_res_blocks,
                           z_channels=z_channels, codebook_size=2**z_channels)
