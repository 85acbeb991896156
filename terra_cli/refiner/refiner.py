"""`VideoRefiner`: Terra's video refiner end to end, from token-decoded frames to refined frames.

Per video (Terra's `video_refiner_decode`): the token decoder's frames are resized to 384x640,
clamped and VAE-encoded once (the concat condition); windows of 25 frames (`windows.py`) are
sampled from seeded noise (`sampler.py`); each window's frames that overlap the previous window
are dropped; the remaining latents are decoded frame by frame (`autoencoder.py`).

Speed: windows of several videos (and, with `same_uncond=False`, both halves of the guidance
pair) go through the UNet in one call (`batch_windows`, fixed per run); `compile` hands the UNet
to torch.compile (`compiled.py`: `auto` compiles on a GPU), padding a short group to
`batch_windows` so every call has the same shapes, and the VAE decoder too (`vae_chunk` frames a
call; if its first call fails, the eager decoder decodes the rest of the run). Each window's
noise comes from its own CPU generator, seeded `seeds.draw_seed(video seed, window index)`, so a
video's result does not depend on which videos share its UNet calls, nor on how many windows a
call takes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from terra_cli.errors import InputError, error_summary
from terra_cli.refiner import sampler, unet_ops
from terra_cli.refiner.autoencoder import build_vae, condition_pixels, decode_latents, encode_condition, use_center_taps
from terra_cli.refiner.compiled import (COMPILE_MODES, VAE_DECODER_MODE, compile_unet, compile_vae_decoder,
                                        resolve_compile_mode, tracing_quietly, uses_cuda_graphs)
from terra_cli.refiner.config import TERRA_REFINER, RefinerConfig
from terra_cli.refiner.fp8 import COMPUTE_BOUND_FLOP_PER_BYTE, check_refiner_dtype, quantize_unet_linears
from terra_cli.refiner.unet import (added_time_ids, build_unet, channels_last_frames, use_channels_last,
                                    use_sdpa_backend, zero_context)
from terra_cli.refiner.windows import check_frames, kept_frames, start_end_indices
from terra_cli.runtime import RefinerSwitches, refiner_switches_asked

LOG = logging.getLogger("terra.refiner")  # the CLI prints it (cli/app.py)
# --refiner-windows by default, for one video: compiled on an H100, 2 windows per UNet call took 1.20 s
# a window against 1.35 s for 1, in one call (benchmarks/README.md, 2026-11-26); more would pad its
# calls (a 5-window video in calls of 4 pays for 8).
WINDOWS_PER_CALL = 2
# ... and for many videos, whose windows share calls (--scenarios, `bench --act-bench`): 4, what every
# end-to-end refiner run measured, 1.147-1.170 s a window on H200s, where 8 a call was no faster in the
# same call (2026-11-27/28); 2 and 4 were not yet timed in one call (1.196-1.20 s for 2 on H100s).
POOLED_WINDOWS_PER_CALL = 4


def windows_per_call(asked: int | None, frames: int | None = None) -> int:
    """--refiner-windows as asked; by default POOLED_WINDOWS_PER_CALL for many videos (`frames`
    None), else WINDOWS_PER_CALL but no more than the one video of `frames` has (a compiled call
    pads a short group, and a padded window costs as much as a real one)."""
    if asked is not None:
        return asked
    if frames is None:
        return POOLED_WINDOWS_PER_CALL
    from terra_cli.refiner.windows import count_windows

    return min(WINDOWS_PER_CALL, count_windows(frames)) if frames >= 25 else 1


@dataclass(frozen=True)
class RefinerOptions:
    same_uncond: bool = True  # Terra's unconditional input equals the conditional one: one UNet call per step
    batch_windows: int = 1  # windows (of any videos) per UNet call
    compile: str = "auto"  # compiled.COMPILE_MODES; auto: Inductor's default mode on a GPU, eager on a CPU
    exact_cross_attention: bool = True  # closed form of attention over the one zero context token
    vae_chunk: int = 4  # frames per VAE decoder call
    dtype: str = "auto"  # --refiner-dtype: auto (the run's dtype throughout) or fp8 (fp8.py: the UNet's transformer Linears)


class VideoRefiner:
    def __init__(self, unet, vae, config: RefinerConfig, *, device: str, dtype: torch.dtype, source: str,
                 options: RefinerOptions = RefinerOptions(), ignored: list[str] | None = None):
        if options.compile not in COMPILE_MODES:
            raise InputError(f"--refiner-compile must be one of {', '.join(COMPILE_MODES)}, got {options.compile!r}")
        if options.batch_windows < 1:
            raise InputError(f"--refiner-windows (windows per UNet call) must be at least 1, got {options.batch_windows}")
        self.config, self.device, self.dtype, self.source, self.options = config, device, dtype, source, options
        self.unet, self.vae = unet, vae
        self.center_tap_convs = use_center_taps(vae.decoder)  # every decode is of one-frame clips: the same sum
        self.switches_asked = refiner_switches_asked()  # TERRA_REFINER_*, read once; `switches` resolves them
        self.fp8_layers = 0  # Linear layers turned into fp8.Fp8Linear (--refiner-dtype fp8)
        if check_refiner_dtype(options.dtype) == "fp8":
            least = COMPUTE_BOUND_FLOP_PER_BYTE if self.switches_asked.fp8_layers == "compute-bound" else 0.0
            self.fp8_layers = quantize_unet_linears(unet, min_flop_per_byte=least)
            LOG.info(f"refiner: {self.fp8_layers} UNet Linear layers in fp8 (--refiner-dtype fp8: opt-in; on an H100 "
                     f"it measured slower than bf16, docs/refiner.md)")
        self.ignored = ignored or []
        self.target_device = device  # where refining runs (load_refiner loads on the CPU first)
        self.forward = None  # the UNet, eager or compiled: chosen at the first call, on the device it runs on
        self.compile_mode = "none"  # what the first call resolved `options.compile` to
        self.compile_seconds = 0.0  # the first (compiling) call's time, 0 when eager
        self.vae_decoder = None  # the compiled VAE decoder; None: eager
        self.vae_decoder_chosen = False  # eager or compiled chosen for the device the weights are on
        self.vae_decoder_compile_seconds = 0.0  # its first (compiling) call's time, 0 when eager
        self.vae_decoder_error: str | None = None  # why its first call failed; the eager decoder then decodes
        self.unet_calls = 0
        self.sigmas = sampler.edm_sigmas(config.steps, config.sigma_min, config.sigma_max, config.rho)
        self.scales = sampler.guidance_scales(config.window, config.min_scale, config.max_scale)

    @property
    def switches(self) -> RefinerSwitches:
        """The switches for the device the weights are on now, not the one they were loaded on: the
        product loads on the CPU and moves to the GPU (`load_refiner`), while its compile-apart child
        loads straight onto the GPU. Resolved at load, the parent ran NCHW and the child channels-last:
        two graphs, so the parent's compile missed the child's cache (118 s, H200, 2026-11-29)."""
        return self.switches_asked.for_device(self.device)

    @property
    def vae_memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.switches.channels_last else torch.contiguous_format

    # -- construction -----------------------------------------------------------------------------
    def to(self, device: str) -> "VideoRefiner":
        """Move the weights (e.g. onto the GPU once the world model has let it go)."""
        self.unet.to(device)
        self.vae.to(device)
        if device != self.device:
            self.forward = None  # eager or compiled is chosen again for the new device
            self.vae_decoder, self.vae_decoder_chosen = None, False
        self.device = device
        return self

    @classmethod
    def from_checkpoint(cls, spec: str, device: str = "auto", dtype: str = "auto",
                        options: RefinerOptions = RefinerOptions()) -> "VideoRefiner":
        from terra_cli.refiner.checkpoint import load_weights, read_checkpoint, resolve_refiner_file
        from terra_cli.runtime import resolve_device, resolve_dtype

        path = resolve_refiner_file(spec)
        state, config = read_checkpoint(path)
        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)  # (a dtype name for another device may come in: bf16 on the CPU)
        unet = build_unet(config, "meta", exact_cross_attention=options.exact_cross_attention)
        vae = build_vae(config, "meta")
        ignored = load_weights(unet, vae, state, config, str(path))
        del state
        # Terra's first stage (the decoder) runs in float32; the UNet and the condition encoder in
        # the model dtype (Terra casts the conditioner to bf16).
        torch.nn.Module.to(unet, device=device, dtype=torch_dtype)  # (ModelMixin.to warns about dtypes)
        vae.decoder.to(device=device, dtype=torch.float32)
        vae.encoder.to(device=device, dtype=torch_dtype)
        vae.quant_conv.to(device=device, dtype=torch_dtype)
        return cls(unet, vae, config, device=device, dtype=torch_dtype, source=str(path), options=options,
                   ignored=ignored)

    @classmethod
    def random(cls, config: RefinerConfig = TERRA_REFINER, device: str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, options: RefinerOptions = RefinerOptions()) -> "VideoRefiner":
        """Random weights in `config`'s shapes (benchmarks, tests)."""
        torch.manual_seed(seed)
        unet = build_unet(config, device, dtype, exact_cross_attention=options.exact_cross_attention)
        vae = build_vae(config, device, dtype)
        vae.decoder.to(torch.float32)
        return cls(unet, vae, config, device=device, dtype=dtype, source="random weights", options=options)

    # -- the denoiser network ---------------------------------------------------------------------
    def network(self, x_in: torch.Tensor, c_noise: torch.Tensor, concat: torch.Tensor) -> torch.Tensor:
        """F(c_in x, c_noise) for windows (B, F, 4, h, w) with their concat condition (B, F, 4, h, w)."""
        self.prepare()
        self.unet_calls += 1
        return self._call_unet(torch.cat([x_in, concat], dim=2), c_noise)

    def _call_unet(self, sample: torch.Tensor, c_noise: torch.Tensor) -> torch.Tensor:
        batch = sample.shape[0]
        if uses_cuda_graphs(self.compile_mode):
            # each call starts a new step for CUDA graph trees: the previous call's output (read
            # by the sampler before this call) may then be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        sample = sample.to(self.device, self.dtype)
        if self.switches.channels_last:
            sample = channels_last_frames(sample)
        out = self.forward(sample, c_noise.to(self.device),
                           zero_context(batch, self.config, self.device, self.dtype),
                           added_time_ids(batch, self.config, self.device, torch.float32), return_dict=False)[0]
        return out.clone() if uses_cuda_graphs(self.compile_mode) else out

    @torch.inference_mode()
    def prepare(self) -> float:
        """Choose eager or compiled for the device the weights are on; a compiled UNet is compiled
        here, by one call on zeros in the run's shape (`batch_windows` windows), timed and logged.
        Returns the compile's seconds (0 when eager or already prepared)."""
        if self.forward is not None:
            return 0.0
        self.apply_switches()
        self.compile_mode = resolve_compile_mode(self.options.compile, self.device)
        if self.compile_mode == "none":
            self.forward = self.unet
            return 0.0
        self.forward = compile_unet(self.unet, self.compile_mode)
        from terra_cli.refiner.compiled import inductor_cache_dir

        config, batch = self.config, self.options.batch_windows
        h, w = config.latent_hw
        started = time.perf_counter()
        with tracing_quietly():
            self._call_unet(torch.zeros(batch, config.window, config.in_channels, h, w),
                            torch.zeros(batch, dtype=torch.float32))
        self._synchronize()
        self.compile_seconds = time.perf_counter() - started
        layout = "channels-last" if self.switches.channels_last else "NCHW"  # a parent and its child must agree
        LOG.info(f"refiner: UNet compiled ({self.compile_mode}, {batch} window(s) per call, {layout}) in "
                 f"{self.compile_seconds:.1f} s; Inductor cache {inductor_cache_dir()}")
        return self.compile_seconds

    def apply_switches(self) -> None:
        """The switches (`runtime.refiner_switches_asked`) on the UNet, before it is compiled: its
        convolution weights channels-last (its inputs follow in `_call_unet`; on CUDA unless
        TERRA_REFINER_CHANNELS_LAST=0), and the lab switches (its self-attention's kernel, the temporal
        convolutions as plane ones, the fused GEGLU; all measured slower on an H200, so off). Either way the
        UNet computes the same values, up to float rounding: only its kernels and memory order change."""
        switches = self.switches
        if switches.channels_last:  # first: it reorders Conv3d weights, which the plane convolutions then hold
            use_channels_last(self.unet)
        if switches.time_conv == "plane":
            LOG.info(f"refiner: {unet_ops.use_frames_plane_conv(self.unet)} temporal convolutions over frames x pixels")
        if switches.attention == "fa3":
            LOG.info(f"refiner: {unet_ops.use_flash_self_attention(self.unet)} attention layers on FlashAttention-3")
        elif switches.attention != "default":
            LOG.info(f"refiner: lab switch: {use_sdpa_backend(self.unet, switches.attention)} attention layers "
                     f"on SDPA's {switches.attention} backend")
        if switches.geglu == "fused":
            from terra_cli.kernels.geglu_matmul import use_fused_geglu

            LOG.info(f"refiner: {use_fused_geglu(self.unet)} feed-forward GEGLUs in one kernel each")

    @torch.inference_mode()
    def prepare_vae_decoder(self) -> None:
        """Eager or compiled, as the UNet (`resolve_compile_mode`), for the device the weights are
        on. A compiled decoder is compiled here by one call on zeros (`vae_chunk` frames), timed and
        logged; if that call fails (no compiler, no Triton), the eager decoder decodes for the rest
        of the run and one line says why. Failing before any real frame keeps every frame eager's."""
        if self.vae_decoder_chosen:
            return
        self.vae_decoder_chosen = True
        if self.switches.channels_last:  # as the UNet's (`apply_switches`); its latents follow in `decode_pixels`
            use_channels_last(self.vae.decoder)
        if self.vae_decoder_error is not None or resolve_compile_mode(self.options.compile, self.device) == "none":
            return
        config, chunk = self.config, self.options.vae_chunk
        h, w = config.latent_hw
        decoder = compile_vae_decoder(self.vae)
        started = time.perf_counter()
        try:
            with tracing_quietly():
                decoder(torch.zeros(chunk, config.latent_channels, h, w, device=self.device,
                                    dtype=self.vae.decoder.conv_in.weight.dtype).contiguous(
                                        memory_format=self.vae_memory_format))
            self._synchronize()
        except Exception as error:  # noqa: BLE001 - no compiler or Triton here: the eager decoder is correct too
            self.vae_decoder_error = error_summary(error)
            LOG.warning(f"refiner: the compiled VAE decoder failed on its first call ({self.vae_decoder_error}); "
                        f"the eager decoder decodes for the rest of the run")
            return
        self.vae_decoder = decoder
        self.vae_decoder_compile_seconds = time.perf_counter() - started
        LOG.info(f"refiner: VAE decoder compiled ({VAE_DECODER_MODE}, {chunk} frame(s) per call) in "
                 f"{self.vae_decoder_compile_seconds:.1f} s")

    def _synchronize(self) -> None:
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize(self.device)

    # -- videos -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def condition_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Token-decoded frames (N, 3, h, w) in about [-1, 1] -> concat condition (N, 4, H/8, W/8), float32."""
        pixels = condition_pixels(pixels.to(self.device), self.config)
        return encode_condition(self.vae, pixels.to(self.dtype)).float()

    def windows(self, condition: torch.Tensor, seed: int, video: int = 0) -> list["Window"]:
        """One video's windows (concat condition (N, 4, h, w)), each with its own seeded noise."""
        config = self.config
        check_frames(condition.shape[0], config.window)
        spans = start_end_indices(condition.shape[0], config.window, config.min_overlap)
        return [Window(video, k, condition[start:end], window_noise(seed, k, (config.window, *condition.shape[1:])),
                       keep) for k, ((start, end), keep) in enumerate(zip(spans, kept_frames(spans)))]

    @torch.inference_mode()
    def sample_windows(self, group: list["Window"]) -> list[torch.Tensor]:
        """One batched sampling run (one UNet call per step) over up to `batch_windows` windows of
        any videos -> each window's kept latents, float32 on the CPU. A compiled UNet gets exactly
        `batch_windows` windows per call: a short group is padded with zero windows."""
        if not 0 < len(group) <= self.options.batch_windows:
            raise ValueError(f"a UNet call takes 1 to {self.options.batch_windows} windows, got {len(group)}")
        self.prepare()
        concat = torch.stack([item.concat.to(self.device, torch.float32) for item in group])
        noise = torch.stack([item.noise for item in group]).to(self.device)
        padding = self.options.batch_windows - len(group) if self.compile_mode != "none" else 0
        if padding:
            concat = torch.cat([concat, concat.new_zeros((padding, *concat.shape[1:]))])
            noise = torch.cat([noise, noise.new_zeros((padding, *noise.shape[1:]))])
        out = sampler.sample(self.network, noise, concat, uncond=concat, sigmas=self.sigmas, scales=self.scales,
                             same_uncond=self.options.same_uncond)
        return [latents[a:b].float().cpu() for item, latents in zip(group, out) for a, b in [item.keep]]

    @torch.inference_mode()
    def refine_latents(self, conditions: list[torch.Tensor], seeds: list[int],
                       on_frames: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Sampled latents (N_i, 4, h, w) per video, overlaps removed, windows batched across videos;
        `on_frames(n)` after each UNet batch with the frames it finished."""
        work = [w for video, (cond, seed) in enumerate(zip(conditions, seeds)) for w in self.windows(cond, seed, video)]
        kept: dict[int, list[torch.Tensor]] = {video: [] for video in range(len(conditions))}
        for at in range(0, len(work), self.options.batch_windows):
            group = work[at:at + self.options.batch_windows]
            for item, latents in zip(group, self.sample_windows(group)):
                kept[item.video].append(latents)  # a video's windows come in order
            if on_frames is not None:
                on_frames(sum(b - a for a, b in (item.keep for item in group)))
        return [torch.cat(kept[video]) for video in range(len(conditions))]

    @torch.inference_mode()
    def decode_pixels(self, latents: torch.Tensor, on_frames: Callable[[int], None] | None = None) -> torch.Tensor:
        """Sampled latents (N, 4, h, w) -> pixels (N, 3, H, W) in [-1, 1], by the compiled decoder in
        a compiled run (`prepare_vae_decoder`), else eager."""
        self.prepare_vae_decoder()
        return decode_latents(self.vae, latents, self.config, self.options.vae_chunk, on_frames,
                              decoder=self.vae_decoder, memory_format=self.vae_memory_format)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, on_frames: Callable[[int], None] | None = None) -> np.ndarray:
        """Sampled latents (N, 4, h, w) -> uint8 frames (N, H, W, 3)."""
        return pixels_to_uint8(self.decode_pixels(latents, on_frames))

    def refine_pixels(self, videos: list[torch.Tensor], seeds: list[int],
                      on_frames: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Token-decoded frames of several videos -> refined uint8 frames (N_i, height, width, 3) each."""
        conditions = [self.condition_latents(v) for v in videos]
        return [self.decode(z) for z in self.refine_latents(conditions, seeds, on_frames)]


@dataclass(frozen=True)
class Window:
    video: int  # which of the videos being refined
    index: int  # its place in that video (0, 1, ...)
    concat: torch.Tensor  # (window, 4, h, w) condition latents
    noise: torch.Tensor  # (window, 4, h, w) float32, CPU
    keep: tuple[int, int]  # the frames of the window that stay (after the previous window's overlap)


def pixels_to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """Decoded pixels (N, 3, H, W) in [-1, 1] -> frames (N, H, W, 3) uint8. Made bytes on the pixels'
    device, so a quarter of float32's bytes cross to the host and no host pass converts them (a
    47-frame video is 83 M values); truncated as numpy's astype truncates, so the same bytes."""
    return ((pixels + 1.0) / 2.0 * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()


def window_noise(seed: int, window: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Window `window` of the video seeded `seed`: standard normal noise from a CPU generator of its
    own (seeds.draw_seed keeps all 64 bits of the seed; torch's generator alone would keep 32)."""
    from terra_cli.seeds import draw_seed

    generator = torch.Generator().manual_seed(draw_seed(int(seed) % 2 ** 64, window))
    return torch.randn(shape, generator=generator)
