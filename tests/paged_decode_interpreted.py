"""Runs terra's paged decode kernels under Triton's interpreter and writes what they computed as .npy
files, for tests/test_paged_decode.py to compare with the float64 reference. A process of its own:
the interpreter must be chosen before Triton is imported, and the test process may have imported it.

    python tests/paged_decode_interpreted.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 64, 16
SCALE = HEAD_DIM ** -0.5

# name: (seed, seq_lens, query_lens, cache dtype, program, splits, tile, k_scale, v_scale)
# Contexts end mid-page and mid-tile; one is a single token, one is empty (a padded graph slot);
# the request with 5 query tokens is a prompt whose rows the kernel must leave alone.
CASES = {
    f"{program}-s{splits}-{dtype}": (splits, [100, 1, 0, 250, 37, 64], [1, 1, 1, 5, 1, 1], dtype, program, splits,
                                     tile, 0.5, 1.5)
    for dtype in ("fp8", "bf16")
    for program, tile, splits in (("all-heads", 32, 1), ("all-heads", 32, 4), ("per-head", 64, 1), ("per-head", 64, 8))
}


def make_batch(seed: int, seq_lens: list[int], query_lens: list[int], dtype: str):
    """Random caches in vLLM's paged layout behind a shuffled block table, and bf16 queries."""
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
    query = torch.randn(int(starts[-1]), HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    key_cache, value_cache = kv.unbind(1)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def main(out: Path) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from terra_cli.kernels import paged_decode as pd

    def save(name: str, tensor: torch.Tensor) -> None:
        np.save(out / f"{name}.npy", tensor.float().numpy())

    for name, (seed, seq_lens, query_lens, dtype, program, splits, tile, k_scale, v_scale) in CASES.items():
        query, key_cache, value_cache, table, lens, starts = make_batch(seed, seq_lens, query_lens, dtype)
        # float32 out: the kernel's own error, apart from the bf16 rounding a model's output gets
        result = torch.full(query.shape, float("nan"), dtype=torch.float32)
        pd.paged_decode_attention(query, key_cache, value_cache, table, lens, starts, result, scale=SCALE,
                                  k_scale=torch.tensor([k_scale]), v_scale=torch.tensor([v_scale]),
                                  plan=pd.DecodePlan(program, splits, tile))
        save(name, result)

    # An fp8 query with its scale (and a bf16 output, as in the model).
    query, key_cache, value_cache, table, lens, starts = make_batch(7, [70, 33], [1, 1], "fp8")
    result = torch.empty(query.shape, dtype=torch.bfloat16)
    pd.paged_decode_attention((query.float() / 0.25).to(torch.float8_e4m3fn), key_cache, value_cache, table, lens,
                              starts, result, scale=SCALE, k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0]),
                              q_scale=torch.tensor([0.25]), plan=pd.DecodePlan("all-heads", 2, 32))
    save("fp8-query", result)

    # A mixed batch: the prompt's rows go to another kernel (here one that writes 7s).
    query, key_cache, value_cache, table, lens, starts = make_batch(3, [40, 90, 17], [1, 6, 1], "fp8")
    seen = []

    def prompt_attention(rows_query, rows):
        seen.append(rows_query.clone())
        return torch.full(rows_query.shape, 7.0, dtype=torch.bfloat16)

    result = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    pd.mixed_batch_attention(query, key_cache, value_cache, table, lens, starts, result,
                             prefill=pd.prefill_rows(starts, lens, table, "cpu"), prompt_attention=prompt_attention,
                             scale=SCALE, k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0]),
                             plan=pd.DecodePlan("per-head", 2, 64))
    save("mixed", result)
    save("mixed-prompt-query", seen[0])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
