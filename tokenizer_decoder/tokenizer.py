"""`ImageTokenizer`: RGB frames <-> (18 x 32 = 576) LFQ tokens per frame, in bounded-size batches.

Preprocessing follows Terra's `generate.py`: PIL `convert("RGB")`, `resize((512, 288))` with PIL's
default filter, `x / 127.5 - 1` as float32, CHW. Decoded frames are clamped to [-1, 1] and mapped
back with `((x + 1) / 2 * 255).astype(uint8)` (truncation, as Terra's `to_np_images` does).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from .checkpoint import (
    WEIGHTS_NAME,
    check_state_dict,
    read_state_dict,
    resolve_checkpoint_dir,
    weight_files,
)
from .config import TokenizerConfig
from .errors import TokenizerInputError, error_summary
from .host_copies import LaggedHostCopies
from .modules import LFQTokenizerModel, build_model, drop_optional_quantize_buffers, expected_shapes, indices_to_codes

FRAME_HEIGHT = 288
FRAME_WIDTH = 512
DEFAULT_BATCH_SIZE = 8


def pick_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise TokenizerInputError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TokenizerInputError(f"device {device} asked for, but no CUDA GPU is available")
    return dev


class ImageTokenizer:
    """Terra's LFQ image tokenizer and decoder.

    >>> tok = ImageTokenizer.from_pretrained("turing-motors/Terra", subfolder="lfq_tokenizer_B_256")
    >>> tokens = tok.tokenize(frames)          # (N, 576) int64
    >>> images = tok.decode_tokens(tokens)     # (N, 288, 512, 3) uint8
    """

    def __init__(
        self,
        model: LFQTokenizerModel,
        *,
        device: str | torch.device | None = "auto",
        batch_size: int = DEFAULT_BATCH_SIZE,
        image_size: tuple[int, int] = (FRAME_HEIGHT, FRAME_WIDTH),
        source: str | None = None,
    ):
        if batch_size < 1:
            raise TokenizerInputError(f"batch size must be at least 1, got {batch_size}")
        height, width = image_size
        f = model.config.downsample_factor
        if height % f or width % f:
            raise TokenizerInputError(f"image size {height}x{width} must be a multiple of {f} in both sides")
        self.device = pick_device(device)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.config = model.config
        self.batch_size = batch_size
        self.image_size = (height, width)
        self.source = source
        self._compiled_decode = None  # set by compile_decoder()
        self.decoder_compile_error: str | None = None
        # tokenize() pads a last, shorter batch to `batch_size` on CUDA, where cuDNN picks its
        # convolution algorithm per input shape and another algorithm may round a latent near zero
        # to the other code: a frame's tokens must not depend on how many frames came with it (a Ray
        # engine's intake batches whatever contexts are waiting).
        self.full_encode_batches = self.device.type == "cuda"

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: TokenizerConfig, *, seed: int | None = 0, **kwargs) -> "ImageTokenizer":
        """Random weights (for tests and smoke runs); `seed` makes them reproducible."""
        with _seeded(seed):
            model = build_model(config, "cpu")
        return cls(model, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        dir_or_hub_id: str | os.PathLike,
        subfolder: str | None = None,
        *,
        device: str | torch.device | None = "auto",
        batch_size: int = DEFAULT_BATCH_SIZE,
        image_size: tuple[int, int] = (FRAME_HEIGHT, FRAME_WIDTH),
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> "ImageTokenizer":
        """Load config.json + model.safetensors strictly (every key, every shape, nothing extra)."""
        directory = resolve_checkpoint_dir(dir_or_hub_id, subfolder, revision=revision, cache_dir=cache_dir)
        config = TokenizerConfig.load(directory)
        model = build_model(config, "meta")
        state = read_state_dict(weight_files(directory), dtype=torch.float32)
        drop_optional_quantize_buffers(state, config, directory)
        check_state_dict(expected_shapes(model), state, f"tokenizer checkpoint {directory}")
        model.load_state_dict(state, strict=True, assign=True)
        return cls(model, device=device, batch_size=batch_size, image_size=image_size, source=str(directory))

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors (float32) in the layout `from_pretrained` reads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    # -- geometry -------------------------------------------------------------------------------
    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.config.latent_hw(*self.image_size)

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.latent_hw
        return h * w

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- pixels <-> tensors ---------------------------------------------------------------------
    def resize_frames(self, images: Sequence) -> list[np.ndarray]:
        """PIL images or uint8 arrays -> RGB uint8 (H, W, 3) at the tokenizer's size, resized as Terra does."""
        return resize_frames(images, self.image_size)

    def preprocess(self, images: Sequence) -> torch.Tensor:
        """PIL images or uint8 HxWx3 arrays -> float32 (B, 3, H, W) in [-1, 1] on the CPU."""
        height, width = self.image_size
        arrays = [(frame / 127.5 - 1.0).astype(np.float32) for frame in self.resize_frames(images)]
        if not arrays:
            return torch.empty((0, 3, height, width))
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()

    @staticmethod
    def postprocess(pixels: torch.Tensor) -> np.ndarray:
        """(B, 3, H, W) in [-1, 1] -> uint8 (B, H, W, 3) on the host (`to_uint8`)."""
        return ImageTokenizer.to_uint8(pixels).cpu().numpy()

    @staticmethod
    def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> uint8 (B, H, W, 3) where the pixels are, in float32 and in Terra's
        order (clamp, +1, /2, x255, truncate), so the host gets a quarter of the bytes and no per-pixel
        work: a scenario writer process is CPU-bound (benchmarks/README.md)."""
        x = (pixels.detach().float().clamp(-1.0, 1.0) + 1.0) / 2.0
        return (x * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    # -- latents ----------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> pre-quantization latents (B, z_channels, H/16, W/16), float32."""
        outs = []
        for chunk in _chunks(pixels, self.batch_size):
            with self._autocast():
                outs.append(self.model.encode(chunk.to(self.device, torch.float32)).float())
        return torch.cat(outs) if outs else pixels.new_empty((0, self.config.z_channels, *self.latent_hw))

    @torch.inference_mode()
    def quantize(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents -> (+-1 codes of the same shape, (B, h*w) int64 token indices)."""
        return self.model.quantize(latents)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, z_channels, h, w) codes -> (B, 3, 16h, 16w) pixels, float32, not clamped."""
        outs = []
        for chunk in _chunks(codes, self.batch_size):
            with self._autocast():
                outs.append(self.model.decode(chunk.to(self.device, torch.float32)).float())
        if not outs:
            h, w = codes.shape[-2:]
            f = self.config.downsample_factor
            return codes.new_empty((0, self.config.out_ch, h * f, w * f), dtype=torch.float32)
        return torch.cat(outs)

    def tokens_to_codes(self, tokens) -> torch.Tensor:
        """(B, h*w) token indices -> (B, z_channels, h, w) +-1 codes."""
        return self._codes(self._check_tokens(tokens))

    def _codes(self, checked: torch.Tensor) -> torch.Tensor:
        """`tokens_to_codes` of checked tokens, computed on their device (no copy, no wait)."""
        h, w = self.latent_hw
        return indices_to_codes(checked.reshape(-1, h, w), self.config.z_channels).permute(0, 3, 1, 2).contiguous()

    # -- frames <-> tokens ------------------------------------------------------------------------
    @torch.inference_mode()
    def tokenize(self, images: Sequence, *, on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """Frames (PIL images or uint8 HxWx3 arrays, any size) -> (N, 576) int64 tokens.

        Frames are preprocessed and encoded `batch_size` at a time (with `full_encode_batches`, on
        CUDA, a last shorter batch padded with copies of its last frame); `on_batch(n)` is called
        after each batch with the number of frames it held.
        """
        images = list(images)
        out = np.empty((len(images), self.tokens_per_frame), dtype=np.int64)
        for start in range(0, len(images), self.batch_size):
            batch = images[start:start + self.batch_size]
            pixels = self.preprocess(batch)
            if self.full_encode_batches:
                pixels = pad_batch(pixels, self.batch_size)
            with self._autocast():
                latents = self.model.encode(pixels.to(self.device))
            _, indices = self.model.quantize(latents)
            out[start:start + len(batch)] = indices[:len(batch)].cpu().numpy()
            if on_batch is not None:
                on_batch(len(batch))
        return out

    def compile_decoder(self, mode: str | None = None) -> bool:
        """Run full batches (`decode_tokens(full_batches=True)`) through `torch.compile` of the
        decoder (in torch.compile's `mode`, None: its default): static shapes, since a full batch
        always has `batch_size` frames. Only on CUDA, where Inductor fuses the GroupNorm/SiLU passes
        that dominate its memory traffic; if the first compiled call fails, the eager decoder takes
        over and `decoder_compile_error` says why. Returns whether a compiled decoder is set."""
        if self.device.type != "cuda" or not hasattr(torch, "compile"):
            return False
        if self._compiled_decode is None:  # every writer of a run shares one tokenizer: compile once
            self._compiled_decode = torch.compile(self.model.decode, dynamic=False, mode=mode)
        return True

    def _decode_batch(self, codes: torch.Tensor, full: bool) -> torch.Tensor:
        if full and self._compiled_decode is not None and self.decoder_compile_error is None:
            try:
                return self._compiled_decode(codes)
            except Exception as error:  # noqa: BLE001 - no compiler or Triton here: the eager decoder is correct too
                self.decoder_compile_error = error_summary(error)
        return self.model.decode(codes)

    @torch.inference_mode()
    def decode_tokens(self, tokens, *, on_batch: Callable[[int], None] | None = None,
                      full_batches: bool = False, batch_size: int | None = None) -> np.ndarray:
        """(N, 576) (or (576,)) token indices -> (N, H, W, 3) uint8 frames, `batch_size` (by default the
        tokenizer's) frames at a time.

        `full_batches`: a last, shorter batch is padded to `batch_size` (with copies of its last
        frame), so every frame goes through kernels of one shape and its pixels do not depend on how
        many frames were decoded with it (kernels for another batch size may round differently).
        A writer that decodes frames as they arrive, a few at a time, then makes the video a decode
        of the whole video makes."""
        t = self._check_tokens(tokens)
        batch = self.batch_size if batch_size is None else batch_size
        if batch < 1:
            raise TokenizerInputError(f"batch size must be at least 1, got {batch}")
        height, width = self.image_size
        frames = np.empty((t.shape[0], height, width, 3), dtype=np.uint8)
        t = t.to(self.device)  # one copy: a copy per batch would wait for the batches queued before it
        copies = LaggedHostCopies(self.device)
        for start in range(0, t.shape[0], batch):
            rows = t[start:start + batch]
            count = rows.shape[0]
            if full_batches:
                rows = pad_batch(rows, batch)
            codes = self._codes(rows)
            with self._autocast():
                pixels = self._decode_batch(codes, full_batches)

            def deliver(host: np.ndarray, start: int = start, count: int = count) -> None:
                frames[start:start + count] = host
                if on_batch is not None:
                    on_batch(count)

            copies.put(self.to_uint8(pixels[:count]), deliver)
        copies.finish()
        return frames

    def reconstruct(self, images: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """Frames -> (tokens, decoded frames)."""
        tokens = self.tokenize(images)
        return tokens, self.decode_tokens(tokens)

    def _check_tokens(self, tokens) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, torch.Tensor) else tokens)
        per_frame = self.tokens_per_frame
        if t.ndim == 1 and t.numel() % per_frame == 0:
            t = t.reshape(-1, per_frame)
        if t.ndim != 2 or t.shape[1] != per_frame:
            raise TokenizerInputError(f"tokens must have shape (frames, {per_frame}), got {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TokenizerInputError(f"tokens must be integers, got {t.dtype}")
        t = t.long()
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.codebook_size):
            raise TokenizerInputError(
                f"token values must lie in [0, {self.codebook_size}), got {int(t.min())}..{int(t.max())}"
            )
        return t.cpu()


# ---------------------------------------------------------------------------------------------
def psnr(reference: np.ndarray, reconstruction: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images of the same shape (inf when identical)."""
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(reconstruction, dtype=np.float64)
    if a.shape != b.shape:
        raise TokenizerInputError(f"PSNR needs images of the same shape, got {a.shape} and {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def resize_frames(images: Sequence, image_size: tuple[int, int] = (FRAME_HEIGHT, FRAME_WIDTH)) -> list[np.ndarray]:
    """PIL images or uint8 arrays -> RGB uint8 (H, W, 3) at `image_size`, resized as Terra does.
    A frame already at that size comes back unchanged (Pillow copies it), so frames resized ahead,
    elsewhere (a Ray driver's readers), tokenize exactly as the originals do."""
    height, width = image_size
    return [np.asarray(_to_pil(image, i).convert("RGB").resize((width, height))) for i, image in enumerate(images)]


def _to_pil(image, index: int):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise TokenizerInputError(f"frame {index}: expected a uint8 image array, got {arr.dtype}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise TokenizerInputError(f"frame {index}: expected an HxWx3 image array, got shape {arr.shape}")
    return Image.fromarray(arr)


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x` (B, ...) with B <= size, padded to `size` rows with copies of its last: kernels of one
    batch shape for every call, so a row's result never depends on how many came with it."""
    return x if x.shape[0] >= size else torch.cat([x, x[-1:].expand(size - x.shape[0], *x.shape[1:])])


def _chunks(x: torch.Tensor, size: int) -> Iterable[torch.Tensor]:
    for start in range(0, x.shape[0], size):
        yield x[start:start + size]


@contextlib.contextmanager
def _seeded(seed: int | None):
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
