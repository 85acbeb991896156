"""How terra sizes vLLM's KV cache (backends/vllm_config.py): two copies of every rollout's round
where they fit, one where only that fits (room for the video writer processes), vLLM's own sizing
where not even one does. No vLLM needed."""

from terra_cli.backends.vllm_config import KV_BLOCK_TOKENS, kv_cache_bytes, sized_kv_cache
from terra_cli.models.config import LlamaActionConfig
from terra_cli.models.testing import TERRA_WORLD_MODEL_CONFIG

GIB = 2**30
H100 = 80 * 10**9
WEIGHTS = 4_100_000_000  # Terra's 2.04B bf16 parameters


def test_a_terra_rollout_round_costs_what_its_keys_and_values_take():
    config = LlamaActionConfig.from_dict(dict(TERRA_WORLD_MODEL_CONFIG))
    head_dim = config.hidden_size // config.num_attention_heads
    per_token_fp8 = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    tokens = config.layout.max_positions + KV_BLOCK_TOKENS
    assert kv_cache_bytes(config, 256, "fp8", copies=1) == 256 * tokens * per_token_fp8
    assert kv_cache_bytes(config, 256, None, copies=1) == 2 * kv_cache_bytes(config, 256, "fp8_e4m3", copies=1)
    assert kv_cache_bytes(config, 256, "fp8", copies=2) == 2 * kv_cache_bytes(config, 256, "fp8", copies=1)
    assert kv_cache_bytes(config, 1, "fp8", copies=1) == GIB  # never less than 1 GiB


def test_the_cache_falls_back_from_two_copies_to_one_to_vllms_sizing():
    config = LlamaActionConfig.from_dict(dict(TERRA_WORLD_MODEL_CONFIG))
    # 8 rollouts: two copies fit easily
    assert sized_kv_cache(config, 8, "fp8", WEIGHTS, H100) == kv_cache_bytes(config, 8, "fp8", copies=2)
    # 256 fp8 rollouts (ACT-Bench on one H100): two copies (78 GiB) do not fit, one (39 GiB) does
    one = sized_kv_cache(config, 256, "fp8", WEIGHTS, H100)
    assert one == kv_cache_bytes(config, 256, "fp8", copies=1) and 38 * GIB < one < 40 * GIB
    # 256 bf16 rollouts need 78 GiB for one copy: vLLM sizes its cache itself
    assert sized_kv_cache(config, 256, None, WEIGHTS, H100) is None


def test_an_engine_sized_in_bytes_starts_beside_another_process_on_its_gpu():
    """vLLM checks at start that `gpu_memory_utilization` of the card is free, even when the KV
    cache is given in bytes. A Ray driver that built the random checkpoint on GPU 0 kept 9.5 GB
    there, and engine 0 refused to start with the default 0.9 (80 GB card, 70.5 GB free). The
    share terra passes beside a cache in bytes passes vLLM's own check then, and is the asked
    share on a free card."""
    from types import SimpleNamespace

    import pytest

    from terra_cli.backends.vllm_config import startup_memory_share

    utils = pytest.importorskip("vllm.v1.worker.utils")
    total, held_by_driver = H100, 9_500_000_000
    free = total - held_by_driver
    snapshot = SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0")
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        utils.request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=0.9))
    share = startup_memory_share(free, total, 0.9)
    assert utils.request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=share)) <= free
    assert share > 0.8  # still close to what is free: nothing else is decided by it
    assert startup_memory_share(total - 600_000_000, total, 0.9) == 0.9  # a CUDA context's worth held: as asked
