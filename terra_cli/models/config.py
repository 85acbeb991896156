"""`LlamaActionConfig`: Terra's world-model config, read from its released `config.json` unchanged.

The token layout every backend shares lives here too (`FrameLayout`), so that the transformers
reference, the vLLM model and the pipeline cannot disagree about where a frame starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, LlamaConfig

from terra_cli.errors import TerraError

ARCH_V1 = "LlamaActionForCausalLM"
ARCH_V2 = "LlamaActionV2ForCausalLM"
SUPPORTED_ARCHITECTURES = (ARCH_V1, ARCH_V2)


class ConfigError(TerraError, ValueError):
    """A config.json that cannot describe a Terra world model."""


# The schema config.json is checked against before transformers sees it: field -> (type, low, high).
# The bounds are far above Terra's released models (2B parameters) and low enough that a hostile
# file cannot make terra allocate or loop without end.
_INT_FIELDS = {
    "hidden_size": (1, 65536),
    "intermediate_size": (1, 262144),
    "num_hidden_layers": (1, 512),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "vocab_size": (2, 2**24),
    "max_position_embeddings": (1, 2**24),
    "num_image_patches": (1, 65536),
    "num_spatio_embeddings": (1, 65536),
    "num_temporal_embeddings": (1, 4096),
    "num_action_tokens": (1, 64),
    "num_action_embeddings": (1, 64),
    "action_dim": (1, 64),
    "head_dim": (1, 4096),
}
_POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "initializer_range")
KNOWN_TORCH_DTYPES = ("float32", "bfloat16", "float16", "auto")
MAX_PARAMETERS = 100e9


def check_config_schema(raw: dict, where) -> None:
    """Field types and ranges of a world-model config.json, each error naming the field, what it
    holds and what is expected."""
    def fail(field, expected):
        raise ConfigError(f"{where}: {field} is {raw.get(field)!r}; expected {expected}")

    for field, (low, high) in _INT_FIELDS.items():
        value = raw.get(field)
        if value is None and field in ("num_action_tokens", "num_action_embeddings", "head_dim", "num_key_value_heads"):
            continue
        if value is None:
            continue  # the class default (Terra's value) applies
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            fail(field, f"an integer from {low} to {high}")
    for field in _POSITIVE_FLOAT_FIELDS:
        value = raw.get(field)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            fail(field, "a positive finite number")
    hidden = raw.get("hidden_size", 4096)
    heads = raw.get("num_attention_heads", 32)
    kv_heads = raw.get("num_key_value_heads") or heads
    if raw.get("head_dim") is None and hidden % heads:
        fail("num_attention_heads", f"a divisor of hidden_size {hidden}")
    if heads % kv_heads:
        fail("num_key_value_heads", f"a divisor of num_attention_heads {heads}")
    for field in ("torch_dtype", "dtype"):
        value = raw.get(field)
        if value is not None and value not in KNOWN_TORCH_DTYPES:
            fail(field, f"one of {', '.join(KNOWN_TORCH_DTYPES)}")
    for field in ("rope_scaling", "rope_parameters"):
        value = raw.get(field)
        if value is None:
            continue
        if not isinstance(value, dict):
            fail(field, "null or an object such as {\"rope_type\": \"default\"}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind not in ("default", "linear", "dynamic", "yarn", "longrope", "llama3"):
            raise ConfigError(f"{where}: {field}.rope_type is {kind!r}; expected default, linear, dynamic, yarn, longrope or llama3")
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        fail("architectures", "a list of architecture names")
    layers = raw.get("num_hidden_layers", 32)
    inter = raw.get("intermediate_size", 11008)
    vocab = raw.get("vocab_size", 32000)
    params = layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden
    if params > MAX_PARAMETERS:
        raise ConfigError(f"{where}: these sizes make a model of about {params / 1e9:.0f}B parameters; terra loads "
                          f"at most {MAX_PARAMETERS / 1e9:.0f}B (is num_hidden_layers / hidden_size right?)")


@strict
class LlamaActionConfig(LlamaConfig):
    """Llama decoder over image tokens with per-frame action embeddings.

    Field defaults are the values of Terra's released `world_model/config.json`.
    """

    model_type = "llama_action"

    action_dim: int = 3
    # The published config class reads `num_action_embeddings` from the key `num_action_tokens`
    # (default 5) while the released files carry both keys. We read both and insist they agree.
    num_action_tokens: int | None = None
    num_action_embeddings: int | None = None
    num_image_patches: int = 576
    num_spatio_embeddings: int = 582
    num_temporal_embeddings: int = 25
    llm_model_type: str = "llama"

    def __post_init__(self, **kwargs):
        tokens, embeddings = self.num_action_tokens, self.num_action_embeddings
        if tokens is not None and embeddings is not None and tokens != embeddings:
            raise ConfigError(
                f"config.json has num_action_tokens={tokens} but num_action_embeddings={embeddings}; "
                "Terra uses one value for both (6 in the released models): make them equal"
            )
        resolved = tokens if tokens is not None else embeddings
        if resolved is None:
            resolved = 6
        self.num_action_tokens = self.num_action_embeddings = resolved
        super().__post_init__(**kwargs)
        self._check_layout()

    def _check_layout(self) -> None:
        if self.num_spatio_embeddings != self.num_image_patches + self.num_action_embeddings:
            raise ConfigError(
                f"num_spatio_embeddings ({self.num_spatio_embeddings}) must equal num_image_patches "
                f"({self.num_image_patches}) + num_action_embeddings ({self.num_action_embeddings}): "
                "one spatial slot per position of a frame"
            )
        if self.llm_model_type != "llama":
            raise ConfigError(f"llm_model_type {self.llm_model_type!r} is not supported; only 'llama' is")
        if self.vocab_size < 2:
            raise ConfigError("vocab_size must hold the image codes plus one special id")
        archs = self.architectures or [ARCH_V1]
        unknown = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unknown:
            raise ConfigError(
                f"architecture {unknown[0]!r} is not a Terra world model; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    # --- derived, not stored -------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return (self.architectures or [ARCH_V1])[0]

    @property
    def layout(self) -> "FrameLayout":
        return FrameLayout(
            image_tokens=self.num_image_patches,
            action_tokens=self.num_action_embeddings,
            max_frames=self.num_temporal_embeddings,
            image_vocab_size=self.vocab_size - 1,
        )


@dataclass(frozen=True)
class FrameLayout:
    """Where things sit in Terra's interleaved sequence.

    Frame k occupies positions [k * frame_stride, (k + 1) * frame_stride): first `image_tokens`
    image codes, then `action_tokens` action embeddings. Image codes are 0..image_vocab_size-1
    (0 is a valid code); `special_id` = image_vocab_size is Terra's bos/eos/pad and is never an
    image token. Action slots carry `action_placeholder_id` (= vocab size, outside the embedding
    table) so that no real code can be mistaken for an action slot.
    """

    image_tokens: int = 576
    action_tokens: int = 6
    max_frames: int = 25
    image_vocab_size: int = 2**18

    @property
    def frame_stride(self) -> int:
        return self.image_tokens + self.action_tokens

    @property
    def special_id(self) -> int:
        return self.image_vocab_size

    @property
    def action_placeholder_id(self) -> int:
        return self.image_vocab_size + 1

    @property
    def max_positions(self) -> int:
        return self.max_frames * self.frame_stride


def layout_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    image_vocab: int,
    architecture: str = ARCH_V1,
    image_tokens: int = 576,
    action_tokens: int = 6,
    max_frames: int = 25,
) -> LlamaActionConfig:
    """A float32 config of any decoder size with Terra's token layout: `image_vocab` codes plus
    the special id, `image_tokens` + `action_tokens` positions per frame, `max_frames` per round."""
    special = image_vocab
    return LlamaActionConfig(
        architectures=[architecture],
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=image_vocab + 1,
        bos_token_id=special,
        eos_token_id=special,
        pad_token_id=special,
        max_position_embeddings=max_frames * (image_tokens + action_tokens),
        num_image_patches=image_tokens,
        num_action_tokens=action_tokens,
        num_action_embeddings=action_tokens,
        num_spatio_embeddings=image_tokens + action_tokens,
        num_temporal_embeddings=max_frames,
        torch_dtype="float32",
    )


def register_auto_config() -> None:
    """Make `AutoConfig.from_pretrained` understand `model_type: llama_action` (idempotent)."""
    AutoConfig.register(LlamaActionConfig.model_type, LlamaActionConfig, exist_ok=True)


register_auto_config()
