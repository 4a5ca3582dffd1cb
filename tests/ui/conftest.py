"""The real-browser session shared by the JupyterLab tests of this folder (test_lab_e2e.py, then
test_lab_teaching.py): one JupyterLab server, one Chromium page at 1440x900, one Run All of the quickstart notebook.

`Session.shots(name)` takes a screenshot in JupyterLab's light theme and again in its dark theme (switched through
JupyterLab's own command), as test-artifacts/ui/<name>-light.png and <name>-dark.png.
"""

from __future__ import annotations

import re
import time

import pytest

from .lab import (ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, REPO, TOKEN, Lab, settle, skip_reason, switch_theme,
                  wait_run_all_done)

NOTEBOOK = REPO / "examples" / "01_quickstart.ipynb"
VIEWPORT = {"width": 1440, "height": 900}
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}


class Session:
    """The shared browser session: the Lab server, the page, and what the page reported."""

    def __init__(self, lab: Lab, page, errors: list[str], console: list[str]) -> None:
        self.lab, self.page, self.errors, self.console = lab, page, errors, console
        self.timings: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.theme = "light"

    def mark(self, name: str) -> None:
        self.timings[name] = round(time.monotonic() - self.t0, 2)

    def shot(self, name: str, **kw) -> None:
        self.page.screenshot(path=str(ARTIFACTS / name), **kw)

    def py(self, expr: str, timeout: float = 30.0) -> str:
        return self.lab.kernel_eval({"v": expr}, timeout=timeout)["v"]

    def run(self, code: str, timeout: float = 60.0) -> str:
        """Run statements in the kernel, silently; returns the repr of `_` if the code sets it."""
        return self.py(f"exec({code!r}, globals())", timeout=timeout)

    # ------------------------------------------------------------------------------------------ themes
    def set_theme(self, theme: str) -> None:
        """Switch JupyterLab's theme ("light" or "dark") and wait until the panels redrew in it."""
        if theme == self.theme:
            return
        switch_theme(self.page, THEMES[theme])
        self.theme = theme

    def shots(self, name: str, locator=None) -> None:
        """A 1440x900 screenshot in light and in dark (the named panel scrolled into view first)."""
        for theme in ("light", "dark"):
            self.set_theme(theme)
            if locator is not None:
                self.page.locator(locator).first.scroll_into_view_if_needed()
                settle(self.page)
            self.shot(f"{name}-{theme}.png")
        self.set_theme("light")


@pytest.fixture(scope="package")
def chromium():
    """One headless Chromium for every JupyterLab test of this folder: Playwright's sync API runs one instance per
    thread, and `lab_session` lives until the folder ends, while other modules open Labs of their own."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="package")
def lab_session(chromium):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # One torch thread in the kernel: Chromium and the server share the 2 CI cores, and torch's OpenMP threads
    # stall whenever one of them loses its core (measured: ~1.4 output tok/s with 2 threads vs ~20 with 1).
    lab = Lab([NOTEBOOK], env={"CBNB_CI": "1", "OMP_NUM_THREADS": "1"}).start()
    errors: list[str] = []
    console: list[str] = []
    try:
        page = chromium.new_page(viewport=VIEWPORT)
        try:
            # The message is what the tests assert on; the stack goes to the console log (which script threw).
            page.on("pageerror", lambda e: (errors.append(str(e)),
                                            console.append(f"pageerror: {getattr(e, 'stack', None) or e}")))
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            s = Session(lab, page, errors, console)
            page.goto(f"{lab.url}/lab/tree/{NOTEBOOK.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_function("""() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;
                return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
                       && w.sessionContext.kernelDisplayStatus === 'idle'; }""", timeout=90_000)
            s.mark("kernel idle")
            # In use, the browser runs on the user's machine and the engine on the server. Here both share
            # two cores, and the engine's compute threads would starve Chromium, so the latency measured
            # would be CPU contention. Lower the kernel's main thread before any model or engine thread
            # exists (threads inherit it); ipykernel's I/O threads, which relay messages, keep theirs.
            s.py("__import__('os').setpriority(__import__('os').PRIO_PROCESS, 0, 10)")
            page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            page.wait_for_selector(".cbnb-submit", timeout=120_000)
            s.mark("dashboard rendered")
            page.locator(".cbnb-plots").scroll_into_view_if_needed()  # charts draw only when on screen
            page.wait_for_selector(".cbnb-plots .js-plotly-plot", timeout=120_000)
            s.mark("plots rendered")
            wait_run_all_done(page)
            s.mark("run all done")
            yield s
        finally:
            (ARTIFACTS / "e2e_console.txt").write_text("\n".join(console + ["--- pageerrors:"] + errors))
            page.close()
    finally:
        lab.stop()
