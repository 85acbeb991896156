"""Runs the single-stream decoder's steps of one query a row through terra's paged decode kernel
(TERRA_SINGLE_STREAM_DECODE_KERNEL=terra, kernels/paged_attention.py) under Triton's interpreter, and the same
rollouts through FlashAttention-3's contract (tests/test_single_stream.py's stand-in for it), on an fp8 cache:
one rollout, and three as a row batch. Prints the codes and the kernel's calls as JSON, for
tests/test_fp8_cache.py. A process of its own: the interpreter must be chosen before Triton is imported.

    python tests/decode_kernel_interpreted.py CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(checkpoint: str) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np
    import torch
    from test_fp8_cache import flash_attention_3_reading_fp8, work

    from terra_cli.backends import flash_cache, static_kv
    from terra_cli.backends.base import Sampling
    from terra_cli.backends.row_batch import RowBatchDecoder
    from terra_cli.backends.single_stream import SingleStreamDecoder
    from terra_cli.models.modeling_hf import load_model

    def flash_attention_3_rows(q, k, v, *, cu_seqlens_q, seqused_k, block_table, max_seqlen_q, scheduler_metadata=None,
                               **kwargs):
        """FlashAttention-3's contract for S sequences (a row batch's step, its frame ends): each sequence on its own."""
        starts = cu_seqlens_q.tolist()
        return torch.cat([flash_attention_3_reading_fp8(
            q[a:b], k, v, cu_seqlens_q=torch.tensor([0, b - a], dtype=torch.int32), max_seqlen_q=b - a,
            seqused_k=seqused_k[i:i + 1], block_table=block_table[i:i + 1], **kwargs)
            for i, (a, b) in enumerate(zip(starts, starts[1:]))])

    static_kv.flash_varlen_kernel = lambda device, dtype: (flash_attention_3_rows, 3)
    static_kv.flash_planner = lambda version: None  # each call plans (FlashAttention-3's own choice)
    calls = []
    kernel_call = flash_cache.TerraDecodeAttention.__call__
    flash_cache.TerraDecodeAttention.__call__ = lambda self, q, *args: calls.append(q.shape[1]) or kernel_call(self, q, *args)
    model = load_model(checkpoint, device="cpu", dtype=torch.float32)
    batch = [work(1, 2, 3), work(2, 1, 3), work(3, 2, 3)]
    greedy = Sampling(temperature=0)
    result = {}
    for kernel in ("flash", "terra"):
        os.environ[flash_cache.DECODE_KERNEL_ENV] = kernel
        calls.clear()
        single = SingleStreamDecoder(model, fp8_cache=True)
        one = single.rollout(batch[0].context, batch[0].actions, batch[0].num_frames, greedy, batch[0].seed)
        rows = RowBatchDecoder(single.core, rows=4).rollouts(batch, greedy)
        result[kernel] = {"one": np.asarray(one).tolist(), "rows": [np.asarray(r).tolist() for r in rows],
                          "kernel_calls": len(calls), "kernel_rows": sorted(set(calls))}
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
