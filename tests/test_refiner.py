"""Terra's video refiner on small configs in Terra's exact checkpoint names and layout: loading,
strictness, no pickle, the sampler against a closed form, windows, determinism."""

import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from conftest import logger_lines  # noqa: E402
from terra_cli.errors import InputError  # noqa: E402
from terra_cli.refiner import keymap, sampler  # noqa: E402
from terra_cli.refiner.checkpoint import convert_checkpoint, read_checkpoint, resolve_refiner_file  # noqa: E402
from terra_cli.refiner.config import TERRA_REFINER, tiny_refiner_config  # noqa: E402
from terra_cli.refiner.cost import check_cpu_time  # noqa: E402
from terra_cli.refiner.refiner import RefinerOptions, VideoRefiner  # noqa: E402
from terra_cli.refiner.testing import terra_state_dict, write_tiny_refiner  # noqa: E402
from terra_cli.refiner.windows import kept_frames, start_end_indices  # noqa: E402
from tokenizer_decoder.errors import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_pt(tmp_path_factory):
    return write_tiny_refiner(tmp_path_factory.mktemp("refiner") / "refiner_model.pt")


def test_windows_follow_terras_start_end_indices():
    assert start_end_indices(25) == [(0, 25)]
    assert start_end_indices(26) == [(0, 25), (1, 26)]
    assert start_end_indices(47) == [(0, 25), (22, 47)]
    assert start_end_indices(50) == [(0, 25), (22, 47), (25, 50)]
    for frames in (25, 26, 47, 50, 73, 100):
        spans = start_end_indices(frames)
        kept = kept_frames(spans)
        covered = [start + i for (start, _), (a, b) in zip(spans, kept) for i in range(a, b)]
        assert covered == list(range(frames))  # every frame once, in order, after overlap removal
        assert all(prev_end - start >= 3 for (_, prev_end), (start, _) in zip(spans, spans[1:]))
    with pytest.raises(InputError, match="at least 25 frames"):
        start_end_indices(24)


def test_windows_per_call_by_default_four_pooled_two_for_one_video_never_more_than_its_windows():
    from terra_cli.refiner.refiner import POOLED_WINDOWS_PER_CALL, WINDOWS_PER_CALL, windows_per_call

    assert (WINDOWS_PER_CALL, POOLED_WINDOWS_PER_CALL) == (2, 4)
    assert windows_per_call(None) == 4  # --scenarios: windows of several videos share a call
    assert windows_per_call(None, 25) == 1  # one video of one window: a padded second would cost a window
    assert windows_per_call(None, 47) == 2
    assert windows_per_call(None, 100) == 2
    assert windows_per_call(3, 25) == 3  # as asked, whatever the video


@pytest.mark.parametrize("extra, frames, windows", [([], "25", 1), ([], "47", 2), (["--refiner-windows", "3"], "25", 3)])
def test_generate_hands_the_refiner_its_windows_per_call(monkeypatch, tmp_path, extra, frames, windows):
    from conftest import invoke_terra

    from terra_cli.refiner import decoder

    seen = []

    def choice(decoder_name, refiner, model, device, dtype, allow_slow, options):
        seen.append(options.batch_windows)
        raise InputError("stop here")

    monkeypatch.setattr(decoder, "refiner_choice", choice)
    result = invoke_terra("generate", tmp_path / "out.mp4", "--decoder", "refiner", "--frames", frames, *extra)
    assert result.returncode == 2 and "stop here" in result.stderr
    assert seen == [windows]
    (tmp_path / "s.jsonl").write_text('{"id": "a", "actions": "straight", "frames": 25}\n')
    result = invoke_terra("generate", "--scenarios", tmp_path / "s.jsonl", "--out-dir", tmp_path / "v", "--decoder",
                          "refiner", *extra)
    assert "stop here" in result.stderr
    assert seen[1] == (3 if extra else 4)  # scenarios: windows of several videos share a call


def test_edm_sigmas_and_guidance_scales():
    sigmas = sampler.edm_sigmas(15)
    assert len(sigmas) == 16 and sigmas[0] == 700.0 and sigmas[-1] == 0.0
    assert torch.all(sigmas[:-1] > sigmas[1:])
    assert math.isclose(float(sigmas[-2]), 0.002, rel_tol=4e-3)
    karras = (700 ** (1 / 7) + 7 / 14 * (0.002 ** (1 / 7) - 700 ** (1 / 7))) ** 7
    assert math.isclose(float(sigmas[7]), karras, rel_tol=4e-3)  # bf16-rounded like Terra's
    scales = sampler.guidance_scales(25, 1.5, 3.0)
    assert scales[0] == 1.5 and scales[-1] == 3.0 and math.isclose(float(scales[12]), 2.25)


def test_sampler_matches_the_closed_form_of_a_linear_toy_denoiser():
    """F(y) = b * y makes every step linear: D = a(s) x with a(s) = (1 - s b) / (s^2 + 1); guidance
    mixes a_u and a_c per frame; Euler multiplies x by 1 + (s' - s)(1 - a)/s, the last step by a."""
    frames, steps = 5, 6
    sigmas = sampler.edm_sigmas(steps, 0.002, 700.0, 7.0)
    scales = sampler.guidance_scales(frames, 1.5, 3.0)
    b_cond, b_uncond = 0.3, -0.2
    calls = []

    def network(x_in, c_noise, cond):
        calls.append(x_in.shape[0])
        sigma = float(sigmas[len(calls) - 1])
        assert torch.allclose(c_noise, torch.full_like(c_noise, 0.25 * math.log(sigma)))
        return cond.view(-1, 1, 1, 1, 1) * x_in

    noise = torch.randn(2, frames, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    cond = torch.tensor([b_cond, b_cond])
    out = sampler.sample(network, noise, cond, uncond=torch.tensor([b_uncond, b_uncond]), sigmas=sigmas, scales=scales)
    assert calls == [4] * steps  # the guidance pair batched into one call per step

    expected = noise.double() * math.sqrt(1 + float(sigmas[0]) ** 2)
    for i in range(steps):
        s, nxt = float(sigmas[i]), float(sigmas[i + 1])
        a_c, a_u = ((1 - s * b) / (s * s + 1) for b in (b_cond, b_uncond))
        a = torch.tensor([a_u + float(w) * (a_c - a_u) for w in scales], dtype=torch.float64).view(1, -1, 1, 1, 1)
        expected = expected * a if nxt == 0 else expected * (1 + (nxt - s) * (1 - a) / s)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-6)


def test_one_call_per_step_gives_the_pair_result_when_uncond_is_cond():
    sigmas, scales = sampler.edm_sigmas(4), sampler.guidance_scales(3, 1.5, 3.0)
    weight = torch.randn(1, 3, 1, 1, 1)

    def network(x_in, c_noise, cond):
        return torch.tanh(x_in * weight + cond.view(-1, 1, 1, 1, 1) + c_noise.view(-1, 1, 1, 1, 1))

    noise, cond = torch.randn(1, 3, 1, 2, 2), torch.tensor([0.1])
    pair = sampler.sample(network, noise, cond, uncond=cond, sigmas=sigmas, scales=scales)
    single = sampler.sample(network, noise, cond, sigmas=sigmas, scales=scales, same_uncond=True)
    assert torch.allclose(pair, single, atol=1e-5)


def test_terra_names_from_its_module_layout():
    """Names written down from Terra's VideoUNet / Encoder / VideoDecoder code, not from our map."""
    from terra_cli.refiner.autoencoder import build_vae
    from terra_cli.refiner.checkpoint import expected_names
    from terra_cli.refiner.unet import build_unet

    config = TERRA_REFINER
    names = expected_names(build_unet(config), build_vae(config), config)
    for name in ("model.diffusion_model.input_blocks.1.1.time_stack.0.attn1.to_q.weight",
                 "model.diffusion_model.input_blocks.3.0.op.weight",
                 "model.diffusion_model.input_blocks.4.0.skip_connection.weight",
                 "model.diffusion_model.input_blocks.4.0.time_stack.emb_layers.1.weight",
                 "model.diffusion_model.middle_block.1.time_stack.0.ff_in.net.0.proj.weight",
                 "model.diffusion_model.middle_block.2.time_mixer.mix_factor",
                 "model.diffusion_model.output_blocks.2.1.conv.weight",
                 "model.diffusion_model.output_blocks.5.2.conv.weight",
                 "model.diffusion_model.output_blocks.11.1.time_pos_embed.2.bias",
                 "model.diffusion_model.label_emb.0.0.weight", "model.diffusion_model.out.2.weight",
                 "conditioner.embedders.3.encoder.encoder.down.1.block.0.nin_shortcut.weight",
                 "conditioner.embedders.3.encoder.encoder.mid.attn_1.proj_out.weight",
                 "conditioner.embedders.3.encoder.quant_conv.weight",
                 "first_stage_model.decoder.up.0.block.0.nin_shortcut.weight",
                 "first_stage_model.decoder.up.3.upsample.conv.weight",
                 "first_stage_model.decoder.mid.block_1.time_stack.in_layers.2.weight",
                 "first_stage_model.decoder.up.2.block.1.mix_factor",
                 "first_stage_model.decoder.conv_out.time_mix_conv.weight"):
        assert name in names, name
    assert not any("input_blocks.10.1" in n or "output_blocks.12" in n for n in names)
    unet, key = names["model.diffusion_model.label_emb.0.0.weight"]
    assert tuple(unet.state_dict()[key].shape) == (1280, 768)


def test_tiny_checkpoint_loads_strictly_and_names_ignored_tensors(tiny_pt):
    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu")
    assert refiner.config == tiny_refiner_config()
    assert {n.split(".")[0] for n in refiner.ignored} == {"conditioner", "first_stage_model", "model", "token_decoder"}
    assert all(keymap.ignored_reason(n) for n in refiner.ignored)
    state, _ = read_checkpoint(tiny_pt)
    unet_key = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    assert torch.equal(refiner.unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
                       state[unet_key])
    attention = "conditioner.embedders.3.encoder.encoder.mid.attn_1.q.weight"  # a 1x1 conv in Terra
    assert torch.equal(refiner.vae.state_dict()["encoder.mid_block.attentions.0.to_q.weight"], state[attention][:, :, 0, 0])


@pytest.mark.parametrize("damage, message", [
    ("drop", "missing: model.diffusion_model.out.2.bias"),
    ("extra", "unexpected (neither used nor known to be unused): model.diffusion_model.surprise"),
    ("shape", "shape mismatch: first_stage_model.decoder.conv_in.weight"),
])
def test_strict_loading_names_the_key(tmp_path, damage, message):
    state = terra_state_dict(tiny_refiner_config())
    if damage == "drop":
        del state["model.diffusion_model.out.2.bias"]
    elif damage == "extra":
        state["model.diffusion_model.surprise"] = torch.zeros(1)
    else:
        state["first_stage_model.decoder.conv_in.weight"] = torch.zeros(1, 1, 3, 3)
    path = write_tiny_refiner(tmp_path / "bad.pt", state=state)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VideoRefiner.from_checkpoint(str(path), device="cpu")


def _refiner_with_config(path: Path, **changes) -> Path:
    """The tiny refiner's weights under a config with `changes` (JSON values as a file could hold them)."""
    import json

    from terra_cli.refiner.checkpoint import CONFIG_KEY, PREFIX

    config = {**tiny_refiner_config().to_dict(), **changes}
    state = terra_state_dict(tiny_refiner_config())
    torch.save({"module": {PREFIX + k: v for k, v in state.items()}, CONFIG_KEY: json.dumps(config)}, path)
    return path


@pytest.mark.parametrize("changes, message", [
    ({"window": 0}, "window is 0: it must be a whole number from 1 to 100"),
    ({"window": 10**9}, "window is 1000000000"),
    ({"head_channels": 0}, "head_channels is 0"),
    ({"steps": -1}, "steps is -1"),
    ({"steps": True}, "steps is True"),
    ({"model_channels": "32"}, "model_channels is '32'"),
    ({"model_channels": 48}, "multiple of 32"),
    ({"height": 33}, "must be multiples of"),
    ({"height": 10**6}, "height is 1000000"),
    ({"sigma_max": float("inf")}, "sigma_max is inf"),
    ({"rho": 0}, "rho is 0"),
    ({"min_scale": float("nan")}, "min_scale is nan"),
    ({"channel_mult": []}, "channel_mult is ()"),
    ({"channel_mult": [1, "2"]}, "channel_mult is (1, '2')"),
    ({"vae_mult": 2}, "vae_mult is 2"),
    ({"min_overlap": 25}, "min_overlap 25 must be less than window 25"),
    ({"sigma_min": 800.0}, "sigma_min 800.0 must be below sigma_max"),
    ({"in_channels": 9}, "in_channels 9"),
    ({"attention_levels": 5}, "more than the 4 levels"),
    ({"surprise": 1}, "unknown field 'surprise'"),
])
def test_refiner_config_is_checked_field_by_field_before_anything_is_built(tmp_path, changes, message):
    path = _refiner_with_config(tmp_path / "cfg.pt", **changes)
    with pytest.raises(CheckpointError, match="bad terra_refiner_config") as failure:
        read_checkpoint(path)
    assert message in str(failure.value)


def test_float_weights_stored_as_ints_and_empty_files_are_refused(tmp_path):
    state = terra_state_dict(tiny_refiner_config())
    state = {k: v.to(torch.int32) if k.startswith("model.diffusion_model.out.") else v for k, v in state.items()}
    path = write_tiny_refiner(tmp_path / "ints.pt", state=state)
    with pytest.raises(CheckpointError, match=r"dtype mismatch: model\.diffusion_model\.out\.\S+ is int32"):
        VideoRefiner.from_checkpoint(str(path), device="cpu")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        read_checkpoint(tmp_path / "empty.pt")
    (tmp_path / "short.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_checkpoint(tmp_path / "short.pt")
    (tmp_path / "picture.pt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))  # no advice to run it as a pickle
    with pytest.raises(CheckpointError, match="is not a torch checkpoint") as failure:
        read_checkpoint(tmp_path / "picture.pt")
    assert "trust" not in str(failure.value)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_objects_are_refused_not_run_and_convert_needs_trust(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "refiner_model.pt"
    state = terra_state_dict(tiny_refiner_config())
    torch.save({"module": {"_forward_module." + k: v for k, v in state.items()}, "extra": _Payload(str(marker))}, path)
    with pytest.raises(CheckpointError, match="terra refine convert --trust-checkpoint"):
        VideoRefiner.from_checkpoint(str(path), device="cpu")
    assert not marker.exists()
    with pytest.raises(InputError, match="--trust-checkpoint"):
        convert_checkpoint(path, tmp_path / "out.safetensors", trust=False)
    assert not marker.exists()


def test_converted_safetensors_and_folders_load_the_same_weights(tmp_path, tiny_pt):
    out = tmp_path / "snapshot" / "video_refiner" / "refiner_model.safetensors"
    out.parent.mkdir(parents=True)
    assert convert_checkpoint(tiny_pt, out, trust=True) > 100
    assert resolve_refiner_file(str(tmp_path / "snapshot")) == out
    a = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu")
    b = VideoRefiner.from_checkpoint(str(out), device="cpu")
    for (ka, va), (kb, vb) in zip(a.unet.state_dict().items(), b.unet.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    with pytest.raises(InputError, match="does not exist"):
        resolve_refiner_file(str(tmp_path / "nowhere.pt"))


def test_refining_is_seeded_batch_invariant_and_shaped(tiny_pt):
    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu")
    config = refiner.config
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.rand(n, 3, 36, 64, generator=gen) * 2 - 1 for n in (26, 25))
    first = refiner.refine_pixels([a], [3])[0]
    assert first.shape == (26, config.height, config.width, 3) and first.dtype == np.uint8
    assert np.array_equal(first, refiner.refine_pixels([a], [3])[0])
    other_seed = refiner.refine_pixels([a], [4])[0]
    assert not np.array_equal(first, other_seed)
    calls = refiner.unet_calls
    batched = VideoRefiner(refiner.unet, refiner.vae, config, device="cpu", dtype=torch.float32, source="x",
                           options=RefinerOptions(batch_windows=3))
    together = batched.refine_pixels([a, b], [3, 5])
    assert batched.unet_calls == config.steps  # three windows (two of a, one of b) in every call
    assert_same_video_up_to_rounding(together[0], first, other_seed)
    assert refiner.unet_calls == calls


def assert_same_video_up_to_rounding(video, reference, other_seed):
    """Equal but for float rounding: kernels at another batch size round differently on the CPU
    (diffs ~1e-6 that these random tiny UNets grow to ~1e-3 per call, a few levels in some pixels),
    far below what other noise makes."""
    diff = np.abs(video.astype(int) - reference.astype(int))
    far = np.abs(other_seed.astype(int) - reference.astype(int)).mean()
    assert diff.mean() < 1.0 and diff.mean() < far / 10, (diff.mean(), diff.max(), far)
    assert diff.max() <= 16


def test_each_window_draws_its_own_seeded_noise(tiny_pt):
    """Issue 40: a window's noise depends on the video's seed and the window's place only, never on
    which videos share its UNet calls or how many windows a call takes."""
    from terra_cli.refiner.refiner import window_noise
    from terra_cli.seeds import draw_seed

    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(batch_windows=2))
    h, w = refiner.config.latent_hw
    condition = torch.randn(50, 4, h, w)
    windows = refiner.windows(condition, seed=7, video=3)
    assert [(x.video, x.index, x.keep) for x in windows] == [(3, 0, (0, 25)), (3, 1, (3, 25)), (3, 2, (22, 25))]
    for k, x in enumerate(windows):
        expected = torch.randn(x.noise.shape, generator=torch.Generator().manual_seed(draw_seed(7, k)))
        assert torch.equal(x.noise, expected) and torch.equal(x.noise, window_noise(7, k, tuple(x.noise.shape)))
    assert not torch.equal(windows[0].noise, windows[1].noise)
    again = refiner.windows(condition[:26], seed=7, video=0)  # another video, another length: same first window
    assert torch.equal(again[0].noise, windows[0].noise)
    # seeds that differ only above bit 31 (a torch generator alone keeps 32 bits) draw different noise
    assert not torch.equal(window_noise(7 + 2 ** 40, 0, (2, 2)), window_noise(7, 0, (2, 2)))


def test_cpu_estimate_refuses_terra_size_work():
    with pytest.raises(InputError, match=r"would take about .* pass --allow-slow"):
        check_cpu_time(TERRA_REFINER, [47], "cpu", allow_slow=False)
    assert check_cpu_time(tiny_refiner_config(), [47], "cpu", allow_slow=False) < 3600
    assert check_cpu_time(TERRA_REFINER, [47], "cuda", allow_slow=False) == 0.0


def test_single_token_cross_attention_is_the_attention_it_replaces():
    from terra_cli.refiner.unet import added_time_ids, build_unet, use_single_token_cross_attention

    config = tiny_refiner_config()
    torch.manual_seed(0)
    unet = build_unet(config, "cpu", exact_cross_attention=False)
    h, w = config.latent_hw
    sample = torch.randn(2, config.window, config.in_channels, h, w)
    context = torch.randn(2, 1, config.context_dim)  # any one-token context, not only Terra's zeros
    args = (sample, torch.tensor([0.3, -1.0]), context, added_time_ids(2, config, "cpu", torch.float32))
    with torch.inference_mode():
        computed = unet(*args, return_dict=False)[0]
        use_single_token_cross_attention(unet)
        closed_form = unet(*args, return_dict=False)[0]
    assert torch.allclose(computed, closed_form, atol=1e-5, rtol=1e-4)
    assert computed.abs().mean() > 1e-3


class PixelTokens:
    """A stand-in token decoder for the stage: the 'tokens' are the frames themselves (N, 3, h, w)."""

    def __init__(self, refiner):
        self.refiner = refiner

    def token_frames(self, tokens):
        if tokens.ndim != 4:
            raise ValueError(f"frames of shape {tokens.shape}")
        return torch.from_numpy(tokens)


def test_refine_stage_batches_videos_and_fails_one_video_or_the_whole_stage(tiny_pt):
    from terra_cli.refiner.stage import RefinerStopped, RefineStage
    from terra_cli.scenarios.writers import VideoFailed

    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(batch_windows=2))
    gen = torch.Generator().manual_seed(1)
    a, b = ((torch.rand(n, 3, 36, 64, generator=gen) * 2 - 1).numpy() for n in (26, 25))
    stage = RefineStage(PixelTokens(refiner))
    try:
        futures = [stage.submit("a", a, 3), stage.submit("bad", np.zeros((2, 2)), 4), stage.submit("b", b, 5)]
        with pytest.raises(VideoFailed, match="frames of shape"):
            futures[1].result(timeout=600)
        got_a, got_b = futures[0].result(timeout=600), futures[2].result(timeout=600)
        assert stage.videos == 2 and 2 <= stage.unet_batches <= 3
        stats = stage.decode_stats()  # what a bench reports per engine (an eager run: no compiling)
        assert stats["refined_videos"] == 2 and stats["refiner_unet_batches"] == stage.unet_batches
        assert 0 < stats["refiner_busy_s"] and stats["refiner_compile_mode"] == "none"
        assert stats["refiner_compile_s"] == stats["refiner_vae_compile_s"] == 0
        assert stats["refiner_compile_cache"] == [0, 0]  # prepared, and no lookup of Inductor's cache
    finally:
        stage.close()
    alone = VideoRefiner(refiner.unet, refiner.vae, refiner.config, device="cpu", dtype=torch.float32, source="x")
    expected_a, expected_b = alone.refine_pixels([torch.from_numpy(a), torch.from_numpy(b)], [3, 5])
    assert_same_video_up_to_rounding(got_a, expected_a, expected_b[:25].repeat(2, axis=0)[:26])
    assert_same_video_up_to_rounding(got_b, expected_b, expected_a[:25])

    def broken(group):
        raise RuntimeError("CUDA out of memory")

    refiner.sample_windows = broken
    stage = RefineStage(PixelTokens(refiner))
    try:
        with pytest.raises(RefinerStopped, match="the refiner stopped: RuntimeError: CUDA out of memory"):
            stage.submit("a", a, 3).result(timeout=600)
        with pytest.raises(RefinerStopped):
            stage.check()
        with pytest.raises(RefinerStopped):
            stage.submit("b", b, 5).result(timeout=5)  # refused at once, never waits on a stopped stage
    finally:
        stage.close()


def test_pixels_become_the_bytes_numpy_astype_made_from_the_same_floats():
    """`pixels_to_uint8` converts on the pixels' device now; the bytes must be those that copying
    the float32 values to the host and numpy's astype (truncation) gave, edges included."""
    from terra_cli.refiner.refiner import pixels_to_uint8

    pixels = (torch.rand(3, 3, 8, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    pixels[0, 0, 0, :4] = torch.tensor([-1.0, 1.0, 0.0, 2 * 127.999 / 255 - 1])  # ends, middle, just under a level
    before = ((pixels + 1.0) / 2.0 * 255).permute(0, 2, 3, 1).cpu().numpy().astype(np.uint8)
    got = pixels_to_uint8(pixels)
    assert got.dtype == np.uint8 and got.shape == (3, 8, 16, 3) and got.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(got, before)
    assert got[0, 0, :4, 0].tolist() == [0, 255, 127, 127]


def test_refine_stage_encodes_mp4s_beside_its_gpu_thread_and_splits_its_time(tiny_pt):
    """A video's mp4 is encoded in the stage's encoder threads, so the next UNet batch does not wait
    for ffmpeg: here the first video's encode can only finish once the second video is refined (with
    the encode on the GPU thread, the first would time out and fail). The stats split the thread's
    time into its parts, and keep the mp4s' seconds apart from it."""
    from terra_cli.refiner.stage import RefineStage

    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(batch_windows=2))
    gen = torch.Generator().manual_seed(1)
    a, b = ((torch.rand(n, 3, 36, 64, generator=gen) * 2 - 1).numpy() for n in (26, 25))
    second_refined = threading.Event()

    def finish(frames):
        if len(frames) == 25:  # the second video
            second_refined.set()
        elif not second_refined.wait(timeout=60):
            raise TimeoutError("the second video was not refined while the first one's mp4 was encoded")
        time.sleep(0.2)
        return len(frames)

    stage = RefineStage(PixelTokens(refiner), finish=finish)
    try:
        assert stage.decode_stats()["refiner_wall_s"] is None  # no video yet
        started = time.perf_counter()
        first, second = stage.submit("a", a, 3), stage.submit("b", b, 5)
        assert (first.result(timeout=600), second.result(timeout=600)) == (26, 25)
        elapsed = time.perf_counter() - started
        stats = stage.decode_stats()
    finally:
        stage.close()
    assert stats["refined_videos"] == 2 and stats["refiner_mp4_s"] >= 0.4  # two encodes of >= 0.2 s each
    # from the first UNet batch to the last mp4: at least the UNet's batches and the last encode, within the run
    assert stats["refiner_unet_s"] + 0.2 <= stats["refiner_wall_s"] <= elapsed
    parts = stats["refiner_take_in_s"] + stats["refiner_unet_s"] + stats["refiner_vae_decode_s"]
    assert min(stats["refiner_take_in_s"], stats["refiner_unet_s"], stats["refiner_vae_decode_s"]) > 0
    assert stats["refiner_busy_s"] == pytest.approx(parts, abs=0.002)
    assert stats["refiner_starved_s"] >= 0


def test_refine_stage_fails_one_video_whose_mp4_fails_and_closes_with_an_mp4_in_progress(tiny_pt):
    from terra_cli.refiner.stage import RefinerStopped, RefineStage
    from terra_cli.scenarios.writers import VideoFailed

    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(batch_windows=2))
    frames = (torch.rand(25, 3, 36, 64, generator=torch.Generator().manual_seed(2)) * 2 - 1).numpy()
    calls, encoding, release = [], threading.Event(), threading.Event()

    def finish(video):
        calls.append(video.shape)
        if len(calls) == 1:
            raise OSError("ffmpeg exited with 1")
        encoding.set()
        release.wait(timeout=30)  # an encode still running when the stage is closed
        return "never used"

    stage = RefineStage(PixelTokens(refiner), finish=finish)
    try:
        with pytest.raises(VideoFailed, match="OSError: ffmpeg exited with 1"):
            stage.submit("a", frames, 3).result(timeout=600)
        stage.check()  # one video's failed mp4 does not stop the stage
        slow = stage.submit("b", frames, 4)
        assert encoding.wait(timeout=600)
    finally:
        stage.close()
    try:
        with pytest.raises(RefinerStopped, match="closed before this video was refined"):
            slow.result(timeout=5)  # failed by close(), not left waiting on its encode
    finally:
        release.set()  # the encode then ends; its answer finds the video failed already
    assert stage.videos == 0 and len(calls) == 2


def test_a_static_vae_decoder_gets_full_chunks_and_eagers_pixels(tiny_pt):
    """`decode_latents(decoder=...)` hands a static-shape decoder full chunks only (a short last one
    padded, the padding dropped) and gives eager's pixels for the same decoder."""
    from terra_cli.refiner.autoencoder import decode_latents, one_frame_clips

    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu")
    config = refiner.config
    h, w = config.latent_hw
    latents = torch.randn(7, config.latent_channels, h, w, generator=torch.Generator().manual_seed(0))
    seen = []
    eager_clips = one_frame_clips(refiner.vae)

    def static(part):
        seen.append(part.shape[0])
        return eager_clips(part)

    eager = decode_latents(refiner.vae, latents, config, 3)
    padded = decode_latents(refiner.vae, latents, config, 3, decoder=static)
    assert seen == [3, 3, 3] and padded.shape == eager.shape  # 3 + 3 + 1 padded to 3
    torch.testing.assert_close(padded, eager)


class StandInCompile:
    """Stands in for `compiled.compile_vae_decoder` where refiner.py calls it: records each compile
    and each call of the decoder it returns (eager's one-frame clips, or one that raises)."""

    def __init__(self, error: Exception | None = None):
        self.compiled, self.calls, self.error = [], [], error

    def __call__(self, vae, mode="default"):
        from terra_cli.refiner.autoencoder import one_frame_clips

        self.compiled.append((vae, mode))
        eager = one_frame_clips(vae)

        def decoder(latents):
            self.calls.append(latents.shape[0])
            if self.error is not None:
                raise self.error
            return eager(latents)

        return decoder


def force_compiled_run(monkeypatch, error: Exception | None = None) -> StandInCompile:
    """A compiled run on the CPU: `--refiner-compile` resolves to `default`, the UNet stays eager
    (compiling it here costs minutes) and the VAE decoder is the stand-in."""
    from terra_cli.refiner import refiner as refiner_module

    stand_in = StandInCompile(error)
    monkeypatch.setattr(refiner_module, "resolve_compile_mode", lambda mode, device: "default")
    monkeypatch.setattr(refiner_module, "compile_unet", lambda unet, mode: unet)
    monkeypatch.setattr(refiner_module, "compile_vae_decoder", stand_in)
    return stand_in


@pytest.fixture
def refiner_lines():
    """terra.refiner's lines (conftest.logger_lines)."""
    with logger_lines("terra.refiner") as lines:
        yield lines


def same_weights(refiner, **options) -> VideoRefiner:
    return VideoRefiner(refiner.unet, refiner.vae, refiner.config, device="cpu", dtype=torch.float32, source="x",
                        options=RefinerOptions(**options))


def tiny_latents(config, frames: int = 7) -> torch.Tensor:
    h, w = config.latent_hw
    return torch.randn(frames, config.latent_channels, h, w, generator=torch.Generator().manual_seed(0))


def test_an_eager_run_decodes_eagerly_and_never_compiles_the_vae_decoder(tiny_pt, monkeypatch):
    from terra_cli.refiner import refiner as refiner_module
    from terra_cli.refiner.autoencoder import decode_latents

    stand_in = StandInCompile()
    monkeypatch.setattr(refiner_module, "compile_vae_decoder", stand_in)
    refiner = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(vae_chunk=3))
    latents = tiny_latents(refiner.config)
    pixels = refiner.decode_pixels(latents)  # `auto` on a CPU: eager
    assert stand_in.compiled == [] and stand_in.calls == [] and refiner.vae_decoder is None
    assert torch.equal(pixels, decode_latents(refiner.vae, latents, refiner.config, 3))  # no padding, as before
    none_on_a_gpu = same_weights(refiner, compile="none", vae_chunk=3)
    monkeypatch.setattr(none_on_a_gpu, "device", "cuda")  # `none` stays eager on a GPU too (nothing runs there)
    none_on_a_gpu.prepare_vae_decoder()
    assert stand_in.compiled == [] and none_on_a_gpu.vae_decoder is None


def test_a_compiled_run_decodes_with_the_compiled_vae_decoder(tiny_pt, monkeypatch, refiner_lines):
    """Issue 40: with the UNet compiled, `decode` goes through `compile_vae_decoder`'s decoder,
    compiled once (a first call on zeros, logged), full chunks only, eager's pixels."""
    eager = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(vae_chunk=3))
    latents = tiny_latents(eager.config)
    expected = eager.decode_pixels(latents)
    stand_in = force_compiled_run(monkeypatch)
    refiner = same_weights(eager, vae_chunk=3)
    frames_done = []
    pixels = refiner.decode_pixels(latents, on_frames=frames_done.append)
    assert stand_in.compiled == [(refiner.vae, "default")]
    assert stand_in.calls == [3, 3, 3, 3]  # the compiling call on zeros, then 3 + 3 + 1 padded to 3
    assert frames_done == [3, 3, 1]
    torch.testing.assert_close(pixels, expected)
    assert refiner.vae_decoder is not None and refiner.vae_decoder_error is None
    assert refiner.vae_decoder_compile_seconds > 0
    seconds = refiner.vae_decoder_compile_seconds
    assert [line for line in refiner_lines if "VAE decoder" in line] == [
        f"INFO: refiner: VAE decoder compiled (default, 3 frame(s) per call) in {seconds:.1f} s"]
    frames = refiner.decode(latents[:4])  # the next video: no second compile
    assert stand_in.compiled == [(refiner.vae, "default")] and stand_in.calls == [3, 3, 3, 3, 3, 3]
    assert frames.shape == (4, refiner.config.height, refiner.config.width, 3) and frames.dtype == np.uint8
    # the refined video end to end goes through it too
    gen = torch.Generator().manual_seed(1)
    video = torch.rand(25, 3, 36, 64, generator=gen) * 2 - 1
    before = len(stand_in.calls)
    refined = refiner.refine_pixels([video], [3])[0]
    assert len(stand_in.calls) == before + 9  # 25 frames, 3 a call
    assert np.abs(refined.astype(int) - eager.refine_pixels([video], [3])[0].astype(int)).max() <= 1
    windows = refiner.options.batch_windows  # the UNet's line names its layout (this CPU: NCHW)
    assert {line.split(" in ")[0] for line in refiner_lines if "UNet compiled" in line} == {
        f"INFO: refiner: UNet compiled (default, {windows} window(s) per call, NCHW)"}


def test_a_compiled_vae_decoder_that_fails_its_first_call_leaves_eager_for_the_run(tiny_pt, monkeypatch,
                                                                                 refiner_lines):
    """No compiler or Triton: the first call fails, one line says why, and every frame is eager's."""
    eager = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu", options=RefinerOptions(vae_chunk=3))
    latents = tiny_latents(eager.config)
    expected = eager.decode(latents)
    stand_in = force_compiled_run(monkeypatch, RuntimeError("no Triton here\nmore"))
    refiner = same_weights(eager, vae_chunk=3)
    frames_done = []
    assert np.array_equal(refiner.decode(latents, on_frames=frames_done.append), expected)
    assert frames_done == [3, 3, 1]  # eager's unpadded chunks
    assert refiner.vae_decoder is None and refiner.vae_decoder_error == "RuntimeError: no Triton here"
    assert refiner_lines == ["WARNING: refiner: the compiled VAE decoder failed on its first call (RuntimeError: "
                             "no Triton here); the eager decoder decodes for the rest of the run"]
    assert np.array_equal(refiner.decode(latents), expected)
    assert stand_in.compiled == [(refiner.vae, "default")] and stand_in.calls == [3]  # tried once in the run
    assert len(refiner_lines) == 1


def test_the_bench_times_the_products_decoder_beside_eager(tiny_pt, monkeypatch):
    """`vae_seconds_per_frame.decode` is the product's decode (compiled in a compiled run); the
    compiled decoder's report sets eager beside it, and says when the product fell back to eager."""
    from terra_cli.bench import refiner as bench_refiner

    eager = VideoRefiner.from_checkpoint(str(tiny_pt), device="cpu")
    latents = tiny_latents(eager.config)
    seconds, report = bench_refiner.time_vae_decode(eager, latents, "cpu", repeats=1)
    assert seconds > 0 and report is None  # an eager run: its decoder is the eager one

    stand_in = force_compiled_run(monkeypatch)
    refiner = same_weights(eager)
    seconds, report = bench_refiner.time_vae_decode(refiner, latents, "cpu", repeats=1)
    assert stand_in.calls == [4, 4, 4, 4, 4, 4, 4]  # compiling call, then (4 + 3 padded) x (warm-up, timed, agreement)
    assert report["ms_per_frame"] == round(1e3 * seconds, 3) and report["eager_ms_per_frame"] > 0
    assert report["compile_s"] == round(refiner.vae_decoder_compile_seconds, 2) and report["error"] is None
    assert report["max_abs_diff"] < 1e-5  # the stand-in is eager itself, on padded chunks

    broken = force_compiled_run(monkeypatch, RuntimeError("no Triton here"))
    refiner = same_weights(eager)
    seconds, report = bench_refiner.time_vae_decode(refiner, latents, "cpu", repeats=1)
    assert broken.calls == [4] and seconds > 0
    assert report["error"] == "RuntimeError: no Triton here" and report["eager_ms_per_frame"] > 0
    assert report["ms_per_frame"] is None and report["compile_s"] is None and report["max_abs_diff"] is None
