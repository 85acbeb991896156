"""Peak memory of decoding frames with Terra's image tokenizer (random weights in its config, CPU,
fp32): the growth of the process's peak RSS for each decode batch size given, in order.

    PYTHONPATH=. python benchmarks/scripts/cpu_decode_memory.py 1 2 8
"""

import resource
import sys
import time

import numpy as np
import torch

from tokenizer_decoder import TERRA_TOKENIZER_CONFIG, ImageTokenizer


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = ImageTokenizer.from_config(TERRA_TOKENIZER_CONFIG, seed=0, device="cpu")
    print("parameters", sum(p.numel() for p in tokenizer.model.parameters()))
    for batch in map(int, sys.argv[1:]):
        tokenizer.batch_size = batch
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.time()
        codes = np.random.default_rng(0).integers(0, TERRA_TOKENIZER_CONFIG.codebook_size, size=(batch, 576))
        frames = tokenizer.decode_tokens(codes)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"batch {batch}: peak RSS +{(peak - before) / 1e6:.2f} GB over the previous peak, "
              f"{time.time() - started:.1f} s, {frames.shape}")


if __name__ == "__main__":
    main()
