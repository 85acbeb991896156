"""How terra sizes vLLM's KV cache (backends/vllm_config.py): two copies of every rollout's round
where they fit, one where only that fits (room for the video writer processes), vLLM's own sizing
where not even one does; and the CUDA graphs' batch sizes it asks for (the last test checks them
against vLLM's own CompilationConfig)."""

import pytest

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


def test_sparse_graph_sizes_cover_every_batch_with_fewer_graphs():
    """`cuda_graph_sizes`: every batch up to vLLM's largest (twice the rollouts, at most 512) has a size to pad
    to, never more than 31 rows away beyond 32; the in-flight count itself is one; 256 rollouts take 21
    graphs where vLLM's own list takes 51."""
    from terra_cli.backends.vllm_config import LARGEST_GRAPH_TOKENS, cuda_graph_sizes

    for rollouts in (1, 2, 3, 7, 31, 100, 255, 256, 286, 300, 511, 512, 600):
        sizes = cuda_graph_sizes(rollouts)
        largest = min(2 * rollouts, LARGEST_GRAPH_TOKENS)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
        assert min(rollouts, largest) in sizes
        for batch in range(1, largest + 1):
            padded = min(s for s in sizes if s >= batch)
            assert padded - batch < (batch if batch <= 32 else 32), (rollouts, batch, padded)
    assert len(cuda_graph_sizes(256)) == 21 and len(cuda_graph_sizes(286)) == 22  # vLLM's: 1, 2, 4, by 8, by 16


def test_sparse_graph_sizes_apply_only_when_asked_on_a_gpu_with_graphs_and_no_draft(monkeypatch):
    from terra_cli.backends.vllm_config import cuda_graph_sizes, eager_compilation_config, graph_sizes_config
    from terra_cli.errors import InputError
    from terra_cli.runtime import sparse_graph_sizes_asked

    assert graph_sizes_config(True, False, False, 256, sparse=True) == {"cudagraph_capture_sizes": cuda_graph_sizes(256)}
    for on_gpu, eager, drafting, sparse in ((False, False, False, True), (True, True, False, True),
                                            (True, False, True, True), (True, False, False, False)):
        assert graph_sizes_config(on_gpu, eager, drafting, 256, sparse) == {}
    assert sparse_graph_sizes_asked({}) is False
    assert sparse_graph_sizes_asked({"TERRA_CUDA_GRAPH_SIZES": " Sparse "}) is True
    assert sparse_graph_sizes_asked({"TERRA_CUDA_GRAPH_SIZES": "vllm"}) is False
    with pytest.raises(InputError, match="TERRA_CUDA_GRAPH_SIZES='every': use sparse"):
        sparse_graph_sizes_asked({"TERRA_CUDA_GRAPH_SIZES": "every"})
    # what the backend hands vLLM is a compilation config vLLM takes, with these sizes
    from vllm.config import CompilationConfig

    asked = {**eager_compilation_config(True), **graph_sizes_config(True, False, False, 286, sparse=True)}
    assert CompilationConfig(**asked).cudagraph_capture_sizes == cuda_graph_sizes(286)
