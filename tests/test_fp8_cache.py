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
