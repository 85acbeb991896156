"""Reuse a rollout's prefix-cache block hashes from one frame's vLLM request to the next.

Each frame of a rollout is a new vLLM request whose prompt is the whole rollout so far (up to
14.5k tokens on Terra's 25-frame rounds), and vLLM hashes every block of a new request's prompt
for its prefix cache before it is scheduled: about 2 ms a request on one core (sha256 over
pickled blocks; `benchmarks/scripts/cpu_prefix_hash.py`), about 0.5 s per engine at each frame
boundary of 256 rollouts, in the loop that feeds the GPU. The previous frame's request already
holds those hashes (vLLM extends a request's hashes as it generates), and its tokens are the
front of the new prompt.

`PrefixHashReuse` wraps the engine core's block hasher: a new request whose id says it continues
a rollout (`lineage`) gets the hashes of that rollout's last request, but only when that request's
every token is the front of the new prompt and both carry the same cache salt, with no LoRA,
multimodal or embedding inputs (the other parts of vLLM's hash). Then the hashes vLLM would compute
are these same values, block for block; vLLM's own hasher computes the rest. Anything else falls
back to vLLM's hasher untouched.
"""

from __future__ import annotations

from typing import Callable


def engine_core_of(llm):
    """The in-process `EngineCore` behind `LLM`, or None (the engine runs in another process)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    return core if hasattr(core, "request_block_hasher") else None


def _plain(request) -> bool:
    """No input besides token ids and the salt enters this request's block hashes."""
    return (getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None)


class PrefixHashReuse:
    """Wraps an engine's block hasher while a driver runs (`attach` ... `detach`);
    `reused_blocks` and `new_requests` count what it saw."""

    def __init__(self, lineage: Callable[[str], str | None]):
        self.lineage = lineage
        self.core = None
        self.vllm_hasher = None
        self.last: dict[str, object] = {}  # lineage -> its latest request
        self.reused_blocks = 0
        self.new_requests = 0

    def attach(self, llm) -> bool:
        """Wrap `llm`'s hasher; False when there is nothing to wrap (the engine runs in another
        process, or has no prefix cache) or another wrapper is in place."""
        core = engine_core_of(llm)
        if core is None or core.request_block_hasher is None or isinstance(core.request_block_hasher, PrefixHashReuse):
            return False
        self.core, self.vllm_hasher = core, core.request_block_hasher
        core.request_block_hasher = self
        return True

    def detach(self) -> None:
        """Give the engine its own hasher back and drop every kept request."""
        if self.core is not None and self.core.request_block_hasher is self:
            self.core.request_block_hasher = self.vllm_hasher
        self.core = None
        self.last.clear()

    def forget(self, lineage: str) -> None:
        """The rollout has ended: drop its last request."""
        self.last.pop(lineage, None)

    def __call__(self, request) -> list:
        if not request.block_hashes:  # a new request: vLLM asks for its prompt's hashes
            self.new_requests += 1
            key = self.lineage(request.request_id)
            if key is not None:
                previous = self.last.get(key)
                self.last[key] = request
                if previous is not None and self._extends(request, previous):
                    request.block_hashes.extend(previous.block_hashes)
                    self.reused_blocks += len(previous.block_hashes)
        return self.vllm_hasher(request)

    @staticmethod
    def _extends(request, previous) -> bool:
        if not previous.block_hashes or request.cache_salt != previous.cache_salt:
            return False
        if not (_plain(request) and _plain(previous)):
            return False
        tokens = previous.num_tokens
        if request.num_tokens < tokens:
            return False
        return request.all_token_ids[:tokens] == previous.all_token_ids[:tokens]
