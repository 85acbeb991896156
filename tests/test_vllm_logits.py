"""Terra's vLLM model computes a step's logits weight-major at 2-32 rollouts on CUDA
(`modeling_vllm.weight_major_logits`, `runtime.VLLM_LOGITS_ENV`): the head's own logits with its padding rows
dropped, taken only where it was measured faster, and a switch back to vLLM's head."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402

from terra_cli import runtime  # noqa: E402
from terra_cli.errors import InputError  # noqa: E402
from terra_cli.models.modeling_vllm import LlamaActionForCausalLM, weight_major_logits  # noqa: E402

VOCAB, PADDED, HIDDEN = 513, 576, 64  # 512 codes and the special id; ParallelLMHead pads its rows to 64s


class CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA, to reach the CUDA branch of `compute_logits` here."""

    @property
    def is_cuda(self):
        return True


def head_weight():
    return torch.randn(PADDED, HIDDEN, generator=torch.Generator().manual_seed(0))


def test_weight_major_logits_are_the_heads_logits_without_its_padding():
    weight = head_weight()
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = weight_major_logits(weight, hidden, VOCAB)
    assert got.shape == (8, VOCAB) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(hidden, weight)[:, :VOCAB])


@pytest.mark.parametrize("rows, cuda, switch, weight_major", [
    (8, True, True, True), (2, True, True, True), (32, True, True, True),
    (1, True, True, False),  # one row is a GEMV either way
    (33, True, True, False),  # past the rows measured
    (8, False, True, False),  # a CPU keeps vLLM's head
    (8, True, False, False),  # TERRA_VLLM_LOGITS=linear
])
def test_compute_logits_goes_weight_major_only_where_it_was_measured_faster(rows, cuda, switch, weight_major):
    weight = head_weight()
    processed = []

    def vllm_head(lm_head, hidden):
        processed.append(hidden.shape[0])
        return F.linear(hidden, lm_head.weight)[:, :VOCAB]

    model = SimpleNamespace(weight_major_logits=switch, logits_processor=vllm_head, config=SimpleNamespace(vocab_size=VOCAB),
                            lm_head=SimpleNamespace(weight=weight, quant_method=UnquantizedEmbeddingMethod()),
                            layout=SimpleNamespace(image_vocab_size=VOCAB - 1))
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(2))
    if cuda:
        hidden = hidden.as_subclass(CudaLike)
    logits = LlamaActionForCausalLM.compute_logits(model, hidden)
    assert processed == ([] if weight_major else [rows])
    assert torch.isinf(logits[:, -1]).all()  # the special id is never drawn, either way
    torch.testing.assert_close(torch.Tensor(logits[:, :-1]), F.linear(hidden.as_subclass(torch.Tensor), weight)[:, :VOCAB - 1])


def test_the_switch_is_read_and_checked():
    assert runtime.vllm_weight_major_logits({})
    assert not runtime.vllm_weight_major_logits({runtime.VLLM_LOGITS_ENV: " Linear"})
    with pytest.raises(InputError, match="TERRA_VLLM_LOGITS='fast'"):
        runtime.vllm_weight_major_logits({runtime.VLLM_LOGITS_ENV: "fast"})
