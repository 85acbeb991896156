"""terra's fused GEGLU projection (kernels/geglu_matmul.py): the kernel under Triton's interpreter in a process
of its own (tests/geglu_interpreted.py) against float64 math, its repeat calls, refusals and tracing; and,
without the interpreter, `use_fused_geglu` on diffusers' feed-forwards and the CPU fallback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from terra_cli.kernels import geglu_matmul as kernel

HERE = Path(__file__).parent


def exact_geglu(x, weight, bias):
    """GEGLU in float64, written out independently of the kernel and of diffusers."""
    wide = x.double()
    n = weight.shape[0] // 2
    hidden = wide @ weight[:n].double().t()
    gate = wide @ weight[n:].double().t()
    if bias is not None:
        hidden, gate = hidden + bias[:n].double(), gate + bias[n:].double()
    return hidden * 0.5 * gate * (1.0 + torch.erf(gate / 2.0 ** 0.5))


def test_the_kernel_computes_geglu_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run([sys.executable, str(HERE / "geglu_interpreted.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    fp32_tolerance = 2e-6  # float32 sums of a few hundred products
    # a tanh gelu in place of erf's would miss by far more than the tolerance: the check can tell them apart
    assert result["tanh_gap"] > 20 * fp32_tolerance
    cases = result["cases"]
    assert {"fp32-2d-table-bias", "fp32-3d-table-nobias", "fp32-2d-small-nobias", "fp32-3d-small-bias",
            "bf16-3d-table-bias", "bf16-3d-small-bias", "fp32-narrow-evenk", "fp32-few-rows",
            "fp32-strided-rows-3d", "fp32-strided-rows-2d", "fp32-strided-last"} <= set(cases)
    for name, got in cases.items():
        assert got["shape"] == got["want_shape"] and got["dtype"] == got["want_dtype"], (name, got)
        # bfloat16: one rounding of the output, which the interpreter does toward zero (2^-7 of a value)
        assert got["error"] < (8e-3 if name.startswith("bf16") else fp32_tolerance), (name, got)
    assert len(result["probe_errors"]) == len(kernel.PROBE_TILES)
    for tile, error in result["probe_errors"].items():
        assert error < fp32_tolerance, (tile, error)
    assert result["repeatable"] == {"table": True, "small": True}
    assert result["empty_shape"] == [0, 150]

    refused = result["refused"]
    assert all(message is not None and "\n" not in message for message in refused.values()), refused
    assert "even number, got 301" in refused["odd_rows"]
    assert "199" in refused["k_mismatch"] and "200" in refused["k_mismatch"]
    assert "(150,)" in refused["bias_size"]
    assert "bfloat16" in refused["dtypes"]
    assert "block_m=48" in refused["tile"]

    # torch.compile: one graph for two shapes, the operator one opaque call, no GEMM or gelu beside it
    assert len(result["graphs"]) == 1
    targets = result["graphs"][0]
    assert targets.count("terra.geglu_matmul.default") == 1
    assert not [t for t in targets if any(word in t for word in ("linear", "addmm", "mm", "gelu", "erf"))]
    assert result["compiled_error"] < fp32_tolerance
    assert set(result["opcheck"].values()) == {"SUCCESS"}, result["opcheck"]


def test_the_tile_table_is_fixed_by_shape():
    assert kernel.tile_for(400_000, 1280, 320) == kernel.LARGE_TILE
    assert kernel.LARGE_TILE == kernel.Tile(block_m=128, block_n=128, block_k=32, warps=8, stages=4, group_m=8)
    assert kernel.tile_for(40, 1280, 320) == kernel.FEW_ROWS_TILE
    assert kernel.tile_for(4000, 48, 320) == kernel.NARROW_TILE
    assert len(set(kernel.PROBE_TILES)) == len(kernel.PROBE_TILES) >= 5 and kernel.LARGE_TILE in kernel.PROBE_TILES
    for tile in kernel.PROBE_TILES + (kernel.NARROW_TILE, kernel.FEW_ROWS_TILE):
        kernel._check_kernel(torch.zeros(2, 8), torch.zeros(8, 8), None, tile)  # valid launch shapes
        assert kernel.Tile(*tile.as_list()) == tile
    # TMA reads rows of 16-byte multiples: 3 float32 outputs a row (12 bytes) or a depth of 6 are refused
    tma = next(tile for tile in kernel.PROBE_TILES if tile.tma)
    for x, weight in ((torch.zeros(2, 8), torch.zeros(6, 8)), (torch.zeros(2, 6), torch.zeros(8, 6))):
        with pytest.raises(ValueError, match="a TMA tile needs"):
            kernel._check_kernel(x, weight, None, tma)
    assert tma.as_list()[-1] == 1


def test_without_the_interpreter_cpu_runs_diffusers_math(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 24, generator=gen)
    weight, bias = torch.randn(20, 24, generator=gen) / 5, torch.randn(20, generator=gen)
    for b in (bias, None):
        out = kernel.geglu_matmul(x, weight, b)
        assert torch.equal(out, kernel.reference_geglu(x, weight, b))
        assert out.shape == (3, 7, 10)
        exact = exact_geglu(x, weight, b)
        assert float((out.double() - exact).abs().max() / exact.abs().max()) < 2e-6
    with pytest.raises(ValueError, match="even number"):
        kernel.geglu_matmul(x, torch.zeros(21, 24), None)
    with pytest.raises(ValueError, match="depth 25"):
        kernel.geglu_matmul(x, torch.zeros(20, 25), None)


def test_the_module_imports_and_falls_back_without_triton():
    script = ("import sys, torch; sys.modules['triton'] = None\n"
              "from terra_cli.kernels import geglu_matmul as k\n"
              "x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)\n"
              "assert not k.HAS_TRITON and 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
              "assert torch.equal(k.geglu_matmul(x, w, b), k.reference_geglu(x, w, b))\n"
              "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_use_fused_geglu_swaps_diffusers_geglu_and_keeps_weights_and_outputs(monkeypatch):
    pytest.importorskip("diffusers")
    from diffusers.models.activations import GEGLU
    from diffusers.models.attention import FeedForward

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"ff": FeedForward(16, activation_fn="geglu"),
                                 "blocks": torch.nn.Sequential(FeedForward(16, activation_fn="geglu"),
                                                               torch.nn.LayerNorm(16)),
                                 "plain": FeedForward(16, activation_fn="gelu")}).eval()
    model["nobias"] = torch.nn.Sequential(GEGLU(16, 12, bias=False))
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        before = {name: model[name](x) for name in ("ff", "blocks", "plain", "nobias")}
    keys = {key: value for key, value in model.state_dict(keep_vars=True).items()}
    projections = [m.proj for m in model.modules() if isinstance(m, GEGLU)]

    assert kernel.use_fused_geglu(model) == 3
    assert not [m for m in model.modules() if isinstance(m, GEGLU)]
    fused = [m for m in model.modules() if isinstance(m, kernel.FusedGEGLU)]
    assert len(fused) == 3 and [m.proj for m in fused] == projections  # the same Linear modules
    after_keys = model.state_dict(keep_vars=True)
    assert list(after_keys) == list(keys) and all(after_keys[k] is keys[k] for k in keys)
    assert "ff.net.0.proj.weight" in after_keys and "nobias.0.proj.bias" not in after_keys
    with torch.no_grad():
        for name, want in before.items():
            assert torch.equal(model[name](x), want), name
    assert kernel.use_fused_geglu(model) == 0  # nothing left to swap

    # a projection another pass replaced (fp8's Fp8Linear, say) runs through its own forward
    class Doubled(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return 2 * self.linear(x)

    geglu = GEGLU(16, 12)
    fused_one = kernel.FusedGEGLU(geglu)
    fused_one.proj = Doubled(geglu.proj)
    with torch.no_grad():
        hidden, gate = (2 * geglu.proj(x)).chunk(2, dim=-1)
        assert torch.equal(fused_one(x), hidden * torch.nn.functional.gelu(gate))
