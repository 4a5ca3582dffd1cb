"""What a teacher's browser trial of the notebooks found (issue 40's closing trial), checked in the ESM harness
(headless Chromium, no Jupyter; see harness.py)."""

from __future__ import annotations

import pytest

from .harness import mount
from .lab import ARTIFACTS
from .test_esm_dashboard_fixes import config_panel, set_scale, set_theme
from .test_esm_harness import page, tiny_engine  # noqa: F401  (the module's browser page and tiny engine)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_config_code_import_line_wraps_beside_the_file_browser(page, tiny_engine, scale):
    """At 1440x900 with JupyterLab's file browser open (a notebook ~1050 px wide) the config's transformers code box
    is ~280 px wide (the config panel, beside the KV map, ~580 px): its import line's module path
    (`transformers.generation.configuration_utils`, one word of 45 characters) is wider than that, and the box
    scrolled sideways to show it. It now breaks inside the word."""
    panel = config_panel(tiny_engine)
    page.set_viewport_size({"width": 1050, "height": 900})
    try:
        mount(page, panel)
        page.evaluate("() => { document.getElementById('root').style.width = '580px'; }")
        set_scale(page, scale)
        page.wait_for_selector(".cbnb-config pre.cbnb-code")
        page.wait_for_function("() => document.querySelector('.cbnb-config pre.cbnb-code').textContent"
                               ".includes('configuration_utils')")
        for dark in (False, True):
            set_theme(page, dark)
            page.wait_for_timeout(100)
            box = page.evaluate("""() => { const p = document.querySelector('.cbnb-config pre.cbnb-code');
                return [p.scrollWidth, p.clientWidth]; }""")
            assert box[0] <= box[1] + 1, box  # no sideways scroll
            page.locator(".cbnb-config pre.cbnb-code").screenshot(
                path=str(ARTIFACTS / f"harness-config-code-580px-{scale:g}x-{'dark' if dark else 'light'}.png"))
    finally:
        set_theme(page, False)
        set_scale(page, 1.0)
        page.set_viewport_size({"width": 1000, "height": 1600})
