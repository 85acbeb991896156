"""`terra actions convert` and `terra actions plot`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from terra_cli.cli.app import actions_app, console, friendly_errors, warn_implausible
from terra_cli.cli.options import DEFAULT_SPEED_KMH

_INPUT_HELP = (
    "Actions: .npy (frames, 6, 3) or (frames*6, 3); ACT-Bench .json/.jsonl with 'instruction_trajs' "
    "(first sample); or a preset: straight, left, right, stop, accelerate."
)
_FRAMES_HELP = "Frames to produce for a preset (needed there); for a file, keep at most this many."
_SPEED_HELP = "Preset speed in km/h (start speed for stop and accelerate)."
_PLOT_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")


def _speed_option():
    return typer.Option(DEFAULT_SPEED_KMH, "--speed", "-s", help=_SPEED_HELP)


@actions_app.command(
    "convert",
    epilog=(
        "Examples:\n\n"
        "  terra actions convert left --frames 25 --speed 20 left.npy\n\n"
        "  terra actions convert act_bench.jsonl acts.npy --frames 47\n\n"
        "  terra actions convert acts_flat.npy acts.npy --overwrite\n\n"
        "Docs: docs/actions.md"
    ),
)
@friendly_errors
def actions_convert(
    input: str = typer.Argument(..., help=_INPUT_HELP, show_default=False),
    output: Path = typer.Argument(..., help="The .npy to write: (frames, 6, 3) float32.", show_default=False),
    frames: Optional[int] = typer.Option(None, "--frames", "-n", help=_FRAMES_HELP),
    speed: float = _speed_option(),
    overwrite: bool = typer.Option(False, help="Replace OUTPUT if it exists."),
):
    """Write the (frames, 6, 3) float32 array an actions input becomes."""
    import numpy as np

    from terra_cli.actions import resolve_actions, summarize_actions
    from terra_cli.media.atomic import OutputError, atomic_save_npy

    if output.suffix.lower() != ".npy":
        raise OutputError(f"{output}: the output must be a .npy file")
    _plan(input, output, overwrite)
    actions = resolve_actions(input, frames=frames, speed_kmh=speed)
    s = summarize_actions(actions)  # everything is checked before the file is written
    warn_implausible(actions)
    atomic_save_npy(output, actions.astype(np.float32), overwrite=overwrite)
    side = "left" if s.lateral_m > 0.005 else "right" if s.lateral_m < -0.005 else "centre"
    console.print(
        f"{s.frames} frames; {s.forward_m:.1f} m forward in total; final lateral offset "
        f"{s.lateral_m:+.2f} m ({side}) -> {output}",
        highlight=False, soft_wrap=True,
    )


@actions_app.command(
    "plot",
    epilog=(
        "Examples:\n\n"
        "  terra actions plot right --frames 25 --speed 40 right.png\n\n"
        "  terra actions plot act_bench.jsonl sample0.png\n\n"
        "  terra actions plot acts.npy acts.png --overwrite\n\n"
        "Docs: docs/actions.md"
    ),
)
@friendly_errors
def actions_plot(
    input: str = typer.Argument(..., help=_INPUT_HELP, show_default=False),
    output: Path = typer.Argument(..., help="Picture to write: .png (or .jpg, .svg, .pdf).", show_default=False),
    frames: Optional[int] = typer.Option(None, "--frames", "-n", help=_FRAMES_HELP),
    speed: float = _speed_option(),
    overwrite: bool = typer.Option(False, help="Replace OUTPUT if it exists."),
):
    """Draw each frame's waypoints top-down: lateral across (left on the left), forward up."""
    from terra_cli.actions import resolve_actions
    from terra_cli.media.atomic import OutputError, save_figure

    if output.suffix.lower() not in _PLOT_SUFFIXES:
        raise OutputError(f"{output}: the picture must end in {', '.join(_PLOT_SUFFIXES)}")
    _plan(input, output, overwrite)
    actions = resolve_actions(input, frames=frames, speed_kmh=speed)
    fig = draw_actions(actions, title=f"{input}  ({actions.shape[0]} frames)")
    save_figure(fig, output, overwrite, dpi=120)
    console.print(f"{actions.shape[0]} frames drawn -> {output}", highlight=False, soft_wrap=True)


def _plan(input: str, output: Path, overwrite: bool) -> None:
    import os

    from terra_cli.pipeline.outputs import OutputPlan

    plan = OutputPlan(overwrite)
    plan.input("INPUT", Path(input) if os.path.lexists(input) else None)
    plan.file("OUTPUT", output)


def draw_actions(actions, title: str = ""):
    """A matplotlib Figure (Agg canvas, no pyplot state) of the waypoints of every frame."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    n = actions.shape[0]
    fig = Figure(figsize=(6, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    norm = Normalize(vmin=0, vmax=max(n - 1, 1))
    for k in range(n):
        ys = np.concatenate([[0.0], actions[k, :, 0]])
        xs = np.concatenate([[0.0], actions[k, :, 1]])
        ax.plot(ys, xs, color=cmap(norm(k)), linewidth=1.2, marker="o", markersize=2.5, alpha=0.85)
    ax.plot([0.0], [0.0], marker="^", color="black", markersize=9, linestyle="none", label="ego (each frame)")
    ax.set_aspect("equal", adjustable="datalim")
    ax.invert_xaxis()  # positive y is to the left: draw it on the left
    ax.set_xlabel("lateral y (m, left +)")
    ax.set_ylabel("forward x (m)")
    ax.grid(True, linewidth=0.4, alpha=0.5)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10, parse_math=False)  # a file name with $ is not mathtext
    mappable = ScalarMappable(norm=norm, cmap=cmap)
    mappable.set_array([])
    fig.colorbar(mappable, ax=ax, label="frame index")
    return fig
