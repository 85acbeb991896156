"""The embedded default: terra-mini, shipped with the package so `terra generate` runs offline.

terra-mini is NOT Terra's released model. It is a small world model (6 layers, hidden 384,
8.7M parameters) and LFQ tokenizer (1024 codes, 576 tokens per 288x512 frame) in Terra's exact
formats, trained with scripts/train/train_tokenizer.py and scripts/train/train_world_model.py on terra's
procedural driving world (terra_cli/synthetic_world.py). Replacing it is a file swap: put another
checkpoint pair under assets/terra-mini/{world_model,tokenizer}.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "terra-mini"
DEFAULT_MODEL_LABEL = "terra-mini (embedded; trained on terra's synthetic road world, not Terra's released weights)"
SAMPLE_WORLD_SEED = 7
SAMPLE_SPEED_KMH = 30.0


def default_world_model_dir() -> Path:
    return ASSETS / "world_model"


def default_tokenizer_dir() -> Path:
    return ASSETS / "tokenizer"


def sample_context_frames(count: int = 3) -> np.ndarray:
    """The embedded context sample: `count` frames of the synthetic road, driving straight."""
    from terra_cli.actions import preset_actions
    from terra_cli.synthetic.dataset import render_rollout

    return render_rollout(SAMPLE_WORLD_SEED, preset_actions("straight", count, SAMPLE_SPEED_KMH))
