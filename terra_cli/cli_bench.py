"""`terra bench`."""

from .cli import app, friendly_errors, not_implemented


@app.command()
@friendly_errors
def bench():
    """Benchmark the transformers reference against the vLLM backend."""
    not_implemented("bench")
