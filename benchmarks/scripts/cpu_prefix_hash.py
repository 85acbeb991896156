"""What vLLM's prefix cache costs the host for one of terra's per-frame requests (CPU, no GPU).

Each finished frame of a rollout ends its vLLM request; the next frame is a new request whose
prompt is the whole rollout so far (up to 14.5k tokens on Terra's 25-frame rounds), and vLLM hashes
every 16-token block of it for the prefix cache. This times vLLM's own `hash_block_tokens` over
such a prompt (sha256 and sha256_cbor), its two parts, pickling and sha256, and what a new
request's hashing costs when terra hands it the previous frame's hashes (backends/vllm_prefix_hashes.py).

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
    reuse_timing(tokens, args.repeats)


def reuse_timing(tokens: list[int], repeats: int) -> None:
    """A rollout's next frame as vLLM's request sees it: the previous request's prompt and its
    576 generated codes, then the frame's 6 action ids; hashed alone and with the reuse."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from terra_cli.backends.vllm_prefix_hashes import PrefixHashReuse

    vllm_hasher = get_request_block_hasher(16, sha256)
    previous_prompt = tokens[: len(tokens) - 582]
    previous = Request("r#0.1", previous_prompt, SamplingParams(), None, cache_salt="0.0", block_hasher=vllm_hasher)
    previous.append_output_token_ids(tokens[len(previous_prompt) : len(tokens) - 6])
    engine = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        engine_core=SimpleNamespace(request_block_hasher=vllm_hasher))))
    reuse = PrefixHashReuse(lambda request_id: request_id.partition("#")[0])
    reuse.attach(engine)
    for name, hasher in [("vLLM's hasher", vllm_hasher), ("with the previous request's hashes", reuse)]:
        started = time.perf_counter()
        for i in range(repeats):
            reuse.last["r"] = previous  # each new request is the frame after `previous`
            request = Request(f"r#0.{i + 2}", tokens, SamplingParams(), None, cache_salt="0.0", block_hasher=hasher)
        seconds = (time.perf_counter() - started) / repeats
        print(f"a new {len(tokens)}-token request, {name}: {seconds * 1e3:.2f} ms ({len(request.block_hashes)} blocks)")


if __name__ == "__main__":
    main()
