"""Issues 37 and 40: a compile apart's child compiles under its parent's compile settings
(terra_cli.compile_apart.parent_compile_settings / adopt_parent_compile_settings), so the parent's
compile afterwards finds the child's graphs in Inductor's cache.

The engine's process is not a fresh interpreter: vLLM's import and engine change Inductor's options
and torch globals that Inductor's cache key holds. These tests change such settings in this process
only, start real children through `CompileApart`, and compile for real on the CPU (a tiny function:
seconds, not the decoder's minutes).
"""

import json
import sys
import textwrap

import pytest
import torch
from torch._inductor import config as inductor_config

from terra_cli.compile_apart import CompileApart, adopt_parent_compile_settings, fx_cache_counts, SETTINGS_ENV

REPORT_CHILD = [sys.executable, "-c", textwrap.dedent("""
    import json, torch
    from torch._inductor import config
    from terra_cli.compile_apart import adopt_parent_compile_settings
    report = adopt_parent_compile_settings()
    print(json.dumps({"debug_index_asserts": config.debug_index_asserts,
                      "bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
                      "default_dtype": str(torch.get_default_dtype()), **report}))
""")]

# The graph both processes compile, from one module file (the child imports it by name)
GRAPH_MODULE = """
import torch

def graph(x):
    return (x.sin() * 2 + 1).relu().sum(dim=0)
"""

COMPILE_CHILD = [sys.executable, "-c", textwrap.dedent("""
    import json, sys, torch
    from terra_cli.compile_apart import adopt_parent_compile_settings, fx_cache_counts
    import tiny_graph
    report = adopt_parent_compile_settings()
    torch.compile(tiny_graph.graph, dynamic=False)(torch.ones(4, 8))
    print(json.dumps({"cache": fx_cache_counts(), **report}))
""")]


@pytest.fixture
def vllm_worker_precision():
    """What vLLM's GPU worker does at its start in the engine's process (`gpu_worker.py`:
    `torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION)`, "highest" by default): it
    turns `torch.backends.cuda.matmul.fp32_precision` from "none" to "ieee", which Inductor's cache key
    holds: the likely cause of the decoder's miss beside vLLM on an H200 (2026-11-28). Restored after."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "none"  # a fresh interpreter's, whatever ran in this process before

    def apply() -> None:
        torch.set_float32_matmul_precision("highest")

    yield apply
    matmul.fp32_precision = before


@pytest.fixture
def index_asserts():
    """Set Inductor's `debug_index_asserts` (an option its key holds) for one test, restored after."""
    before = inductor_config.debug_index_asserts

    def flip() -> None:
        inductor_config.debug_index_asserts = not before

    yield flip
    inductor_config.debug_index_asserts = before


@pytest.fixture
def parent_settings(index_asserts):
    """This process with three settings the key holds changed from a fresh interpreter's."""
    index_asserts()
    matmul = torch.backends.cuda.matmul
    bf16, dtype = matmul.allow_bf16_reduced_precision_reduction, torch.get_default_dtype()
    matmul.allow_bf16_reduced_precision_reduction = not bf16
    torch.set_default_dtype(torch.float64)
    yield
    matmul.allow_bf16_reduced_precision_reduction = bf16
    torch.set_default_dtype(dtype)


def test_a_child_takes_the_parents_inductor_options_and_torch_globals(parent_settings):
    child = CompileApart("{}", REPORT_CHILD)
    seen = child.wait(120)
    assert seen is not None, child.error
    assert seen["debug_index_asserts"] == inductor_config.debug_index_asserts
    assert seen["bf16_reduced"] == torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    assert seen["default_dtype"] == "torch.float64"
    assert {"inductor.debug_index_asserts", "matmul.allow_bf16_reduced_precision_reduction",
            "default_dtype"} <= set(seen["adopted"])
    assert seen["refused"] == {}


def test_a_child_with_no_settings_keeps_its_own(parent_settings, monkeypatch):
    """The control: what a child has without the settings (so the test above can fail)."""
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    report = adopt_parent_compile_settings()
    assert report == {"adopted": [], "refused": {}}
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"inductor": {"no_such_option_anywhere": 1}}))
    report = adopt_parent_compile_settings()
    assert report["adopted"] == [] and list(report["refused"]) == ["inductor.no_such_option_anywhere"]


def tiny_graph_module(tmp_path, monkeypatch):
    (tmp_path / "tiny_graph.py").write_text(GRAPH_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # (child_environment puts terra's folder first)
    import importlib

    import tiny_graph

    return importlib.reload(tiny_graph)


def compile_in_a_child(tmp_path, monkeypatch):
    """A child compiles the tiny graph cold into an empty cache (`tmp_path`'s) under this process's settings;
    returns the graph for this process to compile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    graph = tiny_graph_module(tmp_path, monkeypatch)
    child = CompileApart("{}", COMPILE_CHILD)
    result = child.wait(300)
    assert result is not None, child.error
    assert result["cache"] == [0, 1]  # the child compiled cold, into the empty cache
    return graph


def cache_lookups_of_a_compile(graph) -> list[int]:
    """[hits, misses] of Inductor's cache for compiling `graph` again in this process."""
    torch._dynamo.reset()
    hits, misses = fx_cache_counts()
    torch.compile(graph.graph, dynamic=False)(torch.ones(4, 8))
    after = fx_cache_counts()
    return [after[0] - hits, after[1] - misses]


def test_settings_changed_before_the_child_travel_and_the_parents_compile_is_a_hit(tmp_path, monkeypatch,
                                                                                   index_asserts, vllm_worker_precision):
    """An Inductor option and vLLM's float32 matmul precision, both changed before the child starts, travel
    with it: the parent's compile afterwards finds the child's graph (one that did not travel would make
    the key differ: the test below shows the key holds each of them)."""
    index_asserts()
    vllm_worker_precision()
    graph = compile_in_a_child(tmp_path, monkeypatch)
    assert cache_lookups_of_a_compile(graph) == [1, 0]


def test_settings_changed_after_the_child_are_misses_each(tmp_path, monkeypatch, index_asserts, vllm_worker_precision):
    """The same changes made after the child ended are a miss, each in turn: Inductor's key holds each
    setting, so the handing over is what made the test above a hit."""
    graph = compile_in_a_child(tmp_path, monkeypatch)
    assert cache_lookups_of_a_compile(graph) == [1, 0]  # nothing changed yet: the child's graph
    index_asserts()
    assert cache_lookups_of_a_compile(graph) == [0, 1]
    vllm_worker_precision()
    assert cache_lookups_of_a_compile(graph) == [0, 1]


class LookingUpDecoder:
    """A decode-ahead decoder whose first batch looks Inductor's cache up once, as a compiled
    decoder's first call does (hit or miss by `hit`), and whose later batches look up nothing."""

    batch_size, tokens_per_frame = 2, 4

    def __init__(self, hit: bool):
        self.hit, self.calls = hit, 0

    def decode_tokens(self, rows, full_batches=False):
        import numpy as np
        from torch._dynamo.utils import counters

        if self.calls == 0:
            counters["inductor"]["fxgraph_cache_hit" if self.hit else "fxgraph_cache_miss"] += 1
        self.calls += 1
        return np.zeros((len(rows), 2, 2, 3), dtype=np.uint8)


@pytest.mark.parametrize("hit", [True, False])
def test_the_decode_aheads_first_batch_says_its_cache_lookups(hit):
    """The engine line's "its first batch X s (Inductor's cache: H hits, M misses)": a miss after a
    compile apart is what a lease must be able to see (2026-11-28: the parent's compile still ran
    Inductor's compile workers)."""
    import numpy as np

    from terra_cli.scenarios.frame_store import FrameStore

    store = FrameStore(LookingUpDecoder(hit), held_frames=100)
    store.add("a", 0, np.zeros((4, 4), dtype=np.int64))
    assert store.decode_waiting() and store.decode_waiting()  # two full batches
    stats = store.stats()
    assert stats["decode_first_batch_cache"] == ([1, 0] if hit else [0, 1])
    assert stats["decode_ahead_batches"] == 2


def test_a_child_compiles_below_the_engines_cpu_priority():
    """The child may start a compile worker per core (it takes the parent's compile threads): it and
    its workers run niced, so the engine's threads win the cores."""
    import os

    from terra_cli.compile_apart import CHILD_NICENESS

    child = CompileApart("{}", [sys.executable, "-c", "import json, os; from terra_cli.compile_apart import "
                                "begin_child_compile; report = begin_child_compile(); print(json.dumps({'nice': os.nice(0)}))"])
    result = child.wait(120)
    assert result is not None, child.error
    assert result["nice"] == min(19, os.nice(0) + CHILD_NICENESS)
