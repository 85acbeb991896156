"""What vLLM's prefix cache costs the host for one of terra's per-frame requests (CPU, no GPU).

Each finished frame of a rollout ends its vLLM request; the next frame is a new request whose
prompt is the whole rollout so far (up to 14.5k tokens on Terra's 25-frame rounds), and vLLM hashes
every 16-token block of it for the prefix cache. This times vLLM's own `hash_block_tokens` over
such a prompt (sha256 and sha256_cbor), and its two parts, pickling and sha256.

    python benchmarks/scripts/cpu_prefix_hash.py [--tokens 14500]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=14500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    rng = random.Random(0)
    tokens = [rng.randrange(262_144) for _ in range(args.tokens)]
    blocks = [tuple(tokens[i:i + 16]) for i in range(0, len(tokens) - 15, 16)]
    for name, fn in [("sha256", sha256), ("sha256_cbor", sha256_cbor)]:
        started = time.perf_counter()
        for _ in range(args.repeats):
            parent = None
            for i, block in enumerate(blocks):
                parent = hash_block_tokens(fn, parent, block, ("salt",) if i == 0 else None)
        seconds = (time.perf_counter() - started) / args.repeats
        print(f"{name}: {seconds * 1e3:.2f} ms for a {len(tokens)}-token prompt ({len(blocks)} blocks)")
    started = time.perf_counter()
    data = b""
    for _ in range(args.repeats):
        for block in blocks:
            data = pickle.dumps((b"x" * 32, block, None), protocol=pickle.HIGHEST_PROTOCOL)
    pickled = time.perf_counter()
    for _ in range(args.repeats):
        for _block in blocks:
            hashlib.sha256(data).digest()
    hashed = time.perf_counter()
    print(f"of which: pickling {(pickled - started) / args.repeats * 1e3:.2f} ms, "
          f"sha256 {(hashed - pickled) / args.repeats * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
