"""`RefinerDecoder`: tokens -> refined frames, with the interface of the frame-wise decoder
(`decode_tokens(tokens, on_batch=...)`), so the pipeline and the scenario writer take either.

Which token decoder conditions the refiner: Terra's inference.yaml names `lfq_tokenizer_B_256`
(`token_decoder_config`), and the refiner checkpoint carries a copy of a token decoder's weights,
but generate.py overwrites `video_refiner.token_decoder` after loading with the tokenizer paired
with the world model (`lfq_tokenizer_B_256` for world_model, `lfq_tokenizer_B_256_ema` for
world_model_v2). So the refiner is conditioned on the frames the run's own tokenizer decodes,
which is what this class does; the checkpoint's copy is ignored (keymap.IGNORED).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner


@dataclass(frozen=True)
class RefinerChoice:
    """What --decoder refiner asks for: the weights, the device/dtype, and whether a CPU run
    estimated at hours may go ahead."""

    spec: str
    device: str = "auto"
    dtype: str = "auto"
    allow_slow: bool = False
    options: RefinerOptions = RefinerOptions()


class RefinerDecoder:
    seeded = True  # decode_tokens takes a seed (the refiner samples noise)

    def __init__(self, refiner: VideoRefiner, tokenizer, seed: int = 0):
        self.refiner, self.tokenizer, self.seed = refiner, tokenizer, seed

    @property
    def frame_size(self) -> tuple[int, int]:
        return self.refiner.config.height, self.refiner.config.width

    @torch.inference_mode()
    def token_frames(self, tokens) -> torch.Tensor:
        """The token decoder's frames (N, 3, 288, 512), float32, not clamped (the refiner clamps after resizing)."""
        return self.tokenizer.decode(self.tokenizer.tokens_to_codes(tokens)).float()

    def decode_tokens(self, tokens, *, seed: int | None = None, on_batch=None) -> np.ndarray:
        pixels = self.token_frames(tokens)
        frames = self.refiner.refine_pixels([pixels], [self.seed if seed is None else seed])[0]
        if on_batch is not None:
            on_batch(frames.shape[0])
        return frames

    def decode_many(self, videos: list, seeds: list[int], on_window=None) -> list[np.ndarray]:
        """Several videos' tokens at once: their windows share UNet calls."""
        return self.refiner.refine_pixels([self.token_frames(t) for t in videos], seeds, on_window)
