"""Terra's video refiner (the decoder behind its published ACT-Bench numbers), on diffusers' SVD parts.

Read from turingmotors/ACT-Bench (`Terra/configs/video_refiner/inference.yaml`, `Terra/generate.py`,
`Terra/video_refiner/`, derived from Stability's generative-models and Vista). Our own code:

- `config.py`: the shapes and settings, value for value;
- `unet.py`: the denoiser (diffusers `UNetSpatioTemporalConditionModel`);
- `autoencoder.py`: the KL autoencoder with the temporal decoder (`AutoencoderKLTemporalDecoder`);
- `sampler.py`: EDM Euler with per-frame linear guidance;
- `windows.py`: Terra's 25-frame windows and overlap removal;
- `keymap.py`, `checkpoint.py`: Terra's checkpoint names, strict loading without pickle;
- `refiner.py`: `VideoRefiner`; `decoder.py`: `RefinerDecoder` (tokens -> refined frames); `cost.py`: FLOPs
  and the CPU-time refusal;
- `testing.py`: tiny checkpoints in Terra's format.

The three questions the sources leave open, answered from them:
- the UNet's `context`: one all-zero token (Terra's wrapper builds it when no cross-attention
  embedder is configured); cross-attention over one key returns to_out(to_v(0)) = to_out's bias
  for every token (unet.py);
- `en_and_decode_n_samples_a_time: 1`: the temporal decoder decodes each latent frame alone
  (`timesteps=1`), so its time convolutions never mix frames (autoencoder.py);
- the token decoder: the world model's paired tokenizer, which generate.py puts in place of the
  one the config names (decoder.py).
And one the issue did not ask: Terra's unconditional guidance input equals the conditional one,
so the 1.5 -> 3.0 guidance changes nothing and one UNet call per step gives Terra's result
(sampler.py).

This code has never run on Turing's released refiner weights (they could not be downloaded where
it was written); the tests use small checkpoints written in Terra's exact names and layout.
"""

REFINER_INSTALL_HINT = "pip install 'terra-cli[refiner]'"


def require_diffusers() -> None:
    """The refiner's networks are diffusers' classes, an optional dependency."""
    from terra_cli.errors import import_extra

    import_extra("diffusers", f"Terra's video refiner needs diffusers, which is not installed: {REFINER_INSTALL_HINT}")
