"""A plain run prints no deprecation: the reference backend passes its KV cache under the name the
installed transformers takes (`cache` from 5.24, `past_key_values` before; models/modeling_hf.py).
The plain `--backend hf` generate with FutureWarning/DeprecationWarning as errors is
tests/test_generate.py's default-model run (with --save-tokens and --save-frames)."""

import inspect
import warnings

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
