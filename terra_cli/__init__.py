"""terra: run the Terra action-conditioned driving world model, fast."""

__version__ = "0.1.0"
