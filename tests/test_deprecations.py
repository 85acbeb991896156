"""A plain run prints no deprecation: the reference backend passes its KV cache under the name the
installed transformers takes (`cache` from 5.24, `past_key_values` before; models/modeling_hf.py)."""

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch


def test_the_cache_goes_under_the_name_llama_takes_and_comes_back():
    from transformers import LlamaModel
    from transformers.cache_utils import DynamicCache

    from terra_cli.models.modeling_hf import CACHE_ARGUMENT, build_model
    from terra_cli.models.testing import tiny_config

    assert CACHE_ARGUMENT in inspect.signature(LlamaModel.forward).parameters
    config = tiny_config(image_tokens=24, action_tokens=6)
    model = build_model(config)
    ids = torch.randint(0, config.layout.image_vocab_size, (1, 24))
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        _, returned = model(ids, torch.arange(24)[None], None, cache, use_cache=True)
    assert returned is cache and cache.get_seq_length() == 24


@pytest.mark.slow
def test_a_plain_hf_generate_prints_no_deprecation(tmp_path):
    import imageio.v2 as iio

    # Warnings as errors from the interpreter's start: any FutureWarning or DeprecationWarning that
    # reaches the user fails the run; transformers' own "deprecated" log lines are checked in the text.
    command = [sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning", "-m", "terra_cli",
               "generate", "out.mp4", "--frames", "4", "--actions", "left", "--backend", "hf"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    printed = result.stdout + result.stderr
    assert "deprecat" not in printed.lower(), printed
    assert "FutureWarning" not in printed and "DeprecationWarning" not in printed, printed
    reader = iio.get_reader(str(tmp_path / "out.mp4"), format="FFMPEG")
    try:
        assert reader.count_frames() == 4
    finally:
        reader.close()
