"""A plotly template that reads in JupyterLab's light and dark themes alike (the summary charts of the notebooks).

Plotly's stock template paints white paper and a light-blue plot area, which stay white in JupyterLab's dark theme:
the figure is drawn in the browser by JupyterLab's plotly renderer, which knows nothing of the theme, and the kernel
cannot know which theme a page shows (nor follow a later switch). So the "cbnb" template draws no background at all
(the notebook's own background shows through, light or dark) and uses mid-grey text, axes and grid lines, whose
contrast is about 4.3:1 on white and on JupyterLab's dark background. Trace colours keep plotly's colourway, which
reads on both.

`use_theme_template()` makes it plotly's default on top of the current one (``"plotly+cbnb"``), unless the user has
chosen another default template already; notebooks 03 and 04 call it.
"""

from __future__ import annotations

__all__ = ["TEMPLATE_NAME", "FONT_COLOR", "theme_template", "use_theme_template"]

TEMPLATE_NAME = "cbnb"
#: Text colour: contrast 4.3:1 on white (#ffffff) and 4.4:1 on JupyterLab's dark background (#111111).
FONT_COLOR = "#7a7a7a"
_GRID = "rgba(128, 128, 128, 0.28)"
_LINE = "rgba(128, 128, 128, 0.6)"
_CLEAR = "rgba(0, 0, 0, 0)"


def theme_template():
    """The "cbnb" `plotly.graph_objects.layout.Template`: transparent backgrounds, grey text, axes and grid.

    Raises:
        ImportError: plotly is not installed.
    """
    import plotly.graph_objects as go

    axis = {"gridcolor": _GRID, "linecolor": _LINE, "zerolinecolor": _LINE, "tickcolor": _LINE,
            "title": {"font": {"color": FONT_COLOR}}, "tickfont": {"color": FONT_COLOR}}
    return go.layout.Template(layout={
        "paper_bgcolor": _CLEAR, "plot_bgcolor": _CLEAR, "font": {"color": FONT_COLOR},
        "title": {"font": {"color": FONT_COLOR}}, "legend": {"bgcolor": _CLEAR, "font": {"color": FONT_COLOR}},
        "xaxis": axis, "yaxis": axis, "polar": {"bgcolor": _CLEAR}, "ternary": {"bgcolor": _CLEAR},
        "scene": {"xaxis": {"backgroundcolor": _CLEAR}, "yaxis": {"backgroundcolor": _CLEAR},
                  "zaxis": {"backgroundcolor": _CLEAR}},
        "coloraxis": {"colorbar": {"tickfont": {"color": FONT_COLOR}}},
    })


def use_theme_template(force: bool = False) -> bool:
    """Register the "cbnb" template and make ``"<current>+cbnb"`` plotly's default, so that every figure made from
    then on reads in both JupyterLab themes.

    Args:
        force: also when the user has set a default other than plotly's stock ones ("plotly", "plotly_white").

    Returns:
        True when the default now includes "cbnb"; False when plotly is missing or another default was kept.
    """
    try:
        import plotly.io as pio
    except ImportError:
        return False
    if TEMPLATE_NAME not in pio.templates:
        pio.templates[TEMPLATE_NAME] = theme_template()
    current = pio.templates.default or ""
    parts = current.split("+") if current else []
    if TEMPLATE_NAME in parts:
        return True
    if not force and current not in ("", "plotly", "plotly_white"):
        return False  # the user picked a template (e.g. "plotly_dark"): leave it
    pio.templates.default = "+".join(parts + [TEMPLATE_NAME])
    return True
