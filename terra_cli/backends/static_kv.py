"""`modeling_hf`'s decoder run over a static KV cache, so every decode step has fixed shapes.

The weights are the transformers model's own modules (same checkpoint, same strict load); only
the cache and the attention call are terra's: per layer one K and one V tensor preallocated for
`layout.max_positions` positions, written in place at the step's positions (`index_copy_`, which
a CUDA graph can replay) and read up to a fixed key length under a position mask. Positions past
the ones already written hold stale or garbage values; the mask `key <= query position` means no
query ever reads them, which is what lets a speculative step write drafts it may later reject.

Grouped-query attention folds each KV head's query heads into the query length: queries
(1, kv_heads, group * n, d) against keys (1, kv_heads, L, d), so the cache is never repeated.
Decode steps attend with plain matmuls (`attend`); no FlashAttention kernel is used yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from terra_cli.models.modeling_hf import LlamaActionForCausalLM


# Up to this many query rows per KV head, attention runs as two batched matmuls around a softmax:
# the key axis is spread over the whole GPU. SDPA's memory-efficient kernel (the one that takes a
# mask) splits work by query block and head only, which for a decode step is kv_heads blocks, each
# walking up to 14,550 keys alone.
MATMUL_ATTENTION_ROWS = 256


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (1, KV, rows, d) against keys/values (1, KV, L, d) under mask (rows, L) -> (1, KV, rows, d)."""
    if q.shape[2] > MATMUL_ATTENTION_ROWS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = _scores(q[0], keys[0].transpose(-1, -2))[None] * scale
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    # Weights back in the cache's dtype before the second product, as FlashAttention does.
    return torch.matmul(weights.to(values.dtype), values)


_FLOAT_SCORES = {"bmm_out_dtype": None}  # None: not tried yet on this process's GPU


def _scores(q: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """q (KV, rows, d) @ keys_t (KV, d, L) in float32. 16-bit inputs: accumulated and written in
    float32 where torch's bmm takes out_dtype (CUDA), so the scores are not rounded to 16 bits
    before the softmax (FlashAttention keeps them in float32 too); else rounded, then widened.
    The first call runs eagerly (a CUDA graph's warm-up), which is where support is found out."""
    if q.dtype == torch.float32 or not q.is_cuda:
        return torch.bmm(q, keys_t).float()
    if _FLOAT_SCORES["bmm_out_dtype"] is not False:
        try:
            scores = torch.bmm(q, keys_t, out_dtype=torch.float32)
            _FLOAT_SCORES["bmm_out_dtype"] = True
            return scores
        except (RuntimeError, TypeError):
            _FLOAT_SCORES["bmm_out_dtype"] = False
    return torch.bmm(q, keys_t).float()


class StaticKVDecoder:
    """One rollout's cache plus a forward over `model`'s weights.

    `forward_codes` takes image codes only (every decode step); `forward_with_actions` takes a
    sequence with action slots (the prompt, and the step that closes a frame).
    """

    def __init__(self, model: LlamaActionForCausalLM):
        config = model.config
        self.model = model
        self.layout = model.layout
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_positions = self.layout.max_positions
        shape = (1, self.kv_heads, self.max_positions, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.key_positions = torch.arange(self.max_positions, device=self.device)

    def embed_codes(self, codes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(n,) codes at (n,) positions -> (1, n, H); the same sum as `model.embed` for code rows."""
        embeds = self.model.model.embed_tokens(codes[None])
        return embeds + self.model.pos_embedding_spatio_temporal(positions[None]).to(embeds.dtype)

    def forward_codes(self, codes: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """Logits (n, V) for codes (n,) at positions (n,) on the device; keys read: [0, key_length)."""
        return self.run(self.embed_codes(codes, positions), positions, key_length)

    def forward_with_actions(self, ids: torch.Tensor, positions: torch.Tensor, waypoints: torch.Tensor,
                             logits_to_keep: int = 1) -> torch.Tensor:
        """ids (n,) with action slots holding the placeholder, waypoints (slots, 3) -> last logits."""
        embeds = self.model.embed(ids[None], waypoints[None], positions[None])
        key_length = min(self.max_positions, int(positions[-1]) + 1)
        hidden = self.hidden(embeds, positions, key_length)
        return self.model.lm_head(hidden[-logits_to_keep:])

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        return self.model.lm_head(self.hidden(embeds, positions, key_length))

    def hidden(self, embeds: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """Final hidden states (n, H): every layer writes its K/V at `positions` first, then attends."""
        # Positions past the table only come from draft rows that run off the last frame; their
        # outputs are never used, and clamping keeps their writes inside the cache.
        positions = positions.clamp(max=self.max_positions - 1)
        cos, sin = self.model.model.rotary_emb(embeds, positions[None])
        visible = self.key_positions[None, :key_length] <= positions[:, None]  # (n, L)
        group = self.heads // self.kv_heads
        mask = visible.repeat(group, 1)  # query rows are (group, n) flattened per KV head
        x = embeds
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            n = h.shape[1]
            q = attention.q_proj(h).view(1, n, self.heads, self.head_dim).transpose(1, 2)
            k = attention.k_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attention.v_proj(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)
            q = q.reshape(1, self.kv_heads, group * n, self.head_dim)
            out = attend(q, keys[:, :, :key_length], values[:, :, :key_length], mask, attention.scaling)
            out = out.view(1, self.kv_heads, group, n, self.head_dim).permute(0, 3, 1, 2, 4).reshape(1, n, -1)
            x = x + attention.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.model.norm(x)[0]

    def frame_key_length(self, frame: int, spill: int = 0) -> int:
        """Keys every step of frame `frame` reads: up to the frame's end (plus `spill` positions a
        draft window may run past its last code), so that all steps of a frame have one shape
        (one CUDA graph per frame, not per step) and early frames read less of the cache."""
        return min(self.max_positions, (frame + 1) * self.layout.frame_stride + spill)
