"""terra's paged attention kernel as a vLLM attention backend (`attention_config={"backend": "CUSTOM"}`).

The plugin registers `TerraAttentionBackend` under vLLM's CUSTOM slot; the engine asks for it when
`--attention terra` (or `auto` on a Hopper GPU with an fp8 KV cache) is chosen. It is vLLM's
FlashAttention backend with the attention call replaced; the KV cache keeps FlashAttention's
layout and write path, so nothing else in vLLM changes.

- A step of up to `unified_tokens` query tokens (every step vLLM captures in a CUDA graph: all
  decodes, and decodes beside a prompt's uncached tail) runs wholly in `kernels.paged_attention`:
  decodes one program per sequence and split, prompt rows a few tokens per program.
- A larger step (a long prompt being prefilled, run eagerly) sends its prompt rows to
  FlashAttention-3, whose cost grows with the prompt once, and its decodes to the kernel.

So every step can be a FULL CUDA graph, as with FlashAttention-3 alone. Nothing here falls back
silently: a configuration the kernel does not cover is refused when the engine is built, naming
the reason (vLLM prints it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from terra_cli.kernels.paged_attention import (
    PrefillRows,
    make_workspace,
    paged_attention,
    prefill_rows,
    split_batch_attention,
)

FP8_MAX = 448.0  # float8_e4m3fn
# Steps up to this many query tokens run wholly in terra's kernel (at least every step vLLM
# captures in a graph); prompt rows there cost a cache read per CHUNK tokens, fine for a few hundred.
UNIFIED_TOKENS = 512


@dataclass
class TerraAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    sm_count: int
    workspace: tuple[torch.Tensor, ...]
    prefill: PrefillRows | None  # a large prompt step: the rows FlashAttention-3 runs
    use_cascade: bool = False


class TerraAttentionMetadataBuilder(AttentionMetadataBuilder[TerraAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
        num_heads = model_config.get_num_attention_heads(parallel_config)
        num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        # One workspace for every layer (they run one after another on one stream).
        self.workspace = make_workspace(num_heads, num_kv_heads, model_config.get_head_size(), device)
        self.unified_tokens = max(UNIFIED_TOKENS, vllm_config.compilation_config.max_cudagraph_capture_size or 0)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TerraAttentionMetadata:
        m = common_attn_metadata
        num_reqs = m.num_reqs
        prefill = None
        if m.max_query_len > 1 and m.num_actual_tokens > self.unified_tokens:
            prefill = prefill_rows(m.query_start_loc_cpu[: num_reqs + 1], m.seq_lens[:num_reqs],
                                   m.block_table_tensor[:num_reqs], self.device)
        return TerraAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc[: num_reqs + 1], seq_lens=m.seq_lens[:num_reqs],
            block_table=m.block_table_tensor[:num_reqs], slot_mapping=m.slot_mapping, sm_count=self.sm_count,
            workspace=self.workspace, prefill=prefill)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


class TerraAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unsupported = [name for name, present in (
            ("a sliding window", self.sliding_window != (-1, -1)), ("ALiBi", self.alibi_slopes is not None),
            ("a logits soft cap", bool(self.logits_soft_cap)), ("attention sinks", self.sinks is not None),
            ("encoder attention", self.attn_type != AttentionType.DECODER),
            ("KV-cache sharing", self.kv_sharing_target_layer_name is not None)) if present]
        if unsupported:
            raise ValueError(f"terra's attention does not support {', '.join(unsupported)}; "
                             "use --attention vllm")
        # The query stays in bf16 for the decode kernel (more exact than FA3's fp8 query); the
        # prompt rows are quantized here for FA3, as vLLM's layer would have done.
        self.supports_quant_query_input = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by terra's attention")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        md: TerraAttentionMetadata = attn_metadata
        key_cache, value_cache = kv_cache.unbind(1)
        fp8 = self.kv_cache_dtype.startswith("fp8")
        if fp8:
            key_cache = key_cache.view(torch.float8_e4m3fn)
            value_cache = value_cache.view(torch.float8_e4m3fn)

        options = dict(scale=self.scale, k_scale=layer._k_scale, v_scale=layer._v_scale, sm_count=md.sm_count,
                       workspace=md.workspace)
        if md.prefill is None:
            return paged_attention(query, key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   output, **options)

        def prompt_attention(q: torch.Tensor, rows: PrefillRows) -> torch.Tensor:
            return self._flash_attention(layer, q, key_cache, value_cache, rows, md.max_seq_len, output.dtype, fp8)

        return split_batch_attention(query, key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                     output, prefill=md.prefill, prompt_attention=prompt_attention, **options)

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


class TerraAttentionBackend(FlashAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TerraAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TerraAttentionMetadataBuilder

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
