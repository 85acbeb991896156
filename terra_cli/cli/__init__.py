"""The `terra` command line: one thin module per command over the library (terra_cli.pipeline,
terra_cli.backends, ...). Commands register on `app` when imported here, and only here."""

from __future__ import annotations

import signal
import sys

from terra_cli.cli.app import actions_app, app  # noqa: F401
from terra_cli.cli import actions, bench, eval, generate, info, refine, serve, tokenize  # noqa: F401,E402  (registers the commands)


def _interrupt(signum, frame):
    # SIGTERM (timeout, job schedulers) and SIGHUP behave like Ctrl-C: every command's cleanup
    # (temporary files removed, finished frames saved) runs on KeyboardInterrupt.
    raise KeyboardInterrupt


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    app()


if __name__ == "__main__":
    sys.exit(main())
