"""terra's paged decode kernel as a vLLM attention backend (`attention_config={"backend": "CUSTOM"}`).

The plugin registers `TerraDecodeBackend` under vLLM's CUSTOM slot; the engine asks for it when
`--attention terra` (or `auto` on a Hopper GPU with an fp8 KV cache) is chosen. It is vLLM's
FlashAttention backend with the decode rows taken over:

- every request whose query is one token (a decode step) goes through
  `kernels.paged_decode` (one program per sequence and split, all KV heads together);
- the other requests of a step (a prompt's uncached tail, a new scenario's context) go through
  FlashAttention-3 as before, gathered into a batch of their own;
- the KV cache keeps FlashAttention's layout and write path, so nothing else in vLLM changes.

CUDA graphs: batches of decodes only are captured whole (FULL_DECODE_ONLY); a step with a prompt
runs eagerly. With hundreds of rollouts in flight that step's launches overlap the GPU's work.
Nothing here falls back silently: a configuration the kernel does not cover is refused when the
engine is built, naming the reason (vLLM prints it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from terra_cli.kernels.paged_decode import (
    DecodePlan,
    PrefillRows,
    decode_plan,
    mixed_batch_attention,
    prefill_rows,
    workspace_rows,
)

FP8_MAX = 448.0  # float8_e4m3fn


@dataclass
class TerraDecodeMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: DecodePlan
    workspace: tuple[torch.Tensor, torch.Tensor]
    prefill: PrefillRows | None  # the requests that are not single-token decodes, if any
    use_cascade: bool = False


class TerraDecodeMetadataBuilder(AttentionMetadataBuilder[TerraDecodeMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
        self.num_heads = model_config.get_num_attention_heads(parallel_config)
        self.num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        self.head_size = model_config.get_head_size()
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        # One workspace for every layer (they run one after another on one stream), sized for
        # the largest batch the engine schedules or captures.
        max_seqs = max(vllm_config.scheduler_config.max_num_seqs,
                       vllm_config.compilation_config.max_cudagraph_capture_size or 0)
        rows = workspace_rows(max_seqs, self.num_kv_heads, self.sm_count) * self.num_heads
        self.workspace = (torch.empty(rows * self.head_size, dtype=torch.float32, device=device),
                          torch.empty(rows, dtype=torch.float32, device=device))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TerraDecodeMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        prefill = None
        if m.max_query_len > 1:
            prefill = prefill_rows(m.query_start_loc_cpu[: num_reqs + 1], m.seq_lens[:num_reqs],
                                   m.block_table_tensor[:num_reqs], self.device)
        return TerraDecodeMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[: num_reqs + 1], seq_lens=m.seq_lens[:num_reqs],
            block_table=m.block_table_tensor[:num_reqs], slot_mapping=m.slot_mapping,
            plan=decode_plan(num_reqs, self.num_kv_heads, self.sm_count), workspace=self.workspace,
            prefill=prefill)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class TerraDecodeImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = [name for name, present in (
            ("a sliding window", self.sliding_window != (-1, -1)), ("ALiBi", self.alibi_slopes is not None),
            ("a logits soft cap", bool(self.logits_soft_cap)), ("attention sinks", self.sinks is not None),
            ("encoder attention", self.attn_type != AttentionType.DECODER),
            ("KV-cache sharing", self.kv_sharing_target_layer_name is not None)) if present]
        if unsupported:
            raise ValueError(f"terra's decode attention does not support {', '.join(unsupported)}; "
                             "use --attention flash")
        # The query stays in bf16 for the decode kernel (more exact than FA3's fp8 query); the
        # prompt rows are quantized here for FA3, as vLLM's layer would have done.
        self.supports_quant_query_input = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by terra's decode attention")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        md: TerraDecodeMetadata = attn_metadata
        key_cache, value_cache = kv_cache.unbind(1)
        fp8 = self.kv_cache_dtype.startswith("fp8")
        if fp8:
            key_cache = key_cache.view(torch.float8_e4m3fn)
            value_cache = value_cache.view(torch.float8_e4m3fn)

        def prompt_attention(q: torch.Tensor, rows: PrefillRows) -> torch.Tensor:
            return self._flash_attention(layer, q, key_cache, value_cache, rows, md.max_seq_len, output.dtype, fp8)

        return mixed_batch_attention(query, key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                     output, prefill=md.prefill, prompt_attention=prompt_attention, scale=self.scale,
                                     k_scale=layer._k_scale, v_scale=layer._v_scale, plan=md.plan,
                                     workspace=md.workspace)

    def _flash_attention(self, layer, q, key_cache, value_cache, rows: PrefillRows, max_seq_len: int, dtype,
                         fp8: bool) -> torch.Tensor:
        """FlashAttention-3 over the prompt rows alone, as vLLM's backend runs it."""
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

        if fp8:
            q = (q.float() / layer._q_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch.empty((q.shape[0], self.num_heads, self.head_size), dtype=dtype, device=q.device)
        descale = (rows.seq_lens.shape[0], self.num_kv_heads)
        flash_attn_varlen_func(
            q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=rows.query_start_loc,
            max_seqlen_q=rows.max_query_len, seqused_k=rows.seq_lens, max_seqlen_k=max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=list(self.sliding_window),
            block_table=rows.block_table, fa_version=self.vllm_flash_attn_version,
            q_descale=layer._q_scale.expand(descale) if fp8 else None,
            k_descale=layer._k_scale.expand(descale), v_descale=layer._v_scale.expand(descale))
        return out


class TerraDecodeBackend(FlashAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TerraDecodeImpl

    @staticmethod
    def get_builder_cls():
        return TerraDecodeMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 16 and head_size & (head_size - 1) == 0 and head_size <= 256

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major == 9  # FA3 runs the prompt rows; the kernel was measured on Hopper

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False
