"""Several rollouts decided together (backends/row_batch.py) on the CPU in float32: each rollout of a
batch gets the codes it gets alone on the single-stream decoder (greedy and sampled, per-row seeds and
frame offsets), whatever its context length, frame count or place in the batch; a dropped rollout idles
while the others go on."""

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from terra_cli.backends.base import Sampling
from terra_cli.backends.row_batch import MAX_ROWS, ROW_BUCKETS, RowBatchDecoder, RowWork, bucket
from terra_cli.backends.single_stream import SingleStreamDecoder
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from test_single_stream import causal_attention

CODES, VOCAB, FRAMES = 40, 64, 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=FRAMES)
    return load_model(write_tiny_checkpoint(tmp_path_factory.mktemp("row_batch"), config, seed=3), "cpu", torch.float32)


def work(seed: int, context_frames: int, num_frames: int, first_frame: int = 0) -> RowWork:
    rng = np.random.default_rng(seed)
    context = rng.integers(0, VOCAB, size=(context_frames, CODES))
    actions = rng.normal(scale=2.0, size=(num_frames - 1, 6, 3)).astype(np.float32)
    return RowWork(context, actions, num_frames, seed=100 + seed, first_frame=first_frame)


def alone(model, w: RowWork, sampling: Sampling) -> np.ndarray:
    return SingleStreamDecoder(model).rollout(w.context, w.actions, w.num_frames, sampling, w.seed, w.first_frame)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9),
                                      Sampling(temperature=1.2, top_k=9), Sampling(temperature=0.8, top_p=0.9)])
def test_each_rollout_of_a_batch_gets_its_own_codes_alone(model, sampling):
    # three rollouts (run at 4 rows): other context lengths, frame counts and frame offsets
    batch = [work(0, 2, 5), work(1, 1, 3, first_frame=7), work(2, 3, 5, first_frame=2)]
    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=4)
    seen, done = [], []
    got = decoder.rollouts(batch, sampling, on_frame=lambda i, f, tokens: seen.append((i, f)),
                           on_row_done=lambda i, frames: done.append(i))
    for w, frames in zip(batch, got):
        np.testing.assert_array_equal(frames, alone(model, w, sampling))
    assert sorted(seen) == [(0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (2, 3), (2, 4)]
    assert done == [1, 2, 0]  # 1 and 2 decide two frames, in row order; 0 decides three
    assert decoder.steps == 3 * (CODES - 1)  # one step a code for all rows: the longest rollout's frames


def test_running_ahead_of_the_frames_hand_out_changes_no_code(model):
    """With `run_ahead` (the CUDA default), the next frames' steps are queued before the done frames are
    handed out, and a frame a run-ahead ended is handed out at the next call without more steps."""
    sampling = Sampling(temperature=0.9)
    batch = [work(5, 2, 5), work(6, 1, 3, first_frame=4), work(7, 3, 5)]
    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=4)
    decoder.run_ahead = True
    seen = []
    got = decoder.rollouts(batch, sampling, on_frame=lambda i, f, tokens: seen.append((i, f, decoder.steps)))
    for w, frames in zip(batch, got):
        np.testing.assert_array_equal(frames, alone(model, w, sampling))
    step = CODES - 1
    # each frame is handed out one frame's steps after it ended: the next frame's ran ahead
    assert seen == [(0, 2, 2 * step), (1, 1, 2 * step), (2, 3, 2 * step), (0, 3, 3 * step), (1, 2, 3 * step),
                    (2, 4, 3 * step), (0, 4, 3 * step)]


def test_a_dropped_rollout_idles_and_the_batch_goes_on(model):
    sampling = Sampling(temperature=0.9)
    batch = [work(3, 2, 5), work(4, 2, 5)]
    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=2)
    frames_of = {0: [], 1: []}

    def on_frame(i, f, tokens):
        frames_of[i].append(f)
        return not (i == 0 and f == 2)  # drop rollout 0 after its first frame

    got = decoder.rollouts(batch, sampling, on_frame=on_frame)
    assert frames_of == {0: [2], 1: [2, 3, 4]}
    np.testing.assert_array_equal(got[1], alone(model, batch[1], sampling))


def next_frame_of(w: RowWork, frames: np.ndarray, seed: int) -> RowWork:
    """A session's next frame: its frames so far as the context and one action more."""
    action = np.random.default_rng(seed).normal(scale=2.0, size=(1, 6, 3)).astype(np.float32)
    return RowWork(frames, np.concatenate([w.actions, action]), w.num_frames + 1, w.seed, w.first_frame)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9, top_k=20)])
def test_a_rollout_continuing_a_rows_frames_starts_from_that_rows_cache(model, sampling):
    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=4)
    first = [work(10, 2, 3), work(11, 2, 3, first_frame=5), work(12, 1, 2)]
    got = decoder.rollouts(first, sampling)
    prompts = []
    forward_prompt = decoder.core.forward_prompt
    decoder.core.forward_prompt = lambda *args, **kwargs: prompts.append(kwargs["row"]) or forward_prompt(*args, **kwargs)
    edited = next_frame_of(first[1], got[1], 1)
    edited.actions[0] += 1.0  # an earlier action differs: its row's cache does not hold this context
    second = [next_frame_of(first[2], got[2], 2), work(13, 2, 3), next_frame_of(first[0], got[0], 3), edited]
    # each continuation on its own row; the new rollout on the row holding nothing, the edited one on what is left
    assert decoder.place(second) == [2, 3, 0, 1]
    again = decoder.rollouts(second, sampling)
    assert sorted(prompts) == [1, 3] and decoder.prompts_reused == 2
    for w, frames in zip(second, again):
        np.testing.assert_array_equal(frames, alone(model, w, sampling))


def test_a_new_rollout_takes_its_owners_row_and_leaves_the_others_kept_rows(model):
    from dataclasses import replace

    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=4)
    decoder.rollouts([replace(work(20, 2, 3), owner="x"), replace(work(21, 2, 3), owner="y")], Sampling(temperature=0))
    new_round_of_y = replace(work(22, 3, 4), owner="y")  # its context is not what row 1 holds
    assert decoder.place([new_round_of_y]) == [1]
    assert decoder.place([work(23, 3, 4)]) == [2]  # no owner: the lowest row holding nothing


def test_batches_run_at_a_few_sizes():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="at most 32"):
        bucket(ROW_BUCKETS[-1] + 1)


def test_a_batch_larger_than_the_decoder_is_refused(model):
    decoder = RowBatchDecoder(SingleStreamDecoder(model).core, rows=2)
    with pytest.raises(ValueError, match="3 rollouts need 4 rows"):
        decoder.rollouts([work(5, 2, 3)] * 3, Sampling(temperature=0))


def paged_varlen_sequences(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table, softmax_scale,
                           causal, fa_version, scheduler_metadata=None):
    """FlashAttention's `flash_attn_varlen_func` contract for several sequences, written plainly: sequence s
    has queries cu_seqlens_q[s]..cu_seqlens_q[s + 1], its keys are block_table[s]'s blocks in order, the
    first seqused_k[s] of them real, and its causal mask is aligned to the bottom right."""
    assert causal and block_table.shape[0] == seqused_k.shape[0] == cu_seqlens_q.shape[0] - 1
    assert max_seqlen_k == block_table.shape[1] * k.shape[1]
    if scheduler_metadata is not None:  # made for these sequences' keys
        assert scheduler_metadata.tolist() == seqused_k.tolist()
    out = []
    for s in range(block_table.shape[0]):
        qs = q[int(cu_seqlens_q[s]):int(cu_seqlens_q[s + 1])]
        used = int(seqused_k[s])
        assert qs.shape[0] <= max_seqlen_q
        keys = k[block_table[s].long()].flatten(0, 1)[:used]
        values = v[block_table[s].long()].flatten(0, 1)[:used]
        out.append(causal_attention(qs, keys, values, softmax_scale))
    return torch.cat(out)


def test_the_flash_attention_layout_gives_each_rollout_its_own_codes(model, monkeypatch):
    """On FlashAttention's paged layout (the kernel's contract standing in for it), with one plan a step and
    k and v written inside the layer functions at each row's region: the codes of each rollout alone."""
    from terra_cli.backends import layer_ops, static_kv

    plans = []

    def planner(*, batch_size, max_seqlen_q, cache_seqlens, cu_seqlens_q, **contract):
        assert cache_seqlens.shape == (batch_size,) and cu_seqlens_q.tolist() == [i * max_seqlen_q for i in range(batch_size + 1)]
        plans.append(batch_size)
        return cache_seqlens.clone()

    monkeypatch.setattr(static_kv, "flash_varlen_kernel", lambda device, dtype: (paged_varlen_sequences, 3))
    monkeypatch.setattr(static_kv, "flash_planner", lambda version: planner)
    sampling = Sampling(temperature=0.9)
    batch = [work(6, 2, 4), work(7, 3, 5, first_frame=4), work(8, 1, 3)]
    single = static_kv.StaticKVDecoder(model, compile_layers=False)
    single.ops = layer_ops.LayerOps(model, compile_layers=False, fuse_projections=True)
    decoder = RowBatchDecoder(single, rows=4)
    assert decoder.core.attention == "flash" and decoder.core.fused_cache_write
    got = decoder.rollouts(batch, sampling)
    # the next frame of each: the rows' caches hold their contexts (their frame ends in one forward)
    continued = [next_frame_of(w, frames, seed) for seed, (w, frames) in enumerate(zip(batch, got))
                 if w.num_frames < FRAMES]
    again = decoder.rollouts(continued, sampling)
    monkeypatch.undo()
    assert decoder.prompts_reused == 2
    for w, frames in zip(batch + continued, got + again):
        np.testing.assert_array_equal(frames, alone(model, w, sampling))
    assert 4 in plans and 1 in plans  # the batched steps' four rows, and each prompt's one


def test_compiled_layer_functions_keep_a_graph_for_every_row_count(model, monkeypatch):
    # Dynamo's eager backend guards and counts shapes as Inductor would, without a C++ build; running
    # past the recompile limit raises here (it would only log and go eager in a server).
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile(fn, backend="eager", dynamic=False,
                                                                        fullgraph=True))
    torch._dynamo.reset()
    # dynamo's default limit, whatever ran before
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        single = SingleStreamDecoder(model, compile_layers=True)
        assert single.core.compiled
        batch = [work(seed, 2, 3) for seed in range(MAX_ROWS)]
        decoder = RowBatchDecoder(single.core, rows=MAX_ROWS)
        assert decoder.warm_up(Sampling(temperature=0.9)) > 0
        graphs = counters["stats"]["unique_graphs"]
        for rows in ROW_BUCKETS:
            expected = [alone(model, w, Sampling(temperature=0)) for w in batch[:rows]] if rows <= 2 else None
            got = decoder.rollouts(batch[:rows], Sampling(temperature=0))
            if expected is not None:  # the compiled functions are the eager ones' math
                for frames, want in zip(got, expected):
                    np.testing.assert_array_equal(frames, want)
        # sampled as the warm-up was: the compiled sampler (`StepSampler`) draws what the eager one draws
        sampled = Sampling(temperature=0.9)
        for frames, w in zip(decoder.rollouts(batch[:2], sampled), batch[:2]):
            np.testing.assert_array_equal(frames, alone(model, w, sampled))
        assert counters["stats"]["unique_graphs"] == graphs  # the warm-up compiled every row count a batch runs at
        assert decoder.sampler.compiled is not None and decoder.sampler.error is None
        np.testing.assert_array_equal(
            single.rollout(batch[0].context, batch[0].actions, 3, sampled, batch[0].seed), alone(model, batch[0], sampled))
        assert single.core.ops.compile_error is None and single.core.compiled and single.sampler.error is None
    torch._dynamo.reset()


def test_a_step_sampler_that_cannot_compile_samples_eagerly_and_says_why(model, monkeypatch, caplog):
    from terra_cli.backends import device_sampling

    def no_compiler(fn, **options):
        def fails(*args):
            raise RuntimeError("no C++ compiler here")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    sampler = device_sampling.StepSampler(compiled=True)
    logits, noise = torch.randn(3, VOCAB + 1), torch.empty(3, VOCAB).exponential_()
    sampling = Sampling(temperature=0.7, top_k=5)
    want = device_sampling.race_codes(logits, noise, model.layout, sampling)
    with caplog.at_level("WARNING", logger="terra.single_stream"):
        assert torch.equal(sampler(logits, noise, model.layout, sampling), want)
        assert torch.equal(sampler(logits, noise, model.layout, sampling), want)
    assert "no C++ compiler here" in sampler.error
    warned = [r.getMessage() for r in caplog.records if r.name == "terra.single_stream"]
    assert len(warned) == 1 and "StepSampler could not run compiled" in warned[0] and "no C++ compiler here" in warned[0]
    monkeypatch.setenv(device_sampling.SAMPLER_ENV, "eager")  # the lab switch: no compile at all
    assert device_sampling.StepSampler(compiled=True).compiled is None
