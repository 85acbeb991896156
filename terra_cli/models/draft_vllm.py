"""The previous-frame draft: a weight-free speculator that proposes, for each next image token,
the token at the same grid position one frame earlier.

Video repeats where the picture does not move, and Terra's layout puts that token exactly one
frame stride (576 codes + 6 action slots = 582 positions) back. vLLM verifies the proposals with
its standard rejection sampling, so the target's output distribution is unchanged (and greedy
tokens are identical); the draft only decides how many tokens one engine step can keep.

How it runs inside vLLM without forking it: vLLM's EAGLE hook accepts any registered model class
as the draft, gives it a paged KV cache of its own layer, and replays it inside a CUDA graph. The
lookup is one attention layer built so that attention is an exact table read:
- the key of a position is its index in binary (+1/-1 per bit), the query of position p is the
  binary of the position it must read, scaled: the one exact match outscores every other key by
  at least 2 * QUERY_SCALE, so softmax puts all its weight there;
- the value of a position is its input token id in binary (0/1 per bit), so the attention output
  is that token id, bit for bit.
EAGLE feeds the draft token t+1 at position t and asks it for token t+2, so position p reads the
value stored at p + 1 - frame_stride. The layer has the target's KV-head count and head size,
so it shares the target's KV-cache group and block tables, and it needs no weights: the
checkpoint named as the draft model is the target's own, and nothing is read from it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from terra_cli.errors import TerraError
from terra_cli.models.config import ARCH_V1, ARCH_V2, LlamaActionConfig

# The exact match leads every other key by 2 * QUERY_SCALE in the attention logits: exp(-64)
# per competing key leaves the read exact over any context Terra can hold.
QUERY_SCALE = 32.0

# vLLM's EAGLE method renames the draft checkpoint's architecture X to "EagleX".
DRAFT_ARCHITECTURES = tuple(f"Eagle{arch}" for arch in (ARCH_V1, ARCH_V2))


def target_config(vllm_config: VllmConfig) -> LlamaActionConfig:
    """The target Terra model's config (the draft's own is vLLM's EAGLE wrapper around it)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    target = getattr(speculative, "target_model_config", None)
    return (target or vllm_config.model_config).hf_config


def lookup_dimensions(config: LlamaActionConfig) -> tuple[int, int, int]:
    """(head_dim, position_bits, token_bits) of the lookup layer; raises TerraError when the
    target's heads are too small to hold the binary codes."""
    layout = config.layout
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    position_bits = (layout.max_positions + layout.frame_stride).bit_length() + 1
    # Well above any action row id in use, so an action slot's id never aliases an image code.
    token_bits = (layout.action_placeholder_id + (1 << 20)).bit_length()
    needed = max(position_bits, token_bits)
    if needed > head_dim:
        raise TerraError(
            f"--draft previous-frame needs attention heads of at least {needed} dimensions for this model's "
            f"positions and vocabulary; its heads have {head_dim}: run without --draft"
        )
    return head_dim, position_bits, token_bits


def bits(values: torch.Tensor, count: int) -> torch.Tensor:
    """(N,) integers -> (N, count) of their lowest `count` bits, least significant first."""
    shifts = torch.arange(count, device=values.device)
    return (values.long().unsqueeze(-1) >> shifts) & 1


class PreviousFrameLookup(nn.Module):
    """One attention layer that returns, for position p, the input token stored at
    p - read_back (see the module docstring)."""

    def __init__(self, config: LlamaActionConfig, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.head_dim, self.position_bits, self.token_bits = lookup_dimensions(config)
        # The target's head counts, not just its KV-cache shape: the layer shares the target's
        # attention metadata, and FlashAttention 3 plans its work for the target's query heads
        # (fewer query heads here read out of bounds on long contexts).
        self.query_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.read_back = config.layout.frame_stride - 1
        self.attn = Attention(
            self.query_heads,
            self.head_dim,
            scale=1.0,
            num_kv_heads=self.kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=None,
            prefix=f"{prefix}.attn",
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """-> (N, token_bits): the bits of the token read for each position (0/1 values)."""
        n = positions.shape[0]
        # Padded CUDA-graph slots may hold stale positions; any value is safe here.
        positions = positions.clamp(min=0)
        key = torch.zeros(n, self.kv_heads, self.head_dim, dtype=dtype, device=positions.device)
        value = torch.zeros_like(key)
        query = torch.zeros(n, self.query_heads, self.head_dim, dtype=dtype, device=positions.device)
        key[:, :, : self.position_bits] = (2 * bits(positions, self.position_bits) - 1).to(dtype).unsqueeze(1)
        # Before the first frame there is nothing to read: the query then matches no key, and
        # the proposal is noise that verification rejects.
        wanted = positions - self.read_back
        query[:, :, : self.position_bits] = (
            QUERY_SCALE * (2 * bits(wanted, self.position_bits) - 1)
        ).to(dtype).unsqueeze(1)
        value[:, :, : self.token_bits] = bits(input_ids, self.token_bits).to(dtype).unsqueeze(1)
        out = self.attn(query.view(n, -1), key.view(n, -1), value.view(n, -1))
        return out.view(n, self.query_heads, self.head_dim)[:, 0, : self.token_bits]


class PreviousFrameDraft(nn.Module):
    """What vLLM loads as the EAGLE draft of a Terra checkpoint."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = target_config(vllm_config)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.image_vocab_size = config.layout.image_vocab_size
        # vLLM orders KV-cache layers by the one integer in each name: the draft's layer comes
        # after the target's.
        name = f"previous_frame.{config.num_hidden_layers}"
        self.model = PreviousFrameLookup(config, vllm_config, prefix=f"{prefix}.{name}" if prefix else name)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's model interface asks for it (without it vLLM warns and does not count this as
        one of its models). The draft reads token ids, not embeddings: a token's row here holds
        its bits, as the hidden states forward returns do."""
        token_bits = self.model.token_bits
        out = torch.zeros(input_ids.shape[0], self.hidden_size, device=input_ids.device)
        out[:, :token_bits] = bits(input_ids, token_bits).float()
        return out

    def forward(self, input_ids, positions, hidden_states=None, inputs_embeds=None, **kwargs):
        read = self.model(input_ids, positions, dtype=hidden_states.dtype if hidden_states is not None else torch.float32)
        # The hidden state carries the token's bits; compute_logits turns them into the proposal.
        out = torch.zeros(read.shape[0], self.hidden_size, dtype=read.dtype, device=read.device)
        out[:, : read.shape[1]] = read
        return out, out

    def proposed_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        token_bits = self.model.token_bits
        on = (hidden_states[:, :token_bits].float() > 0.5).long()
        ids = (on << torch.arange(token_bits, device=on.device)).sum(-1)
        return ids.clamp(0, self.image_vocab_size - 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A one-hot draft distribution: all its mass on the proposed token."""
        ids = self.proposed_tokens(hidden_states)
        logits = torch.full((ids.shape[0], self.vocab_size), -1e9, dtype=torch.float32, device=ids.device)
        logits.scatter_(1, ids.unsqueeze(1), 0.0)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The checkpoint is the target's: nothing in it belongs to the draft, and the iterator
        # is left unread so no tensor is loaded twice.
        return set()
