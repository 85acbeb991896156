"""`terra actions convert` and `terra actions plot`."""

from .cli import actions_app, friendly_errors, not_implemented


@actions_app.command("convert")
@friendly_errors
def actions_convert():
    """Write the (frames, 6, 3) array an actions input becomes."""
    not_implemented("actions convert")


@actions_app.command("plot")
@friendly_errors
def actions_plot():
    """Draw the waypoints of each frame, top-down."""
    not_implemented("actions plot")
