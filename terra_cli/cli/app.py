"""The Typer app, the two consoles, and the one error formatter every command goes through."""

from __future__ import annotations

import functools
import sys
import time

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from terra_cli.errors import USER_ERRORS

# Click's usage errors as this Typer raises them (Typer 0.2x carries a copy of Click of its own; older ones use
# Click itself): found from the one Typer exports, not imported by a path that depends on the version.
UsageError = next(kind for kind in typer.BadParameter.__mro__ if kind.__name__ == "UsageError")
NoArgsIsHelpError = getattr(sys.modules[UsageError.__module__], "NoArgsIsHelpError", ())


class OneLineUsageErrors(TyperGroup):
    """A mistyped command line (an unknown option, a value out of range, a missing argument) as one `error:`
    line naming the command's --help, exit 2, where Typer would draw a box of several lines. `terra` alone
    still prints the help."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError as exc:
            exc.show()
            raise SystemExit(exc.exit_code) from None
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "terra"
            error_line(f"{exc.format_message()} (see {where} --help)")
            raise SystemExit(EXIT_USER_ERROR) from None
        except typer.Abort:
            console.print("[yellow]interrupted[/]")
            raise SystemExit(EXIT_INTERRUPTED) from None
        raise SystemExit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineUsageErrors,
    name="terra",
    help="Run the Terra action-conditioned driving world model: tokenize frames, generate video, benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    epilog=("Examples:\n\n"
            "  terra generate out.mp4 --actions left --frames 25     # terra-mini, built in\n\n"
            "  terra generate --scenarios s.jsonl --out-dir videos/  # many videos\n\n"
            "  terra serve                                           # a page to drive it\n\n"
            "Docs: README.md, and docs/ in the terra repository (one page per topic)."),
    context_settings={"help_option_names": ["-h", "--help"]},
)
actions_app = typer.Typer(help="Convert and draw action trajectories.", no_args_is_help=True, epilog=(
    "Examples:\n\n"
    "  terra actions plot left left.png --frames 25       # a preset, drawn\n\n"
    "  terra actions convert act_bench.jsonl actions.npy  # to (frames, 6, 3)\n\n"
    "Docs: docs/actions.md"))
app.add_typer(actions_app, name="actions")

console = Console(stderr=True)
out = Console()
_state = {"debug": False, "verbose": False, "started": time.perf_counter()}

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130


def say(text: str) -> None:
    """A plain line on stderr: user-supplied text (paths, values) is never read as rich markup."""
    console.print(escape(text), highlight=False, soft_wrap=True)


def warn(message: str) -> None:
    """One `warning:` line on stderr; the command goes on."""
    console.print(f"[bold yellow]warning:[/] {escape(' '.join(str(message).split()))}", highlight=False, soft_wrap=True)


def warn_implausible(actions) -> None:
    from terra_cli.plausibility import implausible_actions

    for message in implausible_actions(actions):
        warn(f"actions {message}")


def error_line(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(' '.join(str(message).split()))}", highlight=False, soft_wrap=True)


def friendly_errors(fn):
    """The one error formatter: a user's mistake is one `error:` line and exit 2; anything else
    (a bug, or a failure we did not foresee) is one line naming it, exit 1; --debug re-raises
    for the traceback. Ctrl-C, SIGTERM and SIGHUP (see main) exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except USER_ERRORS as exc:
            if _state["debug"]:
                raise
            error_line(str(exc))
            raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:
            if _state["debug"]:
                raise
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except MemoryError:
            if _state["debug"]:
                raise
            error_line("out of memory: ask for fewer frames, rollouts or a smaller batch")
            raise typer.Exit(EXIT_USER_ERROR) from None
        except Exception as exc:  # the last line of defence, not a substitute for validation
            if _state["debug"]:
                raise
            error_line(f"unexpected {type(exc).__name__}: {exc} (this is a bug in terra or a failure it did not "
                       "foresee; run `terra --debug ...` for the traceback)")
            raise typer.Exit(EXIT_INTERNAL_ERROR) from None

    return wrapper


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    verbose: bool = typer.Option(False, "--verbose", help="Keep vLLM's INFO logs (engine set-up, compilation, ...); by default it logs only warnings and errors. VLLM_LOGGING_LEVEL in the environment wins over both."),
):
    from terra_cli.runtime import configure_vllm_env, quiet_dependency_deprecations

    _state["debug"] = debug
    _state["verbose"] = verbose
    _state["started"] = time.perf_counter()
    # Before any command imports vLLM or touches CUDA: a library caller does this itself.
    configure_vllm_env(verbose)
    _print_terra_logs()
    if not verbose:
        quiet_dependency_deprecations()



def _print_terra_logs() -> None:
    """terra's library code logs what a user should see (`terra.refiner`: how long its UNet took to
    compile; `terra.scenarios`: what an interrupted run still writes) at INFO; the CLI prints those
    lines as `say` does (one handler a logger, however many commands run)."""
    import logging

    class _Say(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            say(record.getMessage())

    for name in ("terra.refiner", "terra.scenarios"):
        logger = logging.getLogger(name)
        if not any(getattr(h, "terra_say", False) for h in logger.handlers):
            handler = _Say(logging.INFO)
            handler.terra_say = True
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
