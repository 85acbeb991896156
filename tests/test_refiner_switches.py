"""Issue 40: the refiner UNet's two lab switches, TERRA_REFINER_CHANNELS_LAST and TERRA_REFINER_ATTENTION
(`runtime.refiner_switches_asked`): the same refined values as without them, what they change (memory
order, which SDPA kernel runs, in eager and under torch.compile), one-line refusals, the bench's record."""

import pytest
import torch

pytest.importorskip("diffusers")

from terra_cli import runtime  # noqa: E402
from terra_cli.errors import InputError  # noqa: E402
from terra_cli.refiner.config import tiny_refiner_config  # noqa: E402
from terra_cli.refiner.refiner import VideoRefiner  # noqa: E402
from terra_cli.refiner.unet import PinnedSdpaAttention, sdpa_backend  # noqa: E402

SWITCHES = (runtime.REFINER_CHANNELS_LAST_ENV, runtime.REFINER_ATTENTION_ENV, runtime.REFINER_TIME_CONV_ENV,
            runtime.REFINER_GEGLU_ENV, runtime.REFINER_FP8_LAYERS_ENV)


def with_switches(monkeypatch, **values):
    for variable in SWITCHES:
        monkeypatch.delenv(variable, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(f"TERRA_REFINER_{name.upper()}", value)


@pytest.fixture(scope="module")
def base():
    """Random tiny weights in float64 and one window's UNet inputs, shared by the tests (building costs seconds);
    windows of 5 frames, not 25: the same network, a fifth of the time."""
    config = tiny_refiner_config(window=5)
    with pytest.MonkeyPatch.context() as monkeypatch:
        with_switches(monkeypatch)
        refiner = VideoRefiner.random(config, "cpu", torch.float64, seed=0)
    h, w = config.latent_hw
    gen = torch.Generator().manual_seed(0)
    x, concat = (torch.randn(1, config.window, 4, h, w, generator=gen, dtype=torch.float64) for _ in range(2))
    return refiner, (x, torch.tensor([0.5]), concat)


def unet_output(monkeypatch, base, **switches):
    """One UNet evaluation (`VideoRefiner.network`) of a refiner built with these switches on the shared
    weights (a copy: the switches change the UNet), and what its first convolution got: the UNet's
    (B*F, C, H, W) view of its input."""
    import copy

    with_switches(monkeypatch, **switches)
    built, inputs = base
    refiner = VideoRefiner(copy.deepcopy(built.unet), built.vae, built.config, device="cpu", dtype=torch.float64,
                           source="random weights")
    seen = []
    refiner.unet.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.inference_mode():
        out = refiner.network(*inputs)
    return refiner, out, seen[0]


@pytest.fixture(scope="module")
def reference(base):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return unet_output(monkeypatch, base)


def test_channels_last_defaults_to_the_device_the_attention_switch_to_off_and_bad_values_are_one_line(monkeypatch):
    with_switches(monkeypatch)
    unset = runtime.refiner_switches_asked()
    assert unset == runtime.RefinerSwitches(channels_last=None, attention="default")
    assert unset.for_device("cuda").channels_last is True and unset.for_device("cuda:1").channels_last is True
    assert unset.for_device("cpu").channels_last is False and unset.for_device("cpu").as_env()[SWITCHES[0]] == 0
    asked = runtime.refiner_switches_asked({"TERRA_REFINER_CHANNELS_LAST": "1", "TERRA_REFINER_ATTENTION": " Flash "})
    assert asked == runtime.RefinerSwitches(channels_last=True, attention="flash") == asked.for_device("cpu")
    off = runtime.refiner_switches_asked({"TERRA_REFINER_CHANNELS_LAST": "0"})
    assert off.channels_last is False and off.for_device("cuda").channels_last is False
    assert VideoRefiner.random(tiny_refiner_config(), "cpu").switches.channels_last is False  # unset, on a CPU
    refusals = ((runtime.REFINER_CHANNELS_LAST_ENV, "yes", "use 1 (on) or 0"),
                (runtime.REFINER_ATTENTION_ENV, "fa4", "use default, flash, efficient, cudnn, math, fa3"),
                (runtime.REFINER_TIME_CONV_ENV, "2d", "use 3d or plane"), (runtime.REFINER_GEGLU_ENV, "on", "use split or fused"),
                (runtime.REFINER_FP8_LAYERS_ENV, "some", "use all or compute-bound"))
    for variable, bad, allowed in refusals:
        with pytest.raises(InputError) as refused:
            runtime.refiner_switches_asked({variable: bad})
        message = str(refused.value)
        assert message.startswith(f"{variable}={bad!r}: {allowed}") and "\n" not in message
    # every name the parser allows but FlashAttention-3 maps to a torch backend (default: torch's choice)
    sdpa_names = [name for name in runtime.REFINER_ATTENTION_BACKENDS if name != "fa3"]
    assert [sdpa_backend(name) is None for name in sdpa_names] == [True] + [False] * 4
    monkeypatch.setenv(runtime.REFINER_ATTENTION_ENV, "fa4")
    with pytest.raises(InputError, match="TERRA_REFINER_ATTENTION='fa4'"):
        VideoRefiner.random(tiny_refiner_config(), "cpu")


def test_switches_follow_the_device_the_weights_move_to(monkeypatch):
    """The product loads the refiner on the CPU and moves it to the GPU (`load_refiner`); its compile-apart
    child loads straight onto the GPU. Both must compile the same graph, or the parent misses the child's
    Inductor cache (it did: the parent resolved channels-last for the CPU, H200, 2026-11-29)."""
    with_switches(monkeypatch)
    refiner = VideoRefiner.random(tiny_refiner_config(), "cpu")
    assert refiner.switches.channels_last is False
    for module in (refiner.unet, refiner.vae):  # no card here: only the refiner's own record of its device moves
        monkeypatch.setattr(module, "to", lambda *args, kept=module, **kwargs: kept)
    refiner.to("cuda:0")
    assert refiner.switches.channels_last is True
    assert refiner.switches == runtime.refiner_switches_asked().for_device("cuda:0")  # what a refiner loaded there has
    refiner.to("cpu")
    assert refiner.switches.channels_last is False


def test_channels_last_changes_memory_order_not_values(monkeypatch, base, reference):
    """float64: these random tiny UNets grow float32 rounding to ~2% of their output (float32 against
    float64 of the same weights: 0.02 in 1.3), which would hide any real difference; in float64 a
    wrong order would be O(1) off, rounding is ~1e-10."""
    _, reference, reference_input = reference
    refiner, out, seen = unet_output(monkeypatch, base, channels_last="1")
    assert refiner.switches.channels_last
    assert reference_input.is_contiguous() and not reference_input.is_contiguous(memory_format=torch.channels_last)
    assert seen.is_contiguous(memory_format=torch.channels_last)
    convs = [m for m in refiner.unet.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    assert any(isinstance(m, torch.nn.Conv3d) for m in convs)  # the temporal blocks' [3, 1, 1] kernels
    for m in convs:
        layout = torch.channels_last if m.weight.dim() == 4 else torch.channels_last_3d
        assert m.weight.is_contiguous(memory_format=layout)
    assert torch.allclose(out, reference, rtol=1e-8, atol=1e-8) and reference.abs().max() > 0.1


@pytest.mark.parametrize("backend", ["math", "flash"])  # the ones torch has on a CPU
def test_each_attention_backend_the_cpu_has_gives_the_same_values(monkeypatch, base, reference, backend):
    reference = reference[1]
    refiner, out, _ = unet_output(monkeypatch, base, attention=backend)
    processors = list(refiner.unet.attn_processors.values())
    pinned = [p for p in processors if isinstance(p, PinnedSdpaAttention)]
    assert pinned and all(p.backend == sdpa_backend(backend) for p in pinned)
    assert len(pinned) == sum(".attn1." in name for name in refiner.unet.attn_processors)  # attn2: the closed form
    assert torch.allclose(out, reference, rtol=1e-8, atol=1e-8)


def test_a_backend_that_cannot_run_fails_the_call_rather_than_falling_back(monkeypatch, base):
    with pytest.raises(RuntimeError, match="No viable backend"):
        unet_output(monkeypatch, base, attention="efficient")  # no memory-efficient kernel on a CPU
    assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()  # the process's flags are as they were


@pytest.mark.parametrize("backend, kernel", [("flash", "_scaled_dot_product_flash_attention_for_cpu"),
                                             ("math", "_safe_softmax")])
def test_the_pinned_backend_holds_under_torch_compile(backend, kernel):
    """Dynamo traces `sdpa_kernel` into the graph: the ATen graph that Inductor would get runs the pinned
    backend's kernel (math: the decomposed softmax, no fused kernel), with no flag changes left in it."""
    from diffusers.models.attention_processor import Attention
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    attention = Attention(query_dim=64, heads=1, dim_head=64).eval()  # Terra's head dim
    attention.set_processor(PinnedSdpaAttention(sdpa_backend(backend)))
    ops = []

    def capture(graph, inputs):
        ops.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph

    compiled = torch.compile(attention, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
    x = torch.randn(3, 10, 64)
    with torch.inference_mode():
        assert torch.allclose(compiled(x), attention(x), atol=1e-6)
    fused = [op for op in ops if "scaled_dot_product" in op]
    assert any(kernel in op for op in ops)
    assert fused == ([] if backend == "math" else [f"aten.{kernel}.default"])
    assert not any("sdpa_kernel" in op for op in ops)
    torch._dynamo.reset()


def test_the_bench_refuses_a_bad_switch_before_building_anything(monkeypatch, tmp_path):
    """What the bench records: tests/test_refiner_cli.py (its eager bench runs with both switches on)."""
    from typer.testing import CliRunner

    from terra_cli.bench import refiner as bench_refiner
    from terra_cli.cli import app

    monkeypatch.setattr(bench_refiner, "count_unet_flops", lambda *a: pytest.fail("built before refusing"))
    with_switches(monkeypatch, channels_last="2")
    out = tmp_path / "refused.json"
    args = ["bench", "--refiner", "--tiny", "--device", "cpu", "--windows", "1", "--out", out]
    refused = CliRunner().invoke(app, [str(a) for a in args])
    assert refused.exit_code == 2 and "TERRA_REFINER_CHANNELS_LAST='2': use 1 (on) or 0" in refused.output
    assert "Traceback" not in refused.output and not out.exists()
