"""`terra tokenize`."""

from .cli import app, friendly_errors, not_implemented


@app.command()
@friendly_errors
def tokenize():
    """Frames <-> tokens with Terra's image tokenizer."""
    not_implemented("tokenize")
