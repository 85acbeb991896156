"""Errors a user can fix. The CLI prints these as one line and exits non-zero, no traceback."""


class TerraError(Exception):
    """Base of every error that is the input's fault, not a bug."""
