"""The single-stream decoder (backends/single_stream.py) on the CPU in float32: its static cache and
device sampler give the reference's codes, greedy and sampled, under the per-frame seed rule."""

import sys
import types

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicCache

from terra_cli.backends import flash_cache
from terra_cli.backends.base import Sampling
from terra_cli.backends.device_sampling import next_codes
from terra_cli.backends.hf import HfBackend, sample_next
from terra_cli.backends.single_stream import SingleStreamBackend
from terra_cli.errors import InputError
from terra_cli.models.config import FrameLayout
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.seeds import draw_seed, rollout_seed

CODES, VOCAB, FRAMES = 40, 64, 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=FRAMES)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("single_stream"), config, seed=1)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, device="cpu", dtype=torch.float32)


def inputs(rollouts=1, context_frames=2, seed=0):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, VOCAB, size=(rollouts, context_frames, CODES))
    actions = rng.normal(scale=2.0, size=(rollouts, FRAMES - 1, 6, 3)).astype(np.float32)
    return context, actions


@torch.inference_mode()
def per_frame_reference(model, context, actions, num_frames, sampling, rollout_seed, first_frame=0):
    """hf.py's token loop for one rollout, with frame f drawn from a generator seeded
    draw_seed(rollout_seed, first_frame + f): the seed rule of terra_cli/seeds.py."""
    layout = model.layout
    known = context.shape[0]
    generator = torch.Generator()
    frames = torch.zeros((num_frames, layout.image_tokens), dtype=torch.long)
    frames[:known] = torch.from_numpy(context)
    waypoints = torch.from_numpy(actions)[None]
    slots = torch.full((1, layout.action_tokens), layout.action_placeholder_id)
    prompt = torch.cat([frames[:known], slots.expand(known, -1)], dim=1).reshape(1, -1)
    cache = DynamicCache(config=model.config)
    logits, cache = model(prompt, torch.arange(prompt.shape[1])[None], waypoints[:, :known].reshape(1, -1, 3),
                          cache, use_cache=True, logits_to_keep=1)
    position = prompt.shape[1]
    for f in range(known, num_frames):
        generator.manual_seed(draw_seed(rollout_seed, first_frame + f))
        for i in range(layout.image_tokens):
            token = sample_next(logits[:, -1], layout, sampling, [generator])
            frames[f, i] = token[0]
            ids, step_actions = token[:, None], None
            if i == layout.image_tokens - 1:
                if f == num_frames - 1:
                    break
                ids, step_actions = torch.cat([ids, slots], dim=1), waypoints[:, f]
            n = ids.shape[1]
            logits, cache = model(ids, torch.arange(position, position + n)[None], step_actions, cache,
                                  use_cache=True, logits_to_keep=1)
            position += n
    return frames.numpy()


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9, seed=5),
                                      Sampling(temperature=1.3, top_k=7, seed=2), Sampling(temperature=0.7, top_p=0.8, seed=9)])
def test_the_device_sampler_draws_what_sample_next_draws(sampling):
    layout = FrameLayout(image_tokens=4, action_tokens=6, max_frames=2, image_vocab_size=300)
    logits = torch.randn(1, 302, generator=torch.Generator().manual_seed(4)) * 3
    drawn = [int(next_codes(logits, layout, sampling, torch.Generator().manual_seed(s))[0]) for s in range(40)]
    expected = [int(sample_next(logits, layout, sampling, [torch.Generator().manual_seed(s)])[0]) for s in range(40)]
    assert drawn == expected
    assert max(drawn) < 300
    assert len(set(drawn)) == 1 if sampling.greedy else len(set(drawn)) > 1


def test_noise_streams_are_a_checked_cuda_switch_and_the_rows_draw_from_their_own_generators():
    """A row batch's noise draws spread over NOISE_STREAMS CUDA streams, or TERRA_NOISE_STREAMS=N (1: none; none
    on a CPU; a bad value is one clear error). Row by row, each row's noise is what its generator alone draws,
    whatever the other rows."""
    from terra_cli.backends import device_sampling
    from terra_cli.errors import InputError

    env = device_sampling.NOISE_STREAMS_ENV
    cpu = torch.device("cpu")
    assert device_sampling.noise_streams(cpu, {}) == [] and device_sampling.noise_streams(cpu, {env: "4"}) == []
    assert device_sampling.noise_stream_count({}) == device_sampling.NOISE_STREAMS == 4
    assert device_sampling.noise_stream_count({env: "1"}) == 1 and device_sampling.noise_stream_count({env: "7"}) == 7
    for bad in ("0", "33", "four"):
        with pytest.raises(InputError, match=f"{env}='{bad}': use a whole number of streams from 1 to 32"):
            device_sampling.noise_streams(cpu, {env: bad})
    noise = torch.zeros(3, 50)
    device_sampling.draw_noise(noise, [torch.Generator().manual_seed(seed) for seed in (1, 2, 3)])
    for row, seed in zip(noise, (1, 2, 3)):
        assert torch.equal(row, torch.empty(50).exponential_(generator=torch.Generator().manual_seed(seed)))


def test_the_sliced_argmax_is_argmax_and_the_samplers_slices_are_read_once_outside_the_trace():
    """The race's argmax through N slices of each row (SAMPLER_CHUNKS, or TERRA_SAMPLER_CHUNKS=N) gives argmax's
    index, the first of equal maxima (scores drawn from a few values, so ties are everywhere); a width N does not
    divide keeps the plain argmax. The sampler reads the switch when made, so the traced graph holds the slices."""
    import functools

    from terra_cli.backends import device_sampling
    from terra_cli.errors import InputError

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        scores = torch.randint(0, 4, (6, 96), generator=gen).float()
        scores[trial % 6, -1] = 9.0  # a lone maximum at the last index of one row
        for chunks in (1, 2, 3, 4, 32, 96, 7, 200):
            assert torch.equal(device_sampling.first_argmax(scores, chunks), scores.argmax(dim=-1)), (trial, chunks)
    layout = FrameLayout(image_tokens=4, action_tokens=6, max_frames=2, image_vocab_size=256)
    logits = torch.randn(5, 258, generator=gen) * 3
    noise = torch.empty(5, 256).exponential_(generator=gen)
    sampling = Sampling(temperature=0.9, seed=1)
    env = device_sampling.SAMPLER_CHUNKS_ENV
    plain = device_sampling.race_codes(logits, noise, layout, sampling)
    sliced = device_sampling.StepSampler(False, {env: "8"})
    assert sliced.chunks == 8 and torch.equal(sliced(logits, noise, layout, sampling), plain)
    assert device_sampling.StepSampler(False, {}).chunks == device_sampling.SAMPLER_CHUNKS == 64
    assert device_sampling.StepSampler(False, {env: "1"}).chunks == 1
    for bad in ("0", "4097", "some"):
        with pytest.raises(InputError, match=f"{env}='{bad}': use a whole number of slices from 1 to 4096"):
            device_sampling.StepSampler(False, {env: bad})
    codes = []

    def keep_code(graph, inputs):
        codes.append(graph.code)
        return graph.forward

    traced = torch.compile(functools.partial(device_sampling.race_codes, chunks=8), backend=keep_code, fullgraph=True,
                           dynamic=False)
    assert torch.equal(traced(logits, noise, layout, sampling), plain)
    assert "5, 8, 32" in codes[0]  # the rows' slices, in the graph a cache is keyed by


def test_greedy_codes_equal_the_reference_backend(checkpoint, model):
    context, actions = inputs(rollouts=2)
    reported = []
    backend = SingleStreamBackend(checkpoint, device="cpu", dtype="float32")
    codes = backend.generate(context, actions, FRAMES, Sampling(temperature=0), on_frame=lambda f, t: reported.append((f, t.copy())))
    reference = HfBackend(device="cpu", model=model).generate(context, actions, FRAMES, Sampling(temperature=0))
    np.testing.assert_array_equal(codes, reference)
    assert [f for f, _ in reported] == [2, 3, 4]
    for f, tokens in reported:
        np.testing.assert_array_equal(tokens, reference[:, f])
    assert backend.stats[0]["codes_per_step"] == 1.0 and backend.stats[0]["steps"] == 3 * (CODES - 1)


@pytest.mark.parametrize("first_frame", [0, 7])
def test_sampled_codes_equal_the_reference_loop_under_the_per_frame_seed_rule(model, first_frame):
    context, actions = inputs(rollouts=2, seed=1)
    sampling = Sampling(temperature=1.0, seed=123)
    codes = SingleStreamBackend(device="cpu", model=model).generate(context, actions, FRAMES, sampling, first_frame=first_frame)
    for r in range(2):
        expected = per_frame_reference(model, context[r], actions[r], FRAMES, sampling, rollout_seed(sampling.seed, r), first_frame)
        np.testing.assert_array_equal(codes[r], expected)
    # Sampling really ran: the two rollouts (seeds 123, 124) differ, as do the round offsets.
    assert (codes[0, 2:] != codes[1, 2:]).mean() > 0.5


def test_sampled_codes_equal_the_reference_backend(model):
    context, actions = inputs(rollouts=2, seed=2)
    sampling = Sampling(temperature=0.9, seed=77)
    codes = SingleStreamBackend(device="cpu", model=model).generate(context, actions, FRAMES, sampling)
    np.testing.assert_array_equal(codes, HfBackend(device="cpu", model=model).generate(context, actions, FRAMES, sampling))


def test_a_frame_draws_the_same_codes_whatever_frames_came_before_it_in_the_round(model):
    """Per-frame streams: a frame's draws depend on (seed, frame), not on how many draws preceded
    it, so greedy context frames before it change its codes only through the model."""
    context, actions = inputs(seed=3)
    backend = SingleStreamBackend(device="cpu", model=model)
    a = backend.generate(context, actions, FRAMES, Sampling(temperature=0.9, seed=1))
    b = backend.generate(context, actions, FRAMES, Sampling(temperature=0.9, seed=1))
    c = backend.generate(context, actions, FRAMES, Sampling(temperature=0.9, seed=2))
    np.testing.assert_array_equal(a, b)
    assert (a[0, 2:] != c[0, 2:]).mean() > 0.5


def test_bad_options_are_one_line_input_errors(model):
    with pytest.raises(InputError, match="draft_tokens must be from 0"):
        SingleStreamBackend(device="cpu", model=model, draft_tokens=33)
    with pytest.raises(InputError, match="draft must be"):
        SingleStreamBackend(device="cpu", model=model, draft_tokens=2, draft="ngram")
    with pytest.raises(InputError, match="CUDA graphs need a CUDA device"):
        SingleStreamBackend(device="cpu", model=model, cuda_graphs=True)
    with pytest.raises(InputError, match="a round must have more frames than"):
        SingleStreamBackend(device="cpu", model=model).generate(*inputs(), FRAMES + 1, Sampling())


@pytest.mark.slow
def test_compiled_layer_functions_give_the_eager_codes(model):
    """torch.compile of the layers' elementwise work (on by default on CUDA) runs here on the CPU
    (Inductor's C++ backend): the decode steps take the compiled functions, and the greedy codes
    stay the reference's."""
    from terra_cli.backends.single_stream import SingleStreamDecoder
    from terra_cli.backends.static_kv import StaticKVDecoder

    context, actions = inputs()
    decoder = SingleStreamDecoder(model)
    decoder.core = StaticKVDecoder(model, compile_layers=True)
    codes = decoder.rollout(context[0], actions[0], 4, Sampling(temperature=0), 0)
    assert decoder.core.compiled, decoder.core.ops.compile_error
    assert decoder.core.prologue.compiled, decoder.core.prologue.error  # the step's inputs too
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], 4, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)


def test_the_layer_compile_mode_comes_from_the_environment_and_is_checked(model, monkeypatch):
    """TERRA_SINGLE_STREAM_COMPILE_MODE reaches torch.compile of every layer function (a GPU
    comparison of Inductor's autotuned GEMMs); unset or `default` is torch.compile's default, and an
    unknown mode is refused when the decoder is built."""
    from terra_cli.backends import layer_ops

    modes = []
    monkeypatch.setattr(layer_ops.torch, "compile", lambda fn, **kwargs: modes.append(kwargs["mode"]) or fn)
    for value, expected in ((None, None), ("default", None), ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")):
        if value is None:
            monkeypatch.delenv(layer_ops.COMPILE_MODE_ENV, raising=False)
        else:
            monkeypatch.setenv(layer_ops.COMPILE_MODE_ENV, value)
        modes.clear()
        ops = layer_ops.LayerOps(model, compile_layers=True)
        # the inputs', the inputs' with the cache written (CACHE_WRITE_ENV), the output's
        assert isinstance(ops.decode.functions, layer_ops.CompiledOps) and modes == [expected] * 3
    monkeypatch.setenv(layer_ops.COMPILE_MODE_ENV, "fastest")
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_COMPILE_MODE"):
        layer_ops.LayerOps(model, compile_layers=True)


def test_the_layer_projections_switch_is_checked_and_needs_a_device_that_runs_the_kernel(model, monkeypatch):
    """TERRA_SINGLE_STREAM_LAYERS=few-rows puts the decode step's projections on terra's kernel where
    it runs (CUDA, Triton's interpreter: tests/test_few_rows_matmul.py runs it there); on a plain CPU
    it is ignored like the logits' switch, and a value it does not know is refused."""
    import torch.nn.functional as F

    from terra_cli.backends import layer_ops
    from terra_cli.kernels.few_rows_matmul import few_rows_linear

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert layer_ops.layer_projections(cuda, {}) == "linear"
    assert layer_ops.layer_projections(cuda, {layer_ops.LAYERS_ENV: "few-rows"}) == "few-rows"
    assert layer_ops.layer_projections(cpu, {layer_ops.LAYERS_ENV: "few-rows"}) == "linear"
    assert layer_ops.layer_projections(cpu, {layer_ops.LAYERS_ENV: "few-rows", "TRITON_INTERPRET": "1"}) == "few-rows"
    assert layer_ops.layer_projections(cuda, {layer_ops.LAYERS_ENV: "few-rows-fp8"}) == "few-rows-fp8"
    assert layer_ops.layer_projections(cpu, {layer_ops.LAYERS_ENV: "few-rows-fp8"}) == "linear"
    monkeypatch.setenv("TERRA_FEW_ROWS_SPLITS", "bytes")  # read where the projection is made, bound to it
    for name in ("few-rows-fp8", "few-rows"):  # fp8: it takes (values, scale) pairs too
        bound = layer_ops.projection(name, cpu)
        assert bound.func is few_rows_linear and bound.keywords == {"programs": 1, "splits_mode": "bytes"}
    monkeypatch.delenv("TERRA_FEW_ROWS_SPLITS")
    assert layer_ops.projection("few-rows", cpu).keywords["splits_mode"] == "programs"
    assert layer_ops.projection("linear", cpu) is F.linear
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_LAYERS='cutlass'"):
        layer_ops.layer_projections(cuda, {layer_ops.LAYERS_ENV: "cutlass"})
    monkeypatch.setenv(layer_ops.LAYERS_ENV, "few-rows")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ops = layer_ops.LayerOps(model, compile_layers=False)  # this CPU: the modules' own weights, F.linear
    assert ops.projections == "linear" and ops.decode is ops.eager


def test_the_unroll_switch_reaches_the_layer_functions_compile_and_is_checked(model, monkeypatch):
    """TERRA_SINGLE_STREAM_UNROLL_REDUCTIONS=N: Inductor's unroll_reductions_threshold for the three compiled
    layer functions (no mode beside it: torch.compile takes one); unset, torch.compile's defaults for
    cuBLAS's projections and SPLIT_SUM_UNROLL for the few-rows kernel's (its split-K sums). Here with the
    programmatic launches off (TORCHINDUCTOR_ENABLE_PDL=0); the next test has them."""
    from terra_cli.backends import layer_ops
    from terra_cli.errors import InputError

    unroll, mode, plain = layer_ops.UNROLL_ENV, layer_ops.COMPILE_MODE_ENV, {"TORCHINDUCTOR_ENABLE_PDL": "0"}
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")
    assert layer_ops.compile_options(plain) is None
    assert layer_ops.compile_options({unroll: " 32 ", **plain}) == {"unroll_reductions_threshold": 32}
    split_sums = {"unroll_reductions_threshold": layer_ops.SPLIT_SUM_UNROLL}
    assert layer_ops.SPLIT_SUM_UNROLL > 8  # more terms than Inductor writes out by default
    for kind in ("few-rows", "few-rows-fp8"):
        assert layer_ops.compile_options(plain, kind) == split_sums
        assert layer_ops.compile_options({unroll: "8", **plain}, kind) == {"unroll_reductions_threshold": 8}
        assert layer_ops.compile_options({mode: "max-autotune-no-cudagraphs"}, kind) is None  # the mode alone
    for bad in ("0", "65", "many"):
        with pytest.raises(InputError, match=f"{unroll}='{bad}': use a whole number of terms from 1 to 64"):
            layer_ops.compile_options({unroll: bad})
    with pytest.raises(InputError, match="cannot both be set"):
        layer_ops.compile_options({unroll: "32", mode: "max-autotune-no-cudagraphs"})
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: asked.append(options) or fn)
    for value, expected in (("32", {"unroll_reductions_threshold": 32}), (None, None)):
        if value is None:
            monkeypatch.delenv(unroll)
        else:
            monkeypatch.setenv(unroll, value)
        asked.clear()
        assert isinstance(layer_ops.LayerOps(model, compile_layers=True).decode.functions, layer_ops.CompiledOps)
        assert len(asked) == 3 and all(o["options"] == expected and o["mode"] is None for o in asked), asked
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the few-rows kernel runs on this CPU
    asked.clear()
    ops = layer_ops.LayerOps(model, compile_layers=True, projections="few-rows-fp8")
    assert ops.projections == "few-rows-fp8" and isinstance(ops.decode.functions, layer_ops.CompiledOps)
    assert len(asked) == 3 and all(o["options"] == split_sums for o in asked), asked


def test_every_compiled_part_of_a_step_launches_programmatically_unless_switched_off(model, monkeypatch):
    """Inductor's programmatic dependent launches (`step_compile.launch_options`) reach the layer functions,
    the sampler and the step's inputs, with the options each needs besides; TORCHINDUCTOR_ENABLE_PDL=0 takes
    them off all three, and a value other than 0 or 1 is refused."""
    from terra_cli.backends import step_compile
    from terra_cli.backends.device_sampling import StepSampler
    from terra_cli.backends.static_kv import StaticKVDecoder
    from terra_cli.errors import InputError

    pdl = {"triton.enable_pdl": True}
    assert step_compile.launch_options({}) == pdl and step_compile.launch_options({"TORCHINDUCTOR_ENABLE_PDL": "0"}) == {}
    assert step_compile.compile_options({}, "few-rows-fp8") == {**pdl, "unroll_reductions_threshold": 32}
    with pytest.raises(InputError, match="TORCHINDUCTOR_ENABLE_PDL='2': use 1 or 0"):
        step_compile.launch_options({"TORCHINDUCTOR_ENABLE_PDL": "2"})
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: asked.append(options) or fn)
    for value, launches in ((None, pdl), ("1", pdl), ("0", {})):
        if value is None:
            monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", value)
        asked.clear()
        StaticKVDecoder(model, compile_layers=True)
        StepSampler(compiled=True)
        options = [o["options"] or {} for o in asked]
        assert len(options) == 6, asked  # three layer functions, the step's inputs and final norm, the sampler
        assert all(o.items() >= launches.items() for o in options) and (launches or all("triton.enable_pdl" not in o
                                                                                        for o in options)), options
        assert options[3] == {"emulate_precision_casts": True, **launches}  # the step's inputs keep eager's bits


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """One sequence's attention, written plainly: q (n, heads, d) over its keys and values (used, KV, d),
    query heads sharing KV heads in groups, the causal mask aligned to the bottom right."""
    used, n = keys.shape[0], q.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * softmax_scale
    visible = torch.arange(used)[None, :] <= (used - n + torch.arange(n))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values.float()).to(q.dtype)


def paged_varlen_attention(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table,
                           softmax_scale, causal, fa_version, scheduler_metadata=None):
    """FlashAttention's `flash_attn_varlen_func` contract for one sequence, written plainly: keys
    are the cache's blocks in `block_table`'s order, the first `seqused_k` of them are real, query
    heads share KV heads in groups, and the causal mask is aligned to the bottom right. A plan
    (`plan_for_keys_seen`'s) must have been made for this call's keys and rows."""
    assert causal and fa_version in (2, 3) and cu_seqlens_q.tolist() == [0, q.shape[0]] == [0, max_seqlen_q]
    if scheduler_metadata is not None:
        assert scheduler_metadata.tolist() == [int(seqused_k[0]), max_seqlen_q]
    assert max_seqlen_k == block_table.shape[1] * k.shape[1]
    used = int(seqused_k[0])
    keys = k[block_table[0].long()].flatten(0, 1)[:used]  # (used, KV, d)
    values = v[block_table[0].long()].flatten(0, 1)[:used]
    return causal_attention(q, keys, values, softmax_scale)


def plan_for_keys_seen(*, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                       qkv_dtype, cu_seqlens_q, page_size, causal):
    """FlashAttention-3's `get_scheduler_metadata` contract, standing in for it on the CPU: the plan
    records what it was made for, which `paged_varlen_attention` checks."""
    assert batch_size == 1 and causal and page_size == flash_cache.flash_page() and cu_seqlens_q.tolist() == [0, max_seqlen_q]
    return torch.tensor([int(cache_seqlens[0]), max_seqlen_q])


def fake_flash_attention(monkeypatch, kernel=paged_varlen_attention, planner=plan_for_keys_seen):
    """The decoder's FlashAttention-3 path (its kernel and its plan a step) as their contracts, on the CPU."""
    from terra_cli.backends import static_kv

    monkeypatch.setattr(static_kv, "flash_varlen_kernel", lambda device, dtype: (kernel, 3))
    monkeypatch.setattr(static_kv, "flash_planner", lambda version: planner if version == 3 else None)


@pytest.mark.parametrize("draft_tokens,page", [(0, "256"), (4, "256"), (0, "16"), (4, "16")])
def test_the_flash_attention_layout_gives_the_reference_codes(model, monkeypatch, draft_tokens, page):
    """The cache as FlashAttention's paged layout (what CUDA runs when vLLM's kernel is present),
    with the kernel's documented contract standing in for it: the block table, `seqused_k` and
    the per-step query rows the decoder passes give the reference's greedy codes, one code per
    step and with Jacobi windows, in pages of 256 (the default) and of 16 (the lab switch)."""
    from terra_cli.backends import static_kv
    from terra_cli.backends.single_stream import SingleStreamDecoder

    fake_flash_attention(monkeypatch)
    monkeypatch.setenv(flash_cache.FLASH_PAGE_ENV, page)
    context, actions = inputs(seed=4)
    decoder = SingleStreamDecoder(model, draft_tokens=draft_tokens)
    decoder.core = static_kv.StaticKVDecoder(model, compile_layers=False)
    assert decoder.core.attention == "flash" and decoder.core.flash.page == int(page)
    assert decoder.core.cache_positions % int(page) == 0 and decoder.core.flash.block_table.shape[1] * int(page) == \
        decoder.core.cache_positions
    codes = decoder.rollout(context[0], actions[0], FRAMES, Sampling(temperature=0), 0)
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], FRAMES, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)


def test_one_flash_plan_a_step_reaches_every_layer_and_keeps_the_codes(model, monkeypatch):
    """FlashAttention-3's scheduler plan is made once a step (the default), from the step's rows and
    `seqused_k`, and every layer's call of that step gets that one plan; the codes stay the reference's.
    TERRA_SINGLE_STREAM_FLASH_PLAN=call (and FlashAttention-2) make no plan; a value it does not know is
    refused."""
    from terra_cli.backends import static_kv
    from terra_cli.backends.single_stream import SingleStreamDecoder

    plans, handed = [], []

    def planner(*, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim, cache_seqlens,
                qkv_dtype, cu_seqlens_q, page_size, causal):
        assert batch_size == 1 and causal and page_size == flash_cache.flash_page() and qkv_dtype == torch.float32
        assert cu_seqlens_q.tolist() == [0, max_seqlen_q] and num_heads_q % num_heads_kv == 0
        plans.append(torch.tensor([int(cache_seqlens[0]), max_seqlen_q]))
        return plans[-1]

    def kernel(q, k, v, scheduler_metadata=None, **contract):
        handed.append(scheduler_metadata)
        return paged_varlen_attention(q, k, v, **contract)

    fake_flash_attention(monkeypatch, kernel, planner)
    context, actions = inputs(seed=5)
    decoder = SingleStreamDecoder(model, draft_tokens=0)
    decoder.core = static_kv.StaticKVDecoder(model, compile_layers=False)
    codes = decoder.rollout(context[0], actions[0], FRAMES, Sampling(temperature=0), 0)
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], FRAMES, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)
    layers = model.config.num_hidden_layers
    assert plans and len(handed) == layers * len(plans)
    for step, plan in enumerate(plans):  # each step's layers got that step's plan, the very tensor
        assert all(got is plan for got in handed[step * layers: (step + 1) * layers])
    assert [int(p[0]) for p in plans] == sorted(int(p[0]) for p in plans)  # keys seen only grow
    monkeypatch.undo()
    interface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    interface.get_scheduler_metadata = planner
    monkeypatch.setitem(sys.modules, interface.__name__, interface)
    assert flash_cache.flash_planner(3, {}) is planner and flash_cache.flash_planner(3, {flash_cache.FLASH_PLAN_ENV: "Step"}) is planner
    assert flash_cache.flash_planner(3, {flash_cache.FLASH_PLAN_ENV: "call"}) is None
    assert flash_cache.flash_planner(2, {flash_cache.FLASH_PLAN_ENV: "step"}) is None
    monkeypatch.setitem(sys.modules, interface.__name__, None)  # a build without it: each call plans
    assert flash_cache.flash_planner(3, {}) is None
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_FLASH_PLAN='layer'"):
        flash_cache.flash_planner(3, {flash_cache.FLASH_PLAN_ENV: "layer"})


def test_the_flash_page_is_256_unless_the_lab_switch_says_16():
    assert flash_cache.flash_page({}) == 256 and flash_cache.flash_page({flash_cache.FLASH_PAGE_ENV: " 16 "}) == 16
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_FLASH_PAGE='64'"):
        flash_cache.flash_page({flash_cache.FLASH_PAGE_ENV: "64"})
    with pytest.raises(ValueError, match="not whole pages of 256"):
        flash_cache.FlashCacheAttention(None, 3, 1000, torch.device("cpu"), page=256)


@pytest.mark.parametrize("compiled", [False, True])
def test_k_and_v_written_inside_the_layer_function_give_the_reference_codes(model, monkeypatch, compiled):
    """On FlashAttention's layout (by default; TERRA_SINGLE_STREAM_CACHE_WRITE=separate turns it off), a
    decode step's k and v go into the cache inside the (fused, or compiled) layer function, with no
    `index_copy_` of the step's own; prompts keep the separate writes. Jacobi windows (K=3) included: the
    reference's greedy codes."""
    from terra_cli.backends import layer_ops, static_kv
    from terra_cli.backends.single_stream import SingleStreamDecoder

    fake_flash_attention(monkeypatch)
    monkeypatch.delenv(layer_ops.CACHE_WRITE_ENV, raising=False)
    context, actions = inputs(seed=6)
    decoder = SingleStreamDecoder(model, draft_tokens=3)
    decoder.core = static_kv.StaticKVDecoder(model, compile_layers=compiled)
    if not compiled:
        decoder.core.ops = layer_ops.LayerOps(model, compile_layers=False, fuse_projections=True)
    assert decoder.core.fused_cache_write and decoder.core.ops.for_rows(True).writes_cache
    assert not decoder.core.ops.for_rows(False).writes_cache
    steps = decoder.core.ops.for_rows(True)
    calls = {"written": 0, "separate": 0}
    for name in calls:
        method = getattr(steps, "attention_inputs_written" if name == "written" else "attention_inputs")
        setattr(steps, method.__name__, lambda *args, method=method, name=name: calls.update({name: calls[name] + 1})
                or method(*args))
    frames = 4 if compiled else FRAMES
    codes = decoder.rollout(context[0], actions[0], frames, Sampling(temperature=0), 0)
    assert not compiled or decoder.core.compiled, decoder.core.ops.compile_error
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], frames, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)
    # every decode step's layers wrote their own k and v; none went the separate way
    assert calls["written"] > 0 and calls["written"] % model.config.num_hidden_layers == 0 and calls["separate"] == 0
    assert layer_ops.cache_write({layer_ops.CACHE_WRITE_ENV: " Separate"}) == "separate"
    monkeypatch.setenv(layer_ops.CACHE_WRITE_ENV, "separate")
    assert not static_kv.StaticKVDecoder(model, compile_layers=False).fused_cache_write
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_CACHE_WRITE='both'"):
        layer_ops.cache_write({layer_ops.CACHE_WRITE_ENV: "both"})


@pytest.mark.parametrize("draft_tokens", [0, 4])
def test_fused_projections_give_the_reference_codes(model, draft_tokens):
    """The decode steps' fused projections (q, k, v as one GEMM, gate and up as one: what the
    compiled CUDA path runs), here eager on the CPU, give the reference's greedy codes."""
    from terra_cli.backends import static_kv
    from terra_cli.backends.layer_ops import FusedOps, LayerOps
    from terra_cli.backends.single_stream import SingleStreamDecoder

    context, actions = inputs(seed=5)
    decoder = SingleStreamDecoder(model, draft_tokens=draft_tokens)
    decoder.core = static_kv.StaticKVDecoder(model, compile_layers=False)
    decoder.core.ops = LayerOps(model, compile_layers=False, fuse_projections=True)
    assert isinstance(decoder.core.ops.for_rows(True).functions, FusedOps)
    codes = decoder.rollout(context[0], actions[0], FRAMES, Sampling(temperature=0), 0)
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], FRAMES, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)


@pytest.mark.parametrize("draft_tokens", [3, 8])
def test_jacobi_logits_computed_weight_major_give_the_reference_codes(model, draft_tokens, monkeypatch):
    """TERRA_SINGLE_STREAM_LOGITS=weight-major computes a Jacobi step's rows as W @ h.T (a candidate
    for the GPU's lm_head kernel choice): the multi-row steps really skip the Linear, and the codes
    are the reference's."""
    from terra_cli.backends import static_kv
    from terra_cli.backends.single_stream import SingleStreamDecoder

    context, actions = inputs(seed=6)
    monkeypatch.setenv(static_kv.LOGITS_ENV, "weight-major")
    decoder = SingleStreamDecoder(model, draft_tokens=draft_tokens)
    assert decoder.core.logits_layout == "weight-major"
    head_rows = []
    lm_head = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda x: head_rows.append(x.shape[0]) or lm_head(x))
    codes = decoder.rollout(context[0], actions[0], FRAMES, Sampling(temperature=0), 0)
    monkeypatch.undo()
    assert draft_tokens + 1 not in head_rows  # every (K + 1)-row step went weight-major
    reference = HfBackend(model=model, device="cpu").generate(context[0], actions[0], FRAMES, Sampling(temperature=0))[0]
    np.testing.assert_array_equal(codes, reference)


def test_an_unknown_logits_layout_is_refused(model, monkeypatch):
    from terra_cli.backends import static_kv
    from terra_cli.backends.single_stream import SingleStreamDecoder

    monkeypatch.setenv(static_kv.LOGITS_ENV, "padded")
    with pytest.raises(ValueError, match="TERRA_SINGLE_STREAM_LOGITS"):
        SingleStreamDecoder(model, draft_tokens=3)


def test_the_logits_layout_is_the_kernel_on_cuda_and_fp8_weights_ask_for_fp8_everywhere(model, monkeypatch):
    """Few-rows logits by default on CUDA (measured faster there, the same codes), the module's lm_head
    on a CPU; fp8 weights (`--quantization fp8`) ask for the fp8 kernel for the layers and the logits,
    and the lab switches still name another."""
    from terra_cli.backends import layer_ops, static_kv

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert static_kv.default_logits_layout(cuda) == "few-rows" and static_kv.default_logits_layout(cpu) == "linear"
    assert static_kv.default_logits_layout(cuda, fp8_weights=True) == "few-rows-fp8"
    assert layer_ops.layer_projections(cuda, {}, asked="few-rows-fp8") == "few-rows-fp8"
    assert layer_ops.layer_projections(cuda, {layer_ops.LAYERS_ENV: "linear"}, asked="few-rows-fp8") == "linear"
    monkeypatch.delenv(static_kv.LOGITS_ENV, raising=False)
    assert SingleStreamBackend(model=model, device="cpu").decoder.core.logits_layout == "linear"


def test_fp8_weights_are_refused_where_the_kernel_cannot_run(checkpoint, monkeypatch):
    """`--quantization fp8` reaches the single-stream decoder through load_backend; on a plain CPU the
    request layer refuses it in one line, and a library caller that skips it gets the backend's error."""
    from terra_cli.backends import load_backend
    from terra_cli.pipeline.engine_request import check_backend_options, engine_options

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    options = engine_options(quantization="fp8")
    with pytest.raises(InputError, match="--quantization fp8 on --backend single-stream runs terra's Triton kernel"):
        check_backend_options("single-stream", options, "cpu")
    check_backend_options("single-stream", options, "cuda:0")
    with pytest.raises(InputError, match="--quantization: vLLM engine option"):
        check_backend_options("hf", options, "cuda:0")
    with pytest.raises(ValueError, match="fp8 weights run through terra's Triton kernel, on CUDA"):
        load_backend("single-stream", checkpoint, device="cpu", dtype="float32", **options)
    with pytest.raises(ValueError, match="quantization: None or 'fp8'"):
        SingleStreamBackend(checkpoint, device="cpu", quantization="int4")


def test_the_rotary_table_holds_what_each_step_computes(checkpoint, monkeypatch):
    """A step's rotary cos and sin come from a table the model's rotary module makes once: each row is, bit for
    bit, what the module gives at that position alone or inside a window (float32 and bf16 weights). With
    TERRA_SINGLE_STREAM_ROTARY=step the decoder computes them at every step, and its logits are the same."""
    from terra_cli.backends import static_kv

    rng = np.random.default_rng(5)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(checkpoint, device="cpu", dtype=dtype)
        last = model.layout.max_positions
        cos, sin = static_kv.rotary_table(model, last, dtype)
        assert cos.shape == sin.shape == (1, last, model.config.hidden_size // model.config.num_attention_heads)
        for start, width in [(0, 1), (last - 1, 1), (1, 5), *((int(p), 1) for p in rng.integers(0, last, 20))]:
            alone = model.model.rotary_emb(torch.empty(0, dtype=dtype), torch.arange(start, start + width)[None])
            assert alone[0].dtype == dtype and torch.equal(cos[:, start:start + width], alone[0]), (dtype, start)
            assert torch.equal(sin[:, start:start + width], alone[1]), (dtype, start)
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)
    codes = torch.as_tensor(rng.integers(0, VOCAB, size=12))
    logits = {}
    for mode in ("table", "step"):
        monkeypatch.setenv(static_kv.ROTARY_ENV, mode)
        decoder = static_kv.StaticKVDecoder(model)
        assert (decoder.rotary is None) == (mode == "step")
        prompt = decoder.forward_codes(codes[:10], torch.arange(10), 10)
        steps = [decoder.forward_codes(codes[i:i + 1], torch.tensor([i]), i + 1) for i in (10, 11)]
        logits[mode] = torch.cat([prompt, *steps])
    assert torch.equal(logits["table"], logits["step"])
    monkeypatch.setenv(static_kv.ROTARY_ENV, "cached")
    with pytest.raises(InputError, match="TERRA_SINGLE_STREAM_ROTARY='cached': use table"):
        static_kv.StaticKVDecoder(model)
