"""terra's paged attention kernel (kernels/paged_attention.py) against a float64 reference. The
kernels run under Triton's interpreter in a process of their own (tests/paged_attention_interpreted.py):
fp8 and bf16 caches in vLLM's paged layout, both program shapes, split and unsplit, decodes whose
contexts end mid-page and mid-tile, empty and padded slots, prompt rows (causal, chunked), and
large prompt steps whose prompt rows another kernel runs. Its speed is measured on the GPU
(benchmarks/scripts/gpu_paged_attention.py), and its agreement inside vLLM by tests/test_gpu_parity.py."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
import paged_attention_interpreted as cases  # noqa: E402

from terra_cli.kernels import paged_attention as pd  # noqa: E402

# Relative error: float32 outputs (the kernel's own: fp16 products, fp32 sums), and bf16 outputs
# (the interpreter rounds them toward zero: twice a GPU's error). A wrong page, head, causal limit
# or scale is off by order 1.
TOLERANCE = 5e-4
BF16_TOLERANCE = 6e-3


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("interpreted")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(cases.__file__)), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {path.stem: torch.from_numpy(np.load(path)) for path in out.glob("*.npy")}


def relative_error(got, want):
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("name", list(cases.CASES))
def test_attention_matches_the_float64_reference(kernel_outputs, name):
    seed, dtype, _, _, _, decode_only = cases.CASES[name]
    query, key_cache, value_cache, table, lens, starts = cases.make_batch(seed, cases.SEQ_LENS, cases.QUERY_LENS, dtype)
    out = kernel_outputs[name]
    ref = pd.paged_attention_reference(query, key_cache, value_cache, table, lens, starts, scale=cases.SCALE,
                                       k_scale=0.5, v_scale=1.5)
    decodes = [int(starts[i]) for i, n in enumerate(cases.QUERY_LENS) if n == 1 and cases.SEQ_LENS[i]]
    prompts = [row for i, n in enumerate(cases.QUERY_LENS) if n > 1 for row in range(int(starts[i]), int(starts[i + 1]))]
    assert relative_error(out[decodes], ref[decodes]) < TOLERANCE
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the empty slot
    if decode_only:
        assert torch.isnan(out[prompts]).all()  # another kernel's rows: untouched
    else:
        for row in prompts:  # each prompt row on its own: a wrong causal limit shows in one row
            assert relative_error(out[row], ref[row]) < TOLERANCE, row


def test_fp8_query_uses_its_scale(kernel_outputs):
    query, key_cache, value_cache, table, lens, starts = cases.make_batch(7, [70, 33], [1, 1], "fp8")
    query8 = (query.float() / 0.25).to(torch.float8_e4m3fn)
    ref = pd.paged_attention_reference(query8, key_cache, value_cache, table, lens, starts, scale=cases.SCALE,
                                       q_scale=0.25)
    assert relative_error(kernel_outputs["fp8-query"], ref) < BF16_TOLERANCE


def test_padded_graph_batch_leaves_unowned_rows_alone(kernel_outputs):
    query, key_cache, value_cache, table, lens, starts = cases.make_batch(11, [30, 200, 0, 0], [1, 3, 0, 0], "fp8",
                                                                          padded_rows=5)
    out = kernel_outputs["padded"]
    ref = pd.paged_attention_reference(query, key_cache, value_cache, table, lens, starts, scale=cases.SCALE)
    assert relative_error(out[:4], ref[:4]) < TOLERANCE
    assert torch.isnan(out[4:]).all()


def test_large_prompt_step_sends_prompt_rows_to_the_other_kernel(kernel_outputs):
    query, key_cache, value_cache, table, lens, starts = cases.make_batch(3, [40, 90, 17], [1, 6, 1], "fp8")
    out = kernel_outputs["split"]
    assert torch.equal(kernel_outputs["split-prompt-query"], query[1:7].float())
    assert (out[1:7] == 7.0).all()
    ref = pd.paged_attention_reference(query, key_cache, value_cache, table, lens, starts, scale=cases.SCALE)
    assert relative_error(out[[0, 7]], ref[[0, 7]]) < BF16_TOLERANCE


def test_prefill_rows_pick_the_prompt_requests():
    starts = torch.tensor([0, 1, 2, 7, 8, 8, 11], dtype=torch.int32)  # lengths 1, 1, 5, 1, 0 (padding), 3
    lens = torch.tensor([10, 20, 30, 40, 0, 50], dtype=torch.int32)
    table = torch.arange(6, dtype=torch.int32)[:, None].repeat(1, 4)
    rows = pd.prefill_rows(starts, lens, table, "cpu")
    assert rows.token_index.tolist() == [2, 3, 4, 5, 6, 8, 9, 10]
    assert rows.query_start_loc.tolist() == [0, 5, 8]
    assert rows.seq_lens.tolist() == [30, 50]
    assert rows.block_table[:, 0].tolist() == [2, 5]
    assert rows.max_query_len == 5
    assert pd.prefill_rows(torch.tensor([0, 1, 2, 2], dtype=torch.int32), lens[:3], table[:3], "cpu") is None


def test_decode_plan_fits_the_workspace_and_fills_the_gpu():
    heads, kv_heads = 32, 4  # Terra's
    group, chunk = pd.query_rows(heads, kv_heads)
    assert (group, chunk) == (8, 2)  # Terra: a KV head's 8 query heads, 2 tokens per program
    for sms in (78, 132):
        for seqs in range(1, 600):
            for tokens in (seqs, seqs + 22, 512):
                if tokens < seqs:
                    continue
                blocks = tokens // chunk + seqs
                plan = pd.decode_plan(seqs, kv_heads, sms, blocks)
                assert plan.splits & (plan.splits - 1) == 0 and 1 <= plan.splits <= pd.MAX_SPLITS
                assert plan.splits == 1 or blocks * plan.splits <= pd.WORKSPACE_BLOCKS
            programs = seqs * plan.splits * (kv_heads if plan.program == "per-head" else 1)
            assert programs >= min(seqs, sms), (seqs, plan)  # a small batch still spreads over the GPU


def test_kernel_refuses_shapes_it_does_not_cover():
    query, key_cache, value_cache, table, lens, starts = cases.make_batch(0, [20], [1], "fp8")
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    kwargs = dict(scale=0.1, k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="power of two"):
        pd.paged_attention(query, key_cache, value_cache, table, lens, starts, out,
                           plan=pd.DecodePlan("all-heads", 3, 32), **kwargs)
    with pytest.raises(ValueError, match="heads"):
        pd.paged_attention(query[:, :15], key_cache, value_cache, table, lens, starts, out[:, :15], **kwargs)  # 15 over 2


def test_attention_choice(monkeypatch):
    from types import SimpleNamespace

    from terra_cli.backends.attention import AttentionUnavailable, choose_attention, terra_attention_unsupported

    config = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=64)  # Terra's
    choose = choose_attention
    assert choose("auto", config, on_gpu=False, kv_cache_dtype="fp8", drafting=False) == "vllm"
    assert choose("vllm", config, on_gpu=True, kv_cache_dtype="fp8", drafting=False) == "vllm"
    with pytest.raises(AttentionUnavailable, match="--attention terra: it needs a CUDA GPU"):
        choose("terra", config, on_gpu=False, kv_cache_dtype=None, drafting=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "Hopper" in terra_attention_unsupported(config, on_gpu=True)
    assert choose("auto", config, on_gpu=True, kv_cache_dtype="fp8", drafting=False) == "vllm"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert terra_attention_unsupported(config, on_gpu=True) is None
    # auto: terra's kernel where it was measured faster (an fp8 cache), vLLM's elsewhere
    assert choose("auto", config, on_gpu=True, kv_cache_dtype="fp8", drafting=False) == "terra"
    assert choose("auto", config, on_gpu=True, kv_cache_dtype=None, drafting=False) == "vllm"
    assert choose("auto", config, on_gpu=True, kv_cache_dtype="fp8", drafting=True) == "vllm"
    assert choose("terra", config, on_gpu=True, kv_cache_dtype=None, drafting=False) == "terra"
    odd = SimpleNamespace(hidden_size=1536, num_attention_heads=32, num_key_value_heads=4, head_dim=48)
    assert "head size 48" in terra_attention_unsupported(odd, on_gpu=True)


def test_attention_option_is_checked_before_a_model_loads():
    from terra_cli.pipeline.engine_request import engine_options
    from terra_cli.errors import InputError

    assert engine_options(attention="TERRA") == {"attention": "terra"}
    assert engine_options(attention="auto") == {}
    with pytest.raises(InputError, match="--attention must be auto, terra or vllm"):
        engine_options(attention="flashinfer")
    with pytest.raises(InputError, match="does not run --draft"):
        engine_options(draft="previous-frame", attention="terra")


def test_plugin_registers_the_backend_with_vllm():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from terra_cli.models import vllm_plugin

    vllm_plugin.register()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend.__module__ == "terra_cli.models.vllm_attention"
    assert backend.supports_head_size(64) and not backend.supports_head_size(48)
    assert backend.supports_kv_cache_dtype("fp8") and not backend.supports_kv_cache_dtype("fp8_e5m2")
    # every step, prompts beside decodes included, can be a FULL CUDA graph
    assert backend.get_builder_cls()._cudagraph_support == AttentionCGSupport.ALWAYS
