"""Issue 40: the refiner UNet's faster parts (`refiner/unet_ops.py`) compute what they replace: the temporal
[3, 1, 1] Conv3d as a plane convolution (in NCDHW and channels-last memory, and in the whole UNet), and the
self-attention's processor for FlashAttention-3 (here with a stand-in kernel of the same calling convention,
which a CPU lacks)."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from terra_cli import runtime  # noqa: E402
from terra_cli.refiner import unet_ops  # noqa: E402
from terra_cli.refiner.config import tiny_refiner_config  # noqa: E402
from terra_cli.refiner.refiner import VideoRefiner  # noqa: E402

SWITCHES = (runtime.REFINER_CHANNELS_LAST_ENV, runtime.REFINER_ATTENTION_ENV, runtime.REFINER_TIME_CONV_ENV,
            runtime.REFINER_GEGLU_ENV)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_the_plane_convolution_is_the_conv3d(layout):
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv3d(6, 10, (3, 1, 1), padding=(1, 0, 0)).double()
    conv.weight.data = conv.weight.data.contiguous(memory_format=layout)
    x = torch.randn(2, 6, 5, 3, 4, generator=gen, dtype=torch.float64).contiguous(memory_format=layout)
    plane = unet_ops.FramesPlaneConv(conv)
    assert plane.weight is conv.weight and plane.bias is conv.bias  # the same parameters, not copies
    out = plane(x)
    assert out.shape == (2, 10, 5, 3, 4) and torch.allclose(out, conv(x), rtol=1e-12, atol=1e-12)
    assert out.is_contiguous(memory_format=layout)  # no copy into another order on the way


def test_only_frame_kernels_become_plane_convolutions():
    model = torch.nn.Sequential(torch.nn.Conv3d(4, 4, (3, 1, 1), padding=(1, 0, 0)),
                                torch.nn.Conv3d(4, 4, (3, 3, 3), padding=1),
                                torch.nn.Conv3d(4, 4, (3, 1, 1), padding=(1, 0, 0), stride=(2, 1, 1)),
                                torch.nn.Conv2d(4, 4, 1))
    keys = list(model.state_dict())
    assert unet_ops.use_frames_plane_conv(model) == 1
    assert isinstance(model[0], unet_ops.FramesPlaneConv) and isinstance(model[1], torch.nn.Conv3d)
    assert isinstance(model[2], torch.nn.Conv3d) and list(model.state_dict()) == keys  # checkpoints load the same
    with pytest.raises(ValueError, match="not a \\[k, 1, 1\\] convolution"):
        unet_ops.FramesPlaneConv(model[1])


def varlen_stand_in(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale, causal,
                    fa_version):
    """FlashAttention's varlen call, computed per sequence with plain math."""
    assert not causal and fa_version == 3 and max_seqlen_q == max_seqlen_k and torch.equal(cu_seqlens_q, cu_seqlens_k)
    assert cu_seqlens_q.dtype == torch.int32 and q.shape == k.shape == v.shape and q.stride(-1) == 1
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * softmax_scale, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", weights, v[a:b])
    return out


def unet_output(monkeypatch, refiner, inputs, **switches):
    for variable in SWITCHES:
        monkeypatch.delenv(variable, raising=False)
    for name, value in switches.items():
        monkeypatch.setenv(f"TERRA_REFINER_{name.upper()}", value)
    built = VideoRefiner(copy.deepcopy(refiner.unet), refiner.vae, refiner.config, device="cpu", dtype=torch.float64,
                         source="random weights")
    with torch.inference_mode():
        return built, built.network(*inputs)


@pytest.fixture(scope="module")
def tiny():
    config = tiny_refiner_config(window=5)
    with pytest.MonkeyPatch.context() as monkeypatch:
        for variable in SWITCHES:
            monkeypatch.delenv(variable, raising=False)
        refiner = VideoRefiner.random(config, "cpu", torch.float64, seed=0)
    h, w = config.latent_hw
    gen = torch.Generator().manual_seed(0)
    x, concat = (torch.randn(1, config.window, 4, h, w, generator=gen, dtype=torch.float64) for _ in range(2))
    inputs = (x, torch.tensor([0.5]), concat)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _, reference = unet_output(monkeypatch, refiner, inputs)
    return refiner, inputs, reference


def test_the_unet_with_plane_convolutions_gives_the_same_values(monkeypatch, tiny):
    refiner, inputs, reference = tiny
    built, out = unet_output(monkeypatch, refiner, inputs, time_conv="plane", channels_last="1")
    planes = [m for m in built.unet.modules() if isinstance(m, unet_ops.FramesPlaneConv)]
    assert planes and not any(isinstance(m, torch.nn.Conv3d) for m in built.unet.modules())
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) for m in planes)
    assert built.switches.as_env()[runtime.REFINER_TIME_CONV_ENV] == "plane"
    assert torch.allclose(out, reference, rtol=1e-8, atol=1e-8) and reference.abs().max() > 0.1


def test_the_flash_processor_gives_the_same_values_on_the_self_attentions(monkeypatch, tiny):
    refiner, inputs, reference = tiny
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["max_seqlen_q"])
        return varlen_stand_in(*args, **kwargs)

    monkeypatch.setattr(unet_ops, "flash_kernel", lambda device: (kernel, 3))
    built, out = unet_output(monkeypatch, refiner, inputs, attention="fa3")
    processors = built.unet.attn_processors
    flash = [name for name, p in processors.items() if isinstance(p, unet_ops.FlashSelfAttention)]
    assert flash and flash == [name for name in processors if ".attn1." in name]  # attn2 keeps its closed form
    h, w = refiner.config.latent_hw
    assert refiner.config.window in calls and h * w in calls  # temporal and spatial self-attention both ran on it
    assert torch.allclose(out, reference, rtol=1e-8, atol=1e-8)


def test_flash_attention_where_it_cannot_run_fails_the_call(monkeypatch, tiny):
    refiner, inputs, _ = tiny
    assert unet_ops.flash_kernel("cpu") == (None, None)
    with pytest.raises(RuntimeError, match="FlashAttention-3 is not available"):
        unet_output(monkeypatch, refiner, inputs, attention="fa3")


def test_the_flash_processor_refuses_what_it_does_not_compute():
    from diffusers.models.attention_processor import Attention

    attention = Attention(query_dim=8, heads=2, dim_head=4).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="plain self-attention only"):
        unet_ops.FlashSelfAttention()(attention, x, encoder_hidden_states=x)
    with pytest.raises(ValueError, match="plain self-attention only"):
        unet_ops.FlashSelfAttention()(attention, x, attention_mask=torch.zeros(1, 3, 3))


def test_the_fused_geglu_switch_swaps_every_feed_forward_and_keeps_the_values_off_cuda(monkeypatch, tiny):
    """On a CPU the fused modules run diffusers' math (the kernel itself: tests/test_geglu_matmul.py)."""
    from diffusers.models.activations import GEGLU

    from terra_cli.kernels.geglu_matmul import FusedGEGLU

    refiner, inputs, reference = tiny
    before = sum(isinstance(m, GEGLU) for m in refiner.unet.modules())
    built, out = unet_output(monkeypatch, refiner, inputs, geglu="fused")
    assert before > 0 and sum(isinstance(m, FusedGEGLU) for m in built.unet.modules()) == before
    assert not any(isinstance(m, GEGLU) for m in built.unet.modules())
    assert list(built.unet.state_dict()) == list(refiner.unet.state_dict())
    assert torch.equal(out, reference)
