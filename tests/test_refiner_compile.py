"""Issue 40: which torch.compile mode the refiner's UNet gets, and where Inductor keeps its cache."""

import pytest

from terra_cli.errors import InputError
from terra_cli.refiner.compiled import (check_compile_mode, inductor_cache_dir, resolve_compile_mode,
                                        use_inductor_cache, uses_cuda_graphs)


def test_auto_compiles_on_a_gpu_only_and_other_modes_stay_as_given():
    assert resolve_compile_mode("auto", "cuda") == "default"
    assert resolve_compile_mode("auto", "cuda:1") == "default"
    assert resolve_compile_mode("auto", "cpu") == "none"
    assert resolve_compile_mode("None", "cuda") == "none"  # eager for debugging, on a GPU too
    assert resolve_compile_mode("reduce-overhead", "cpu") == "reduce-overhead"
    assert uses_cuda_graphs("reduce-overhead") and uses_cuda_graphs("max-autotune")
    assert not uses_cuda_graphs("default") and not uses_cuda_graphs("max-autotune-no-cudagraphs")
    with pytest.raises(InputError, match="--refiner-compile must be one of auto, none"):
        check_compile_mode("fast")


def test_inductor_cache_goes_under_terras_cache_unless_set(tmp_path):
    environ = {"TERRA_CACHE": str(tmp_path / "terra")}
    assert use_inductor_cache(environ) == tmp_path / "terra" / "inductor"
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "terra" / "inductor")
    mine = {"TERRA_CACHE": str(tmp_path / "terra"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}
    assert use_inductor_cache(mine) == tmp_path / "mine" and mine["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert inductor_cache_dir(xdg) == tmp_path / "xdg" / "terra" / "inductor" and "TORCHINDUCTOR_CACHE_DIR" not in xdg


def test_inductors_own_default_in_the_variable_counts_as_unset(tmp_path):
    """Importing diffusers' UNet makes Inductor write its default folder into TORCHINDUCTOR_CACHE_DIR."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    environ = {"TERRA_CACHE": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    assert use_inductor_cache(environ) == tmp_path / "inductor"
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_tracing_quietly_silences_dynamos_lru_cache_warning_and_nothing_else():
    """diffusers' up-sampling calls an lru_cache-wrapped version check; Dynamo warns at each call
    site while tracing (every compiled GPU run's log showed two). Here a tiny function does the same."""
    import contextlib
    import functools
    import warnings

    import torch

    from terra_cli.refiner.compiled import tracing_quietly

    @functools.lru_cache
    def old_torch(version):
        return False

    def upsample(x):
        if old_torch("2.1"):
            return x
        warnings.warn("another warning", UserWarning)
        return x * 2

    def traced_warnings(quiet: bool) -> list[str]:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracing_quietly() if quiet else contextlib.nullcontext():
                torch.compile(upsample, backend="eager")(torch.ones(2))
        return [str(w.message) for w in caught]

    loud = traced_warnings(quiet=False)
    assert any("lru_cache" in m for m in loud)  # the warning this silences, as torch gives it
    quiet = traced_warnings(quiet=True)
    assert not any("lru_cache" in m for m in quiet) and "another warning" in quiet
    # Inductor's TF32 advice comes only on a card (compile_fx._warn_tf32_disabled): its text, warned here
    tf32 = ("TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
            "Consider setting `torch.set_float32_matmul_precision('high')` for better performance.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracing_quietly():
            warnings.warn(tf32)
            warnings.warn("TensorFloat32 is something else")
        warnings.warn(tf32)
    assert [str(w.message) for w in caught] == ["TensorFloat32 is something else", tf32]
