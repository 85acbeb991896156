"""`--kv-cache-dtype fp8` on the single-stream backend (backends/static_kv.py, `fp8_cache`) on the CPU: keys
and values kept in float8 e4m3 with a scale of 1 (values past its largest finite one saturate), the
queries rounded to it as FlashAttention-3 reads them; an approximation, opt-in. The row batch keeps
its decoder's cache dtype, so each rollout of a batch still gets the codes it gets alone."""

import numpy as np
import pytest
import torch

from terra_cli.backends import load_backend
from terra_cli.backends.base import Sampling
from terra_cli.backends.layer_ops import FP8_KV, to_cache
from terra_cli.backends.row_batch import RowBatchDecoder, RowWork
from terra_cli.backends.single_stream import SingleStreamBackend, SingleStreamDecoder
from terra_cli.errors import InputError
from terra_cli.models.modeling_hf import load_model
from terra_cli.models.testing import tiny_config, write_tiny_checkpoint
from terra_cli.pipeline.engine_request import check_backend_options, engine_options

CODES, VOCAB, FRAMES = 40, 64, 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(image_vocab=VOCAB, image_tokens=CODES, max_frames=FRAMES)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fp8_cache"), config, seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, device="cpu", dtype=torch.float32)


def work(seed: int, context_frames: int, num_frames: int) -> RowWork:
    rng = np.random.default_rng(seed)
    return RowWork(rng.integers(0, VOCAB, size=(context_frames, CODES)),
                   rng.normal(scale=2.0, size=(num_frames - 1, 6, 3)).astype(np.float32), num_frames, seed=40 + seed)


def rollout(decoder: SingleStreamDecoder, w: RowWork, sampling: Sampling) -> np.ndarray:
    return decoder.rollout(w.context, w.actions, w.num_frames, sampling, w.seed)


def test_the_cache_holds_the_keys_rounded_to_fp8(model):
    """Layer 0's keys and values come from the same inputs in both decoders: the fp8 cache holds the
    model-dtype cache's values rounded to e4m3, position for position."""
    w = work(0, 2, 3)
    plain, fp8 = SingleStreamDecoder(model), SingleStreamDecoder(model, fp8_cache=True)
    rollout(plain, w, Sampling(temperature=0))
    rollout(fp8, w, Sampling(temperature=0))
    assert fp8.core.keys[0].dtype == FP8_KV and plain.core.keys[0].dtype == torch.float32
    prompt = 2 * model.layout.frame_stride  # the context's positions, written by the prompt alone
    for ours, theirs in ((fp8.core.keys[0], plain.core.keys[0]), (fp8.core.values[0], plain.core.values[0])):
        written = ours[:, :, :prompt].float()
        assert torch.equal(written, to_cache(theirs[:, :, :prompt], FP8_KV).float())
        assert written.abs().sum() > 0


def test_values_past_fp8s_range_saturate():
    rounded = to_cache(torch.tensor([1000.0, -1e6, 0.3, 448.0]), FP8_KV).float()
    assert rounded.tolist()[:2] == [448.0, -448.0] and not rounded.isnan().any()
    assert rounded[2] == torch.tensor(0.3).to(FP8_KV).float()


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), Sampling(temperature=0.9, top_k=20)])
def test_each_rollout_of_a_batch_gets_its_codes_alone_on_an_fp8_cache(model, sampling):
    single = SingleStreamDecoder(model, fp8_cache=True)
    batch = [work(1, 2, 4), work(2, 1, 3), work(3, 3, 5)]
    decoder = RowBatchDecoder(single.core, rows=4)
    assert decoder.core.kv_dtype == FP8_KV  # from the decoder whose layers it shares
    for w, frames in zip(batch, decoder.rollouts(batch, sampling)):
        np.testing.assert_array_equal(frames, rollout(SingleStreamDecoder(model, fp8_cache=True), w, sampling))


def test_an_fp8_cache_approximates_the_models_logits(model):
    """A prompt's next-code logits (attention over the keys it has just written) on an fp8 cache are close to
    the model-dtype cache's, the same code first: an approximation, not the same numbers."""
    from terra_cli.backends.static_kv import StaticKVDecoder

    w = work(4, 3, 4)
    context, waypoints = torch.from_numpy(w.context), torch.from_numpy(w.actions)
    with torch.inference_mode():
        plain = StaticKVDecoder(model).forward_prompt(context, waypoints)[0]
        fp8 = StaticKVDecoder(model, fp8_cache=True).forward_prompt(context, waypoints)[0]
    assert not torch.equal(plain, fp8)
    assert torch.nn.functional.cosine_similarity(plain, fp8, dim=0) > 0.99
    assert plain[:VOCAB].argmax() == fp8[:VOCAB].argmax()


def test_the_option_reaches_the_backend_and_vllms_e5m2_is_refused(checkpoint):
    options = engine_options(kv_cache_dtype="fp8")
    check_backend_options("single-stream", options, "cpu")
    backend = load_backend("single-stream", checkpoint, device="cpu", dtype="float32", **options)
    try:
        assert backend.kv_cache_dtype == "fp8" and backend.decoder.core.kv_dtype == FP8_KV
        assert backend.row_batch(2).core.kv_dtype == FP8_KV
    finally:
        backend.close()
    with pytest.raises(InputError, match="fp8_e5m2 is vLLM's"):
        check_backend_options("single-stream", engine_options(kv_cache_dtype="fp8_e5m2"), "cpu")
    with pytest.raises(InputError, match="--kv-cache-dtype: vLLM engine option"):
        check_backend_options("hf", options, "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        SingleStreamBackend(checkpoint, device="cpu", kv_cache_dtype="int8")


def flash_attention_3_reading_fp8(q, k, v, **kwargs):
    """FlashAttention-3's contract beside an fp8 cache: fp8 queries, keys and values in, the output widened
    (the real kernel gives bfloat16; the CPU model's float32 here)."""
    from test_single_stream import paged_varlen_attention

    assert q.dtype == k.dtype == v.dtype == FP8_KV
    return paged_varlen_attention(q.float(), k.float(), v.float(), **kwargs)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_fp8_cache_written_inside_the_layer_function_holds_what_the_separate_writes_hold(model, monkeypatch,
                                                                                             compiled):
    """On FlashAttention-3's layout an fp8 cache's writes and the queries' rounding run inside the layer
    function that makes k, v and q (compiled: in its kernels), as a model-dtype cache's writes do: the
    cache, its queries and the codes are those of the writes apart (TERRA_SINGLE_STREAM_CACHE_WRITE=separate)."""
    from test_single_stream import fake_flash_attention

    from terra_cli.backends import layer_ops
    from terra_cli.backends.static_kv import StaticKVDecoder

    fake_flash_attention(monkeypatch, kernel=flash_attention_3_reading_fp8)
    w = work(5, 2, 4)

    def run(cache_write: str):
        monkeypatch.setenv(layer_ops.CACHE_WRITE_ENV, cache_write)
        decoder = SingleStreamDecoder(model, fp8_cache=True)
        decoder.core = StaticKVDecoder(model, compile_layers=compiled, fp8_cache=True)
        if not compiled:  # the fused functions eagerly (what a CPU without compiling runs)
            decoder.core.ops = layer_ops.LayerOps(model, compile_layers=False, fuse_projections=True)
        steps = decoder.core.ops.for_rows(True)
        written = []
        inputs_written = steps.attention_inputs_written
        steps.attention_inputs_written = lambda *args: written.append(inputs_written(*args)) or written[-1]
        codes = rollout(decoder, w, Sampling(temperature=0))
        assert not compiled or decoder.core.compiled, decoder.core.ops.compile_error
        return decoder.core, codes, written

    inside, inside_codes, queries = run("fused")
    apart, apart_codes, none = run("separate")
    assert inside.fused_cache_write and not apart.fused_cache_write and not none
    # every decode step's layers wrote k and v and handed back q in fp8, as FlashAttention-3 reads it
    assert len(queries) > 0 and len(queries) % model.config.num_hidden_layers == 0
    assert all(q.dtype == FP8_KV for q in queries)
    np.testing.assert_array_equal(inside_codes, apart_codes)
    for ours, theirs in zip(inside.keys + inside.values, apart.keys + apart.values):
        assert ours.dtype == theirs.dtype == FP8_KV
        assert ours.float().abs().sum() > 0
        if compiled:  # Inductor's float32 sums may round a key's last bit the other way, rarely
            assert (ours.float() == theirs.float()).float().mean() > 0.99
        else:
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
