"""`terra info`: a world model's config and size."""

from __future__ import annotations

from typing import Optional

import typer

from terra_cli.cli.app import app, friendly_errors, out


@app.command(epilog=(
    "Examples:\n\n"
    "  terra info                           # the embedded terra-mini\n\n"
    "  terra info path/to/world_model\n\n"
    "  terra info Terra/world_model_v2      # a local copy of turing-motors/Terra\n\n"
    "Docs: docs/models.md"))
@friendly_errors
def info(model: Optional[str] = typer.Argument(None, help="World-model directory or hub id (default: the embedded "
                                                            "terra-mini, as generate's).", show_default=False)):
    """Show a world model's config and size."""
    from rich.markup import escape

    from terra_cli.models.checkpoint import load_config, weight_files
    from terra_cli.models.resolve import resolve_world_model_dir
    from tokenizer_decoder.checkpoint import check_safetensors_header

    checkpoint_dir = resolve_world_model_dir(model)
    config = load_config(checkpoint_dir)
    files = weight_files(checkpoint_dir)
    for file in files:
        check_safetensors_header(file, floating_only=True)
    size = sum(f.stat().st_size for f in files)
    layout = config.layout
    out.print(f"[bold]{escape(str(checkpoint_dir))}[/]")
    out.print(f"  architecture   {config.architecture}")
    out.print(f"  decoder        {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"{config.num_attention_heads} heads ({config.num_key_value_heads} kv)")
    out.print(f"  image codes    {layout.image_vocab_size}, {layout.image_tokens} per frame")
    out.print(f"  actions        {layout.action_tokens} waypoints x {config.action_dim} per frame")
    out.print(f"  frames/round   {layout.max_frames}")
    out.print(f"  weights        {len(files)} file(s), {size / 1e6:.1f} MB")
