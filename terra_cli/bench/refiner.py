"""`terra bench --refiner`: Terra's video refiner with random weights in its exact shapes.

Reports, per windows-per-UNet-call batch: seconds per 25-frame window, UNet evaluations per
second (one evaluation = one window through the UNet; the guidance pair counts two), model FLOPs
utilisation from FLOPs counted with torch.utils.flop_counter, and peak GPU memory; then the VAE
(condition encoding and frame-by-frame decoding, per frame) and an ACT-Bench projection
(2,286 samples x 47 frames = 2 windows each). The token decoder's frames (the refiner's input)
are not timed here: that is the frame-wise decoder `terra bench` measures elsewhere.

The decode timed (`vae_seconds_per_frame.decode`, and the projection's) is the product's:
`VideoRefiner.decode`, with the compiled VAE decoder in a compiled run (`--refiner-compile` other
than none, on a GPU), else eager. In a compiled run `vae_decode_compiled` reports it beside eager:
`ms_per_frame` (the compiled decoder: the same timing as `decode`), `eager_ms_per_frame` (the
eager decoder on the same latents), `compile_s` (its first call,
`VideoRefiner.vae_decoder_compile_seconds`), `max_abs_diff` and `psnr_db` (its pixels against
eager's; psnr None: the same bytes), `error` (None, or why its first call failed: the product then
decoded eagerly, and the compiled decoder's keys are None). An eager run has
`vae_decode_compiled` None. `lab_switches`: the refiner's TERRA_REFINER_CHANNELS_LAST and
TERRA_REFINER_ATTENTION as it read them (`runtime.refiner_switches_asked`), so a file says what it measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from terra_cli.refiner.config import TERRA_REFINER, RefinerConfig
from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner, pixels_to_uint8
from terra_cli.refiner.windows import count_windows
from terra_cli.scenarios.spec import ACT_BENCH_FRAMES, ACT_BENCH_SAMPLES

TOKENS_ONLY_HOURS = 1.14  # ACT-Bench tokens on one H100, fp8 KV, 256 in flight (benchmarks/README.md)
H100_BF16_DENSE = 989e12


@dataclass(frozen=True)
class RefinerBenchPlan:
    batches: list[int] = field(default_factory=lambda: [1, 2])
    options: RefinerOptions = RefinerOptions()
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    config: RefinerConfig = TERRA_REFINER
    repeats: int = 3
    peak_flops: float = H100_BF16_DENSE


def random_refiner_folder(config: RefinerConfig, seed: int) -> Path:
    """Where `random_refiner_checkpoint` keeps random weights of `config` (terra's cache folder)."""
    import hashlib
    import json

    from terra_cli.bench.cache import random_model_cache

    shapes = "terra" if config == TERRA_REFINER else \
        "config-" + hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return random_model_cache() / f"random-{shapes}-refiner-seed{seed}"


def random_refiner_checkpoint(config: RefinerConfig, seed: int, device: str = "cpu",
                              log: Callable[[str], None] = print) -> Path:
    """A folder holding `config`'s shapes with random weights (`VideoRefiner.random`, bf16) as Terra's
    checkpoint converted to safetensors: sgm names, the shapes in its metadata, what `terra refine
    convert` writes, so it loads through the same strict loader as Terra's file. Written once per
    config and seed and reused (`bench.cache.cached_folder`: its config.json says the shapes)."""
    import gc
    import json

    from terra_cli.bench.cache import COMPLETE_MARKER, cached_folder
    from terra_cli.refiner.checkpoint import CONVERTED_FILE, save_safetensors, sgm_state_dict

    def build(folder: Path) -> None:
        folder.mkdir(parents=True)
        refiner = VideoRefiner.random(config, device, torch.bfloat16, seed=seed)
        save_safetensors(sgm_state_dict(refiner.unet, refiner.vae, config, torch.bfloat16), config,
                         folder / CONVERTED_FILE)
        (folder / COMPLETE_MARKER).write_text(json.dumps(config.to_dict(), indent=1) + "\n")
        del refiner
        if str(device).startswith("cuda"):  # built in the process that then starts an engine (as the world model)
            gc.collect()
            torch.cuda.empty_cache()

    what = "random refiner (Terra's shapes, 1.52B-parameter UNet, bf16)" if config == TERRA_REFINER else \
        "random refiner (a small config)"
    return cached_folder(random_refiner_folder(config, seed), build, log, what)


def unet_flop_counter(config: RefinerConfig, exact_cross_attention: bool = True):
    """torch's FlopCounterMode after one UNet evaluation of one window (window frames), on the meta
    device: no weights, no memory."""
    from torch.utils.flop_counter import FlopCounterMode

    from terra_cli.refiner.unet import added_time_ids, build_unet, zero_context

    unet = build_unet(config, "meta", exact_cross_attention=exact_cross_attention)
    h, w = config.latent_hw
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        unet(torch.zeros(1, config.window, config.in_channels, h, w), torch.zeros(1),
             zero_context(1, config, "meta", torch.float32), added_time_ids(1, config, "meta", torch.float32))
    return counter


def count_unet_flops(config: RefinerConfig, exact_cross_attention: bool = True) -> float:
    """FLOPs of one window (window frames) through the UNet."""
    return float(unet_flop_counter(config, exact_cross_attention).get_total_flops())


def count_vae_flops(config: RefinerConfig) -> tuple[float, float]:
    """(encode, decode) FLOPs per frame."""
    from torch.utils.flop_counter import FlopCounterMode

    from terra_cli.refiner.autoencoder import build_vae

    vae = build_vae(config, "meta")
    h, w = config.latent_hw
    with torch.device("meta"), FlopCounterMode(display=False) as enc:
        vae.quant_conv(vae.encoder(torch.zeros(1, 3, config.height, config.width)))
    with torch.device("meta"), FlopCounterMode(display=False) as dec:
        vae.decode(torch.zeros(1, config.latent_channels, h, w), num_frames=1)
    return float(enc.get_total_flops()), float(dec.get_total_flops())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str, repeats: int, warmup: list | None = None) -> list[float]:
    _sync(device)
    started = time.perf_counter()
    fn()  # warm-up: kernels chosen, compilation, CUDA graphs captured
    _sync(device)
    if warmup is not None:
        warmup.append(time.perf_counter() - started)
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def run_refiner_bench(plan: RefinerBenchPlan, say: Callable[[str], None] = lambda line: None) -> dict:
    from terra_cli.refiner import sampler
    from terra_cli.runtime import refiner_switches_asked

    config, options, device = plan.config, plan.options, plan.device
    refiner_switches_asked()  # a bad TERRA_REFINER_* value fails here, before anything is built
    started = time.perf_counter()
    unet_flops = count_unet_flops(config, options.exact_cross_attention)
    enc_flops, dec_flops = count_vae_flops(config)
    evals_per_window = config.steps * (1 if options.same_uncond else 2)
    window_flops = evals_per_window * unet_flops
    say(f"counted: {unet_flops / 1e12:.2f} TFLOP per UNet evaluation ({config.window} frames), "
        f"{window_flops / 1e12:.1f} TFLOP per window ({evals_per_window} evaluations); floor at "
        f"{plan.peak_flops / 1e12:.0f} TFLOP/s: {window_flops / plan.peak_flops:.2f} s per window")
    refiner = VideoRefiner.random(config, device, plan.dtype, options=options)
    say(f"refiner built in {time.perf_counter() - started:.1f} s ({sum(p.numel() for p in refiner.unet.parameters()) / 1e9:.3f}B "
        f"UNet parameters, {plan.dtype}, compile {options.compile}, lab switches {refiner.switches.as_env()})")
    h, w = config.latent_hw
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in plan.batches:
        concat = torch.randn(batch, config.window, config.latent_channels, h, w, generator=gen).to(device)
        noise = torch.randn(batch, config.window, config.latent_channels, h, w, generator=gen).to(device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

        def one() -> None:
            with torch.inference_mode():
                sampler.sample(refiner.network, noise, concat, uncond=concat, sigmas=refiner.sigmas,
                               scales=refiner.scales, same_uncond=options.same_uncond)

        warmup: list[float] = []
        times = _timed(one, device, plan.repeats, warmup)
        best = min(times)
        row = {"windows_per_call": batch, "seconds_per_call": [round(t, 4) for t in times],
               "first_call_s": round(warmup[0], 2),  # with --refiner-compile: compiling (and capturing graphs) included
               "seconds_per_window": round(best / batch, 4), "unet_evals_per_s": round(evals_per_window * batch / best, 2),
               "mfu": round(window_flops * batch / best / plan.peak_flops, 4),
               "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if device.startswith("cuda") else None}
        rows.append(row)
        say(f"{batch} window(s) per call: {row['seconds_per_window']:.3f} s per window, {row['unet_evals_per_s']:.1f} UNet "
            f"evaluations/s, MFU {row['mfu']:.1%}, peak {row['peak_memory_gib']} GiB (first call {row['first_call_s']} s)")
    frames = ACT_BENCH_FRAMES
    pixels = torch.rand(frames, 3, config.height, config.width, generator=gen).mul(2).sub(1)
    latents = torch.randn(frames, config.latent_channels, h, w, generator=gen)
    encode = min(_timed(lambda: refiner.condition_latents(pixels), device, plan.repeats)) / frames
    decode, vae_compiled = time_vae_decode(refiner, latents, device, plan.repeats)
    decoder = ("eager" if vae_compiled is None else "eager: the compiled decoder failed" if vae_compiled["error"]
               else "compiled")
    say(f"VAE per frame: encode {encode * 1e3:.1f} ms ({enc_flops / 1e12:.2f} TFLOP), decode {decode * 1e3:.1f} ms "
        f"({dec_flops / 1e12:.2f} TFLOP, one-frame clips, {options.vae_chunk} per call, {decoder})")
    if vae_compiled is not None and vae_compiled["error"]:
        say(f"VAE decode compiled: its first call failed ({vae_compiled['error']}); the product decoded eagerly")
    elif vae_compiled is not None:
        say(f"VAE decode compiled (the product's in a compiled run): {vae_compiled['ms_per_frame']:.1f} ms a frame "
            f"against {vae_compiled['eager_ms_per_frame']:.1f} eager, compiled in {vae_compiled['compile_s']:.1f} s; "
            f"pixels against eager: max difference {vae_compiled['max_abs_diff']:.2e}, "
            + ("the same bytes" if vae_compiled["psnr_db"] is None else f"PSNR {vae_compiled['psnr_db']:.1f} dB"))
    best_window = min(r["seconds_per_window"] for r in rows)
    windows = count_windows(frames, config.window, config.min_overlap)
    per_sample = windows * best_window + frames * (encode + decode)
    refine_hours = ACT_BENCH_SAMPLES * per_sample / 3600
    projection = {"samples": ACT_BENCH_SAMPLES, "frames": frames, "windows_per_sample": windows,
                  "refine_seconds_per_sample": round(per_sample, 3), "refine_hours": round(refine_hours, 2),
                  "tokens_hours": TOKENS_ONLY_HOURS, "two_stages_hours": round(refine_hours + TOKENS_ONLY_HOURS, 2),
                  "overlapped_lower_bound_hours": round(max(refine_hours, TOKENS_ONLY_HOURS), 2)}
    say(f"ACT-Bench ({ACT_BENCH_SAMPLES} x {frames} frames, {windows} windows each): refining {refine_hours:.2f} h; with "
        f"tokens ({TOKENS_ONLY_HOURS} h): {projection['two_stages_hours']:.2f} h as two stages, at least "
        f"{projection['overlapped_lower_bound_hours']:.2f} h overlapped")
    fp8 = fp8_agreement(plan, refiner) if options.dtype == "fp8" else None
    if fp8 is not None:
        say(f"fp8: {fp8['layers']} UNet Linear layers; one refined window against the same weights unquantized "
            f"({plan.dtype}): PSNR {fp8['psnr_db']:.1f} dB (random weights: real weights may differ)")
    return {"config": config.to_dict(), "options": options.__dict__, "lab_switches": refiner.switches.as_env(),
            "fp8": fp8, "device": device, "dtype": str(plan.dtype),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "flops": {"unet_eval": unet_flops, "window": window_flops, "evals_per_window": evals_per_window,
                      "vae_encode_per_frame": enc_flops, "vae_decode_per_frame": dec_flops,
                      "window_floor_s": window_flops / plan.peak_flops, "peak_flops": plan.peak_flops},
            "rows": rows, "compile_mode": refiner.compile_mode, "compile_seconds": round(refiner.compile_seconds, 2),
            "vae_seconds_per_frame": {"encode": round(encode, 5), "decode": round(decode, 5)},
            "vae_decode_compiled": vae_compiled,
            "act_bench": projection}


def time_vae_decode(refiner: VideoRefiner, latents: torch.Tensor, device: str,
                    repeats: int) -> tuple[float, dict | None]:
    """Seconds a frame of the product's decode (`refiner.decode`: its first call, not timed, picks
    and compiles the decoder), and in a compiled run the compiled decoder beside eager, timed on the
    same latents with the same uint8 output, and its pixels' agreement with eager's (float32 both);
    None in an eager run. The keys: this module's docstring."""
    from tokenizer_decoder.tokenizer import psnr

    from terra_cli.refiner.autoencoder import decode_latents

    frames, chunk = latents.shape[0], refiner.options.vae_chunk
    decode = min(_timed(lambda: refiner.decode(latents), device, repeats)) / frames
    if refiner.vae_decoder is None and refiner.vae_decoder_error is None:
        return decode, None

    def eager_pixels() -> torch.Tensor:
        return decode_latents(refiner.vae, latents, refiner.config, chunk)

    eager = min(_timed(lambda: pixels_to_uint8(eager_pixels()), device, repeats)) / frames
    report = {"ms_per_frame": None, "eager_ms_per_frame": round(1e3 * eager, 3), "compile_s": None,
              "max_abs_diff": None, "psnr_db": None, "error": refiner.vae_decoder_error}
    if report["error"] is not None:
        return decode, report
    reference, compiled = eager_pixels(), refiner.decode_pixels(latents)
    agreement = psnr(pixels_to_uint8(reference), pixels_to_uint8(compiled))
    report.update(ms_per_frame=round(1e3 * decode, 3), compile_s=round(refiner.vae_decoder_compile_seconds, 2),
                  max_abs_diff=float((reference - compiled).abs().max()),
                  psnr_db=None if agreement == float("inf") else round(agreement, 2))  # None: the same bytes
    return decode, report


def fp8_agreement(plan: RefinerBenchPlan, refiner: VideoRefiner, seed: int = 0) -> dict:
    """PSNR of one window refined by the fp8 UNet against the same random weights unquantized
    (`VideoRefiner.random` seeds its weights), from the same condition and noise."""
    from dataclasses import replace

    from tokenizer_decoder.tokenizer import psnr

    config = plan.config
    reference = VideoRefiner.random(config, plan.device, plan.dtype,
                                    options=replace(plan.options, dtype="auto", compile="none", batch_windows=1))
    h, w = config.latent_hw
    condition = torch.randn(config.window, config.latent_channels, h, w, generator=torch.Generator().manual_seed(seed))
    frames = [r.decode(r.refine_latents([condition], [seed])[0]) for r in (reference, refiner)]
    del reference
    return {"layers": refiner.fp8_layers, "psnr_db": round(float(psnr(*frames)), 2), "frames": int(frames[0].shape[0]),
            "reference_dtype": str(plan.dtype)}
