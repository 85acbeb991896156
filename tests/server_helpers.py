"""What the `terra serve` tests share: a tiny model the embedded tokenizer fits, and waiting."""

from __future__ import annotations

import time

import numpy as np

# 1024 codes: the embedded terra-mini tokenizer's, so contexts encode and frames decode. 5 frames per
# round: a session's sixth frame already rolls over into round 2.
SERVE_MAX_FRAMES = 5
SERVE_VOCAB = 1024


def serve_checkpoint(folder):
    from terra_cli.models.testing import tiny_config, write_tiny_checkpoint

    return write_tiny_checkpoint(folder, tiny_config(image_vocab=SERVE_VOCAB, max_frames=SERVE_MAX_FRAMES))


def default_tokenizer() -> str:
    from terra_cli.models.default import default_tokenizer_dir

    return str(default_tokenizer_dir())


def context_tokens(frames: int = 3, seed: int = 0, image_tokens: int = 576) -> list:
    return np.random.default_rng(seed).integers(0, SERVE_VOCAB, (frames, image_tokens)).tolist()


def wait_for(check, timeout: float = 120.0, every: float = 0.1):
    """The first truthy value of check(), or AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout} s: {check}")
        time.sleep(every)


def wait_job(client, job_id: str, timeout: float = 180.0) -> dict:
    def finished():
        body = client.get(f"/v1/videos/{job_id}").json()
        return body if body["status"] in ("done", "failed", "cancelled") else None

    return wait_for(finished, timeout, 0.2)
