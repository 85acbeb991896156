"""Options shared by several commands (terra_cli/cli_options.py) read the same everywhere."""

import typer.main

from terra_cli import actions
from terra_cli.cli import options as cli_options
from terra_cli.cli import app
from terra_cli.backends.base import Sampling

SHARED = {
    "temperature": ["generate", "bench"],
    "top_k": ["generate", "eval"],
    "top_p": ["generate", "eval"],
    "backend": ["generate", "eval"],
    "device": ["generate", "eval", "bench", "tokenize"],
    "dtype": ["generate", "eval", "bench"],
    "speed": ["generate", "eval"],
    "overwrite": ["generate", "eval", "bench", "tokenize"],
    "draft": ["generate", "bench"],
    "draft_tokens": ["generate", "bench"],
    "torch_compile": ["generate", "bench"],
    "refiner_windows": ["generate", "bench"],
}


def _params(command: str) -> dict:
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


def test_shared_options_are_declared_once():
    for name, commands in SHARED.items():
        seen = {(tuple(p.opts), tuple(p.secondary_opts), p.default, p.help)
                for p in (_params(c)[name] for c in commands)}
        assert len(seen) == 1, (name, seen)


def test_shared_defaults_match_the_library():
    assert cli_options.DEFAULT_SPEED_KMH == actions.DEFAULT_SPEED_KMH
    assert cli_options.TERRA_TEMPERATURE == Sampling().temperature
    from terra_cli.backends.vllm import MAX_DRAFT_TOKENS

    assert cli_options.MAX_DRAFT_TOKENS == MAX_DRAFT_TOKENS
    assert _params("eval")["temperature"].default == 0.0  # eval stays greedy by default
    assert _params("generate")["overwrite"].secondary_opts == ["--no-overwrite"]


def test_progress_bars_show_a_rate_and_fit_80_columns():
    """Rate and ETA on every bar (the guide's rule), whole at 80 columns: the long labels cut them to '0:00:…'."""
    import io
    import time

    from rich.console import Console

    from terra_cli.cli.progress import StepProgress, TaskProgress

    for make in (lambda c: TaskProgress(c, "scenarios", 8, unit="generated frames"),
                 lambda c: StepProgress(c, "decoding", 8)):
        buffer = io.StringIO()
        console = Console(file=buffer, width=80, force_terminal=False)
        with make(console) as bar:
            for _ in range(8):
                time.sleep(0.16)  # StepProgress shows itself after a second
                (bar.advance(1, note="3 of 8 written") if isinstance(bar, TaskProgress) else bar.advance(1))
        last = [line for line in buffer.getvalue().splitlines() if "8/8" in line][-1]
        assert "/s" in last and "…" not in last, last
