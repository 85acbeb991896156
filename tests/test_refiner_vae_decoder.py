"""Issue 40: the refiner's VAE decoder as the product runs it: the time convolutions as their centre taps on
one-frame clips (`autoencoder.use_center_taps`), and channels-last with the UNet's switch. The same pixels as
diffusers' decoder as built, on the tests' tiny VAE in float64."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from terra_cli import runtime  # noqa: E402
from terra_cli.refiner.autoencoder import CenterTapTimeConv, build_vae, decode_latents, use_center_taps  # noqa: E402
from terra_cli.refiner.config import tiny_refiner_config  # noqa: E402
from terra_cli.refiner.refiner import VideoRefiner  # noqa: E402


@pytest.fixture(scope="module")
def built():
    config = tiny_refiner_config(window=5)
    torch.manual_seed(0)
    vae = build_vae(config, "cpu", torch.float64)
    h, w = config.latent_hw
    latents = torch.randn(3, config.latent_channels, h, w, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64) * config.scale_factor
    return config, vae, latents


def time_convs(decoder) -> int:
    return sum(isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 1, 1) for m in decoder.modules())


def test_center_taps_decode_one_frame_clips_to_the_same_pixels_and_longer_clips_whole(built):
    config, vae, latents = built
    taps = copy.deepcopy(vae)
    moved = use_center_taps(taps.decoder)
    assert moved == time_convs(vae.decoder) > 0
    assert use_center_taps(taps.decoder) == moved  # idempotent: the class stays what it became
    assert all(type(m) is CenterTapTimeConv for m in taps.decoder.modules()
               if isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 1, 1))
    assert taps.state_dict().keys() == vae.state_dict().keys()
    want = decode_latents(vae, latents, config, chunk=2)
    got = decode_latents(taps, latents, config, chunk=2)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    # a three-frame clip meets the outer taps: the whole convolution runs, as diffusers' does
    with torch.inference_mode():
        clip = latents / config.scale_factor
        assert torch.allclose(taps.decode(clip, num_frames=3).sample, vae.decode(clip, num_frames=3).sample,
                              atol=1e-12, rtol=0)


def test_the_refiner_decodes_with_center_taps_and_channels_last_under_the_unets_switch(built, monkeypatch):
    config, vae, latents = built
    reference = decode_latents(vae, latents, config, chunk=2)
    monkeypatch.setenv(runtime.REFINER_CHANNELS_LAST_ENV, "1")
    unet = VideoRefiner.random(config, "cpu", torch.float64, seed=0).unet
    refiner = VideoRefiner(unet, copy.deepcopy(vae), config, device="cpu", dtype=torch.float64, source="random weights")
    seen = []
    refiner.vae.decoder.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    pixels = refiner.decode_pixels(latents)
    assert refiner.center_tap_convs == time_convs(vae.decoder)
    assert refiner.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert seen and all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x in seen)
    assert torch.allclose(pixels, reference, atol=1e-12, rtol=0)


def test_a_refiner_built_on_the_cpu_keeps_its_decoders_order_and_its_taps_count(built, monkeypatch):
    monkeypatch.delenv(runtime.REFINER_CHANNELS_LAST_ENV, raising=False)
    config, vae, latents = built
    refiner = VideoRefiner.random(config, "cpu", torch.float64, seed=0)
    assert refiner.center_tap_convs == time_convs(vae.decoder)  # at construction, every load path
    refiner.decode_pixels(latents)
    assert refiner.vae.decoder.conv_in.weight.is_contiguous()  # NCHW off CUDA unless asked
