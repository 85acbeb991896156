"""`modeling_hf`'s decoder run over a static KV cache, so every decode step has fixed shapes.

The weights are the transformers model's own modules (same checkpoint, same strict load); only
the cache and the attention call are terra's: per layer one K and one V tensor preallocated for
`layout.max_positions` positions (plus `SPARE_POSITIONS` for draft rows that run past the last
frame), written in place at the step's positions (`index_copy_`, which a CUDA graph can replay).
Positions past the ones already written hold stale or garbage values; causal attention (`key <=
query position`) means no query ever reads them, which is what lets a speculative step write
drafts it may later reject.

Where a decode step's time went (H100, Terra size, 4.1 ms a step with CUDA graphs against ~1.5 ms
of GEMMs and attention): not the keys read (every step of a frame reads up to the frame's end,
at most one frame more than needed), but the number of kernels. The transformers modules run
RMSNorm as 6 kernels (float32 upcast, pow, mean, rsqrt, two multiplies), rotary as ~10, attention
as 6, the MLP's activation as 2: about 45 kernels a layer, ~1,000 a step, each a few microseconds
even inside a CUDA graph. So (`layer_ops.py`) the layer's elementwise work is written as two plain
functions, compiled with `torch.compile` on CUDA (Inductor fuses them into a few kernels around
the GEMMs), and attention on CUDA is FlashAttention's paged varlen kernel (vLLM 0.25's build has
no `flash_attn_with_kvcache`) when it is importable: one kernel that reads exactly the keys so far
(`seqused_k` lives on the device, so one CUDA graph serves every step of every frame). On a CPU,
and where neither is available, the same functions run eagerly and attention is `attend` below: the CPU's codes do not change.

Grouped-query attention folds each KV head's query heads into the query length: queries
(1, kv_heads, group * n, d) against keys (1, kv_heads, L, d), so the cache is never repeated.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from terra_cli.backends.flash_cache import FlashCacheAttention, flash_page, flash_planner, flash_varlen_kernel
from terra_cli.backends.layer_ops import FP8_KV, LayerOps, cache_write, to_cache, write_cache
from terra_cli.backends.step_prologue import StepPrologue, rotary_rows
from terra_cli.errors import InputError
from terra_cli.kernels import few_rows_matmul as few_rows
from terra_cli.models.modeling_hf import LlamaActionForCausalLM
from terra_cli.runtime import choice_switch


# Up to this many query rows per KV head, attention runs as two batched matmuls around a softmax:
# the key axis is spread over the whole GPU. SDPA's memory-efficient kernel (the one that takes a
# mask) splits work by query block and head only, which for a decode step is kv_heads blocks, each
# walking up to 14,550 keys alone.
MATMUL_ATTENTION_ROWS = 256
# Rows past the last position a draft window may write to (jacobi.MAX_DRAFT_TOKENS + 1): their
# outputs are never used, and writing them there keeps them off every real position.
SPARE_POSITIONS = 33
# A Jacobi step's logits come from a few rows (K + 1). On the H100 cuBLAS runs 9 rows of Terra's
# lm_head (262,144 x 2,048), and 16 rows as well (padding them was tried and measured, 2026-11-27),
# as one sm75 CUTLASS kernel at about 1 ms a step, 2.5x the one-row GEMV (benchmarks/README.md).
# TERRA_SINGLE_STREAM_LOGITS=weight-major computes them as W @ h.T, one tall GEMM over the
# vocabulary, which cuBLAS tiles differently; =few-rows runs terra's Triton kernel that streams the
# weight once for up to 16 rows (kernels/few_rows_matmul.py), on every decode step's rows, the
# plain step's one row too. `few-rows` is the default on CUDA: on H200s it took 3.5% (2026-11-27) and
# 4.4% (2026-11-29) off a plain step and 25% off a K=8 Jacobi step, with the same codes
# (benchmarks/README.md); elsewhere `linear`. =few-rows-fp8: the kernel over an fp8 copy of lm_head
# (one scale per vocabulary row, half its 1.07 GB a step), an approximation of the weights: what
# `--quantization fp8` asks for (`fp8_weights`), never a default.
LOGITS_ENV = "TERRA_SINGLE_STREAM_LOGITS"
# A step's rotary cos and sin are rows of a table the model's own rotary module makes once over every position:
# its ops are elementwise, so row p holds the bits a step at position p would compute, and a decode step's CUDA
# graph gathers two rows instead of running ~9 small kernels (cast, product, concatenation, cos, sin, two
# scalings, two casts). TERRA_SINGLE_STREAM_ROTARY=step computes them at every step, as before (to compare).
ROTARY_ENV = "TERRA_SINGLE_STREAM_ROTARY"
FEW_ROWS = 16  # bf16 logits by the few-rows kernel up to here, as measured (K + 1 rows); above, weight-major
LOGITS_LAYOUTS = ("linear", "weight-major", "few-rows", "few-rows-fp8")


def default_logits_layout(device: torch.device, fp8_weights: bool = False) -> str:
    if fp8_weights:
        return "few-rows-fp8"
    return "few-rows" if device.type == "cuda" else "linear"


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (1, KV, rows, d) against keys/values (1, KV, L, d) under mask (rows, L) -> (1, KV, rows, d)."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # (an fp8 cache's, read in the query's dtype)
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



def host_to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A few host numbers on `device` without waiting for its queued work. `torch.tensor(..., device=cuda)`
    synchronizes the stream: the decode steps queued ahead drain and the GPU idles while the host goes on
    (each row joining a row batch made several such waits). From pinned memory the copy is queued instead."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rotary_table(model: LlamaActionForCausalLM, positions: int, dtype: torch.dtype):
    """(cos, sin), each (1, positions, head_dim) in `dtype`: the model's rotary module at positions 0..positions-1;
    None where ROTARY_ENV asks for it at every step, or where its frequencies may follow the positions seen
    (a RoPE type other than Llama's default, such as `dynamic`)."""
    if (choice_switch(ROTARY_ENV, ("table", "step"), "table (the default) or step") or "table") == "step":
        return None
    if getattr(model.model.rotary_emb, "rope_type", "default") != "default":
        return None
    device = model.lm_head.weight.device
    with torch.no_grad():
        return model.model.rotary_emb(torch.empty(0, dtype=dtype, device=device),
                                      torch.arange(positions, device=device)[None])


def weight_major_logits(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (rows, H) @ weight (V, H).T computed as weight @ hidden.T, which cuBLAS tiles over the
    vocabulary: the same sums, faster for a few rows (`LOGITS_ENV`). Inside vLLM it gained nothing at
    1-32 sessions (benchmarks/README.md, 2026-11-29 lease 8), so vLLM keeps its own head."""
    return (weight @ hidden.t()).t().contiguous()

class StaticKVDecoder:
    """One rollout's cache (or `rows` rollouts', a region each) plus a forward over `model`'s weights.

    `forward_codes` takes image codes only (every decode step); `forward_with_actions` takes a
    sequence with action slots (the prompt, and the step that closes a frame); both work on one
    row's region (`row`). `forward_rows` is one decode step of the first S rows, a code each at
    the row's own position (`row_batch.RowBatchDecoder`). `attention`: "flash" (FlashAttention's
    paged kernel) or "torch"; `compiled`: whether the layers' elementwise work runs through
    torch.compile. `ops_from`: another decoder of the same model whose layer functions (and their
    weight copies, compiled code) this one shares.
    """

    def __init__(self, model: LlamaActionForCausalLM, *, compile_layers: bool | None = None, fp8_weights: bool = False,
                 rows: int = 1, ops_from: "StaticKVDecoder | None" = None, fp8_cache: bool = False):
        config = model.config
        self.model = model
        self.layout = model.layout
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        # `fp8_cache`: keys and values kept in fp8 (half the bytes attention reads a step; an approximation,
        # opt-in), the queries rounded to fp8 too, as FlashAttention-3 reads them (and as vLLM's fp8 cache does)
        fp8_cache = ops_from.kv_dtype == FP8_KV if ops_from is not None else fp8_cache
        self.kv_dtype = FP8_KV if fp8_cache else self.dtype
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.max_positions = self.layout.max_positions
        self.cache_positions = self.max_positions + SPARE_POSITIONS
        flash = flash_varlen_kernel(self.device, self.dtype)
        page = flash_page() if flash is not None else 1
        self.cache_positions = -(-self.cache_positions // page) * page
        if fp8_cache and flash is not None and flash[1] != 3:
            raise InputError("an fp8 KV cache on the single-stream backend needs FlashAttention-3 (a Hopper GPU); "
                             "this GPU runs FlashAttention-2: keep the cache in the model's dtype")
        self.flash = (FlashCacheAttention(*flash, self.cache_positions, self.device, flash_planner(flash[1]), rows, page)
                      if flash is not None else None)
        self.rows = rows
        self.row_offsets = torch.arange(rows, device=self.device) * self.cache_positions
        self.attention = "flash" if self.flash is not None else "torch"
        # FlashAttention reads (1, positions, KV, d); the torch path keeps (1, KV, positions, d),
        # each KV head's keys contiguous for its matmuls.
        self.position_dim = 1 if self.flash is not None else 2
        positions = rows * self.cache_positions
        shape = ((1, positions, self.kv_heads, self.head_dim) if self.flash is not None
                 else (1, self.kv_heads, positions, self.head_dim))
        self.keys = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.layers]
        self.key_positions = torch.arange(self.cache_positions, device=self.device)
        self.placeholders = torch.full((self.layout.action_tokens,), self.layout.action_placeholder_id,
                                       dtype=torch.long, device=self.device)
        if fp8_weights and not few_rows.runs_on(self.device):
            raise ValueError(f"fp8 weights run through terra's Triton kernel, on CUDA; the model is on {self.device}")
        self.fused_cache_write = cache_write() == "fused"
        if ops_from is not None:
            self.ops, self.logits_layout, self.head_fp8 = ops_from.ops, ops_from.logits_layout, ops_from.head_fp8
            self.rotary, self.prologue = ops_from.rotary, ops_from.prologue
            return
        self.rotary = rotary_table(model, self.max_positions, self.dtype)
        compile_layers = self.device.type == "cuda" if compile_layers is None else compile_layers
        self.ops = LayerOps(model, compile_layers=compile_layers, projections="few-rows-fp8" if fp8_weights else None)
        self.prologue = StepPrologue(model, self.rotary, self.max_positions - 1, compiled=self.ops.compiled)
        self.logits_layout = (choice_switch(LOGITS_ENV, LOGITS_LAYOUTS, ", ".join(LOGITS_LAYOUTS))
                              or default_logits_layout(self.device, fp8_weights))
        self.head_fp8 = few_rows.quantize_rows_fp8(model.lm_head.weight) \
            if self.logits_layout == "few-rows-fp8" and few_rows.runs_on(self.device) else None

    @property
    def compiled(self) -> bool:
        return self.ops.compiled

    def forward_codes(self, codes: torch.Tensor, positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """Logits (n, V) for codes (n,) at positions (n,) on the device; keys read: [0, key_length)."""
        embeds, rotary = self.prologue(codes, positions)
        return self.logits(self.hidden(embeds, positions, key_length, decode=True, rotary=rotary))

    def forward_with_actions(self, ids: torch.Tensor, positions: torch.Tensor, waypoints: torch.Tensor,
                             logits_to_keep: int = 1, row: int = 0) -> torch.Tensor:
        """ids (n,) with action slots holding the placeholder, waypoints (slots, 3) -> last logits."""
        embeds = self.model.embed(ids[None], waypoints[None], positions[None])
        key_length = min(self.max_positions, int(positions[-1]) + 1)
        hidden = self.hidden(embeds, positions, key_length, row=row)
        return self.model.lm_head(hidden[-logits_to_keep:])

    def forward_prompt(self, context: torch.Tensor, waypoints: torch.Tensor, row: int = 0) -> torch.Tensor:
        """A round's prompt into row `row`: context (K, T) codes, each frame followed by its action slots
        with waypoints (>= K, A, 3) -> the logits of the first generated frame's code 0."""
        known = context.shape[0]
        prompt = torch.cat([context, self.placeholders.expand(known, -1)], dim=1).reshape(-1)
        return self.forward_with_actions(prompt, torch.arange(prompt.shape[0], device=self.device),
                                         waypoints[:known].reshape(-1, 3), row=row)

    def forward_frame_end(self, last_code: torch.Tensor, frame: int, waypoints: torch.Tensor, row: int = 0) -> torch.Tensor:
        """The step that closes frame `frame` of row `row`: its last code (1,) and its action slots with
        waypoints (A, 3) -> the logits of the next frame's code 0."""
        base, codes = frame * self.layout.frame_stride, self.layout.image_tokens
        return self.forward_with_actions(torch.cat([last_code, self.placeholders]),
                                         torch.arange(base + codes - 1, base + self.layout.frame_stride, device=self.device),
                                         waypoints, row=row)

    def forward_frame_ends(self, last_codes: torch.Tensor, frames: list[int], waypoints: torch.Tensor,
                           rows: list[int]) -> torch.Tensor:
        """`forward_frame_end` of several rows in one forward: row rows[i] closes frame frames[i] with its
        last code last_codes[i] and action slots waypoints[i] (S, A, 3) -> the next frames' code-0 logits (S, V)."""
        stride, codes = self.layout.frame_stride, self.layout.image_tokens
        width = stride - codes + 1  # the last code and the action slots
        starts = host_to_device([f * stride + codes - 1 for f in frames], self.device)
        positions = (starts[:, None] + torch.arange(width, device=self.device)).reshape(-1)
        # `model.embed`'s sums, its slots known here: it counts them on the host, which waits for the device
        model = self.model
        code_embeds = model.model.embed_tokens(last_codes)
        action_embeds = model.action_projection(waypoints.to(code_embeds.dtype)).to(code_embeds.dtype)
        embeds = torch.cat([code_embeds[:, None], action_embeds], dim=1).reshape(1, -1, code_embeds.shape[-1])
        embeds = embeds + model.pos_embedding_spatio_temporal(positions[None]).to(embeds.dtype)
        hidden = self.hidden(embeds, positions, 0, segment_rows=rows)
        return self.model.lm_head(hidden[width - 1::width])

    def forward_rows(self, codes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step of rows 0..S-1: codes (S,) at the rows' own positions (S,) -> logits (S, V)."""
        embeds, rotary = self.prologue(codes, positions)
        return self.logits(self.hidden(embeds, positions, 0, decode=True, batched=True, rotary=rotary))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over a decode step's rows (n, H) -> (n, V), in the layout `logits_layout` names."""
        head = self.model.lm_head
        if self.head_fp8 is not None and hidden.shape[0] <= few_rows.MAX_ROWS:
            logits = few_rows.few_rows_matmul(hidden.contiguous(), self.head_fp8[0], scale=self.head_fp8[1])
        elif self.logits_layout == "few-rows" and hidden.shape[0] <= FEW_ROWS and few_rows.runs_on(hidden.device):
            logits = few_rows.few_rows_matmul(hidden.contiguous(), head.weight)
        elif hidden.shape[0] < 2 or (self.logits_layout != "weight-major"
                                     and not (hidden.is_cuda and hidden.shape[0] > FEW_ROWS)):
            return head(hidden)
        else:
            logits = weight_major_logits(head.weight, hidden)
        return logits if head.bias is None else logits + head.bias

    def hidden(self, embeds: torch.Tensor, positions: torch.Tensor, key_length: int, decode: bool = False,
               row: int = 0, batched: bool = False, segment_rows: list[int] | None = None,
               rotary: tuple | None = None) -> torch.Tensor:
        """Final hidden states (n, H): every layer writes its K/V at `positions` first, then attends.
        `positions` are consecutive (a prompt, a step's window) in row `row`'s region; `decode`: a
        decode step's few rows (the compiled functions' shapes), not a prompt. `batched`: instead,
        query i is row i's one code at its own position `positions[i]` (`forward_rows`).
        `segment_rows`: instead, S equal runs of consecutive positions, run i in row segment_rows[i]
        (`forward_frame_ends`). `rotary`: the positions' (cos, sin) rows, made already (`StepPrologue`)."""
        if batched:
            segment_rows = list(range(embeds.shape[1]))
        # Positions past the table only come from draft rows that run off the last frame; their
        # outputs are never used. Rotary takes them clamped; their K/V go to the spare rows.
        if rotary is None and self.rotary is not None and embeds.dtype == self.rotary[0].dtype:
            rotary = rotary_rows(self.rotary, positions, self.max_positions - 1)
        if rotary is None:
            rotary = self.model.model.rotary_emb(embeds, positions.clamp(max=self.max_positions - 1)[None])
        cos, sin = rotary
        ops = self.ops.for_rows(decode)
        n = embeds.shape[1]
        table_rows = None  # the flash kernel's block-table rows: 0..S-1 when batched, these otherwise
        if batched:
            cache_at = positions + self.row_offsets[:n]
        elif segment_rows is not None:
            width = n // len(segment_rows)
            table_rows = host_to_device(segment_rows, self.device)
            cache_at = positions + (table_rows * self.cache_positions).repeat_interleave(width)
        else:
            cache_at = positions if row == 0 else positions + row * self.cache_positions
        if self.flash is not None:
            # Keys [0, last position] are the ones so far; causal aligns each run's queries to its end.
            if segment_rows is not None:
                seen = (positions.view(len(segment_rows), -1)[:, -1] + 1).to(torch.int32)
                plan = None if not batched else self.flash.plan(1, seen, self.heads, self.kv_heads, self.head_dim,
                                                                self.kv_dtype)
            else:
                seen = (positions[-1:] + 1).to(torch.int32)
                plan = self.flash.plan(n, seen, self.heads, self.kv_heads, self.head_dim, self.kv_dtype)
        elif segment_rows is not None:
            group = self.heads // self.kv_heads
        else:
            visible = self.key_positions[None, :key_length] <= positions[:, None]  # (n, L)
            group = self.heads // self.kv_heads
            mask = visible.repeat(group, 1)  # query rows are (group, n) flattened per KV head
        x = embeds
        written = self.fused_cache_write and self.flash is not None and ops.writes_cache
        for index, (layer, keys, values) in enumerate(zip(self.layers, self.keys, self.values)):
            if written:
                q = ops.attention_inputs_written(index, x, cos, sin, keys, values, cache_at)
            else:
                q, k, v = ops.attention_inputs(index, x, cos, sin)
                write_cache(keys, self.position_dim, cache_at, k if self.flash is not None else k.transpose(1, 2))
                write_cache(values, self.position_dim, cache_at, v if self.flash is not None else v.transpose(1, 2))
                if self.kv_dtype != self.dtype:  # the queries as FlashAttention-3 reads them with an fp8 cache
                    q = to_cache(q, self.kv_dtype) if self.flash is not None else to_cache(q, self.kv_dtype).to(q.dtype)
            scale = layer.self_attn.scaling
            if self.flash is not None:
                out = self.flash(q, keys, values, seen, scale, plan, first_row=0 if batched else row,
                                 rows=table_rows).to(x.dtype)  # (an fp8 query's out: bfloat16)
            elif segment_rows is not None:
                out = self.attend_rows(q, keys, values, positions, scale, group, segment_rows)
            else:
                base = row * self.cache_positions
                q = q.transpose(1, 2).reshape(1, self.kv_heads, group * n, self.head_dim)
                out = attend(q, keys[:, :, base:base + key_length], values[:, :, base:base + key_length], mask, scale)
                out = out.view(1, self.kv_heads, group, n, self.head_dim).permute(0, 3, 1, 2, 4).reshape(1, n, -1)
            x = ops.attention_output_and_mlp(index, x, out)
        return (self.prologue.norm(x) if decode else self.model.model.norm(x))[0]

    def attend_rows(self, q, keys, values, positions, scale: float, group: int, rows: list[int]) -> torch.Tensor:
        """The torch path of runs in rows of their own (a batched step's one query a row, or frame ends'
        equal runs): run i's queries (1, w, heads, d) against row rows[i]'s keys so far, one run at a time
        (a CPU's, or a GPU without FlashAttention: it reads each run's length)."""
        width = q.shape[1] // len(rows)
        out = []
        for i, row in enumerate(rows):
            at = positions[i * width:(i + 1) * width]
            seen, base = int(at[-1]) + 1, row * self.cache_positions
            qi = q[:, i * width:(i + 1) * width].transpose(1, 2).reshape(1, self.kv_heads, group * width, self.head_dim)
            mask = (self.key_positions[None, :seen] <= at[:, None]).repeat(group, 1)
            attended = attend(qi, keys[:, :, base:base + seen], values[:, :, base:base + seen], mask, scale)
            out.append(attended.view(1, self.kv_heads, group, width, self.head_dim).permute(0, 3, 1, 2, 4)
                       .reshape(1, width, -1))
        return torch.cat(out, dim=1)

    def frame_key_length(self, frame: int, spill: int = 0) -> int:
        """Keys every step of frame `frame` reads: up to the frame's end (plus `spill` positions a
        draft window may run past its last code), so that all steps of a frame have one shape
        (one CUDA graph per frame, not per step) and early frames read less of the cache. With
        FlashAttention the kernel reads the keys so far by itself: one length for every frame,
        so one graph for all."""
        if self.flash is not None:
            return self.cache_positions
        return min(self.cache_positions, (frame + 1) * self.layout.frame_stride + spill)
