"""Which world model and which image tokenizer: the one place a --model / --variant / --tokenizer
triple becomes directories, used by generate, eval, bench and tokenize alike.

A model is the embedded terra-mini (no --model), a local directory (a checkpoint, or a snapshot
of turing-motors/Terra holding world_model*/ and lfq_tokenizer_*/), or a hub id resolved through
the local Hugging Face cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from terra_cli.errors import InputError
from terra_cli.models.checkpoint import TERRA_HUB_ID, looks_like_hub_id, resolve_checkpoint_dir

VARIANTS = ("world_model", "world_model_v2")
# Terra's released checkpoints pair each world model with the tokenizer it was trained on.
PAIRED_TOKENIZER = {"world_model": "lfq_tokenizer_B_256", "world_model_v2": "lfq_tokenizer_B_256_ema"}
DEFAULT_TOKENIZER_SUBFOLDER = PAIRED_TOKENIZER["world_model"]


@dataclass(frozen=True)
class TokenizerSpec:
    source: str  # a directory or a hub repo id
    subfolder: str | None


@dataclass(frozen=True)
class ModelChoice:
    world_model_dir: Path
    tokenizer: TokenizerSpec | None  # None: the world model comes without one
    label: str
    is_default: bool


@dataclass(frozen=True)
class ModelSpec:
    """The model as the user named it (--model, --variant, --tokenizer): plain data that travels to
    wherever the engine runs (a Ray node resolves its own copy or hub download) and becomes a
    `ModelChoice` there."""

    model: str | None = None  # None: the embedded terra-mini
    variant: str = "world_model"
    tokenizer: str | None = None

    def resolve(self) -> ModelChoice:
        return resolve_model(self.model, self.variant, self.tokenizer)


def resolve_model(model: str | None, variant: str = "world_model", tokenizer: str | None = None) -> ModelChoice:
    """The world-model directory and its tokenizer: the embedded default, a local dir or a hub id."""
    from terra_cli.models.default import DEFAULT_MODEL_LABEL, default_tokenizer_dir, default_world_model_dir

    if variant not in VARIANTS:
        raise InputError(f"--variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    override = split_tokenizer_spec(tokenizer, PAIRED_TOKENIZER[variant]) if tokenizer is not None else None
    if model is None:
        return ModelChoice(default_world_model_dir(), override or TokenizerSpec(str(default_tokenizer_dir()), None),
                           DEFAULT_MODEL_LABEL, True)
    path = Path(model).expanduser()
    if path.exists() or not looks_like_hub_id(model):
        world_dir = resolve_checkpoint_dir(model, variant)
        paired = None
        # A local snapshot of turing-motors/Terra: DIR/world_model(_v2) next to DIR/lfq_tokenizer_*.
        if world_dir.resolve() != path.resolve():
            candidate = path / PAIRED_TOKENIZER[variant]
            if (candidate / "config.json").is_file():
                paired = TokenizerSpec(str(candidate), None)
        return ModelChoice(world_dir, override or paired, str(world_dir), False)
    if model.strip("/") == TERRA_HUB_ID:
        world_dir = resolve_checkpoint_dir(TERRA_HUB_ID, variant)
        return ModelChoice(world_dir, override or TokenizerSpec(TERRA_HUB_ID, PAIRED_TOKENIZER[variant]),
                           f"{TERRA_HUB_ID}/{variant}", False)
    repo, sub = _split_hub(model)
    return ModelChoice(resolve_checkpoint_dir(repo, sub), override, model, False)


def resolve_world_model_dir(model: str | None, variant: str = "world_model") -> Path:
    """Just the world model (bench and eval need no paired tokenizer)."""
    return resolve_model(model, variant).world_model_dir


def _split_hub(spec: str) -> tuple[str, str | None]:
    parts = spec.strip("/").split("/")
    return "/".join(parts[:2]), ("/".join(parts[2:]) or None)


def split_tokenizer_spec(spec: str, terra_subfolder: str = DEFAULT_TOKENIZER_SUBFOLDER) -> TokenizerSpec:
    """--tokenizer: a local dir (DIR/<terra_subfolder> is tried first, then DIR) or `owner/name[/subfolder]`;
    turing-motors/Terra alone means its `terra_subfolder` tokenizer."""
    if Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return TokenizerSpec(spec, terra_subfolder)
    repo, sub = _split_hub(spec)
    if sub is None and repo == TERRA_HUB_ID:
        sub = terra_subfolder
    return TokenizerSpec(repo, sub)


def load_tokenizer(spec: TokenizerSpec, device: str, matching=None):
    """The image tokenizer; with `matching` (a world model's config), checked against its codes."""
    from tokenizer_decoder import DEFAULT_BATCH_SIZE, ImageTokenizer

    from terra_cli.runtime import tokenizer_batch_asked

    batch_size = tokenizer_batch_asked() or DEFAULT_BATCH_SIZE
    tokenizer = ImageTokenizer.from_pretrained(spec.source, spec.subfolder, device=device, batch_size=batch_size)
    if matching is not None:
        check_tokenizer_matches(tokenizer, matching)
    return tokenizer


def check_tokenizer_matches(tokenizer, config) -> None:
    layout = config.layout
    if tokenizer.codebook_size != layout.image_vocab_size:
        raise InputError(
            f"tokenizer {tokenizer.source} has {tokenizer.codebook_size} codes but the world model expects "
            f"{layout.image_vocab_size} (vocab_size - 1); pass the tokenizer it was trained with (--tokenizer)"
        )
    if tokenizer.tokens_per_frame != layout.image_tokens:
        raise InputError(
            f"tokenizer {tokenizer.source} makes {tokenizer.tokens_per_frame} tokens per frame but the world model "
            f"expects {layout.image_tokens}"
        )
