"""Runs terra's paged attention kernels under Triton's interpreter and writes what they computed as
.npy files, for tests/test_paged_attention.py to compare with the float64 reference. A process of
its own: the interpreter must be chosen before Triton is imported, and the test process may have
imported it.

    python tests/paged_attention_interpreted.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

# Terra's group of 8 query heads a KV head and its head size, over 2 KV heads (Terra has 4): the
# interpreter's time grows with the heads, and two already catch a query head read against the
# wrong KV head.
HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 64, 16
SCALE = HEAD_DIM ** -0.5
# A step as vLLM hands it over: decodes whose contexts end mid-page and mid-tile, one token, an
# empty (padded) slot, a prompt's 5-token uncached tail after a cached prefix, and a fresh 7-token
# prompt (its own keys only).
SEQ_LENS = [100, 1, 0, 250, 37, 64, 7]
QUERY_LENS = [1, 1, 1, 5, 1, 1, 7]

# name: (seed, cache dtype, program, splits, tile, decode_only)
CASES = {
    f"{program}-s{splits}-{dtype}{'-decode-only' if decode_only else ''}": (splits, dtype, program, splits, tile,
                                                                             decode_only)
    for dtype in ("fp8", "bf16")
    for program, tile, splits, decode_only in (("all-heads", 32, 1, False), ("all-heads", 32, 4, False),
                                               ("per-head", 64, 1, False), ("per-head", 64, 8, False),
                                               ("all-heads", 32, 2, True), ("per-head", 64, 1, True))
}


def make_batch(seed: int, seq_lens: list[int], query_lens: list[int], dtype: str, padded_rows: int = 0):
    """Random caches in vLLM's paged layout behind a shuffled block table, and bf16 queries
    (`padded_rows` more than the requests use, as in a padded CUDA-graph batch)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pages = [max(1, -(-n // PAGE)) for n in seq_lens]
    blocks = sum(pages) + 3
    kv = torch.randn(blocks, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen) * 2
    kv = kv.to(torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
    order = torch.randperm(blocks, generator=gen).int()
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for i, count in enumerate(pages):
        table[i, :count] = order[used:used + count]
        used += count
    starts = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    query = torch.randn(int(starts[-1]) + padded_rows, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    key_cache, value_cache = kv.unbind(1)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def main(out: Path) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from terra_cli.kernels import paged_attention as pd

    def save(name: str, tensor: torch.Tensor) -> None:
        np.save(out / f"{name}.npy", tensor.float().numpy())

    one = torch.tensor([1.0])
    for name, (seed, dtype, program, splits, tile, decode_only) in CASES.items():
        query, key_cache, value_cache, table, lens, starts = make_batch(seed, SEQ_LENS, QUERY_LENS, dtype)
        # float32 out: the kernel's own error, apart from the bf16 rounding a model's output gets
        result = torch.full(query.shape, float("nan"), dtype=torch.float32)
        pd.paged_attention(query, key_cache, value_cache, table, lens, starts, result, scale=SCALE,
                           k_scale=torch.tensor([0.5]), v_scale=torch.tensor([1.5]), decode_only=decode_only,
                           plan=pd.DecodePlan(program, splits, tile))
        save(name, result)

    # An fp8 query with its scale (and a bf16 output, as in the model).
    query, key_cache, value_cache, table, lens, starts = make_batch(7, [70, 33], [1, 1], "fp8")
    result = torch.empty(query.shape, dtype=torch.bfloat16)
    pd.paged_attention((query.float() / 0.25).to(torch.float8_e4m3fn), key_cache, value_cache, table, lens, starts,
                       result, scale=SCALE, k_scale=one, v_scale=one, q_scale=torch.tensor([0.25]),
                       plan=pd.DecodePlan("all-heads", 2, 32))
    save("fp8-query", result)

    # A padded graph batch: two empty requests and 5 query rows no request owns; the plan chosen.
    query, key_cache, value_cache, table, lens, starts = make_batch(11, [30, 200, 0, 0], [1, 3, 0, 0], "fp8",
                                                                    padded_rows=5)
    result = torch.full(query.shape, float("nan"), dtype=torch.float32)
    pd.paged_attention(query, key_cache, value_cache, table, lens, starts, result, scale=SCALE, k_scale=one,
                       v_scale=one)
    save("padded", result)

    # A large prompt step: the prompt's rows go to another kernel (here one that writes 7s).
    query, key_cache, value_cache, table, lens, starts = make_batch(3, [40, 90, 17], [1, 6, 1], "fp8")
    seen = []

    def prompt_attention(rows_query, rows):
        seen.append(rows_query.clone())
        return torch.full(rows_query.shape, 7.0, dtype=torch.bfloat16)

    result = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    pd.split_batch_attention(query, key_cache, value_cache, table, lens, starts, result,
                             prefill=pd.prefill_rows(starts, lens, table, "cpu"), prompt_attention=prompt_attention,
                             scale=SCALE, k_scale=one, v_scale=one, plan=pd.DecodePlan("per-head", 2, 64))
    save("split", result)
    save("split-prompt-query", seen[0])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
