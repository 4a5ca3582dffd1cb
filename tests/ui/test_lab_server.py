"""The server panel in a real JupyterLab through headless Chromium: a notebook serves a tiny engine and sends
traffic from a thread with the `openai` SDK; the panel's counters move live, "Copy" puts a working curl command on
the clipboard (Python sees the click), the request board names each request's source (the HTTP client's address,
or what a Python caller passed), a stopped server leaves the panel. Light and dark screenshots at 1440x900 go to
test-artifacts/ui/."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import nbformat
import pytest

from .lab import ARTIFACTS, REPO, TOKEN, Lab, settle, skip_reason, switch_theme, wait_run_all_done

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELLS = [
    f"""import sys, threading
sys.path.insert(0, {str(REPO / 'tests')!r})
import torch
torch.set_num_threads(1)
from helpers_server import make_engine
from cbnb.ui import RequestBoardPanel, ServerPanel
engine = make_engine()
server = engine.serve(port=0, model_name="tiny")
panel = ServerPanel(engine)
panel""",
    """board = RequestBoardPanel(engine)
board""",
    """import openai

def traffic(n):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    for _ in range(n):
        client.completions.create(model="tiny", prompt="hello world", max_tokens=16, temperature=0)

senders = [threading.Thread(target=traffic, args=(40,), daemon=True) for _ in range(3)]
for t in senders:
    t.start()""",
]


def _stat(page, name: str) -> str:
    return page.locator(f".cbnb-server [data-stat={name}] .cbnb-stat-value").first.text_content() or ""


def test_server_panel_live_copy_and_themes(chromium):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb_path = Path(tempfile.mkdtemp(prefix="cbnb-serve-nb-")) / "serve_panel.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, nb_path)
    lab = Lab([nb_path], env={"OMP_NUM_THREADS": "1"}).start()
    errors: list[str] = []
    try:
        ctx = chromium.new_context(viewport={"width": 1440, "height": 900},
                                   permissions=["clipboard-read", "clipboard-write"])
        try:
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab.url}/lab/tree/{nb_path.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_function("""() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;
                return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
                       && w.sessionContext.kernelDisplayStatus === 'idle'; }""", timeout=90_000)
            page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            page.wait_for_selector(".cbnb-server .cbnb-server-item", timeout=120_000)
            wait_run_all_done(page)
            url = json.loads(lab.kernel_eval({"u": "__import__('json').dumps(server.url)"})["u"].strip("'"))
            assert page.locator(".cbnb-server .cbnb-server-url").text_content() == url

            # Counters follow the notebook's traffic live (requests sent from a thread by the openai SDK).
            page.wait_for_function("""() => Number(document.querySelector(
                '.cbnb-server [data-stat=requests_total] .cbnb-stat-value').textContent) >= 10""",
                                   timeout=120_000)
            page.wait_for_function("""() => Number(document.querySelector(
                '.cbnb-server [data-stat=requests_per_s] .cbnb-stat-value').textContent) > 0""",
                                   timeout=60_000)
            assert _stat(page, "errors") == "0"
            page.locator(".cbnb-server").scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "server-panel-light.png"))

            # Copy: the clipboard holds the curl command shown, Python sees the click, and the command works.
            page.locator(".cbnb-server .cbnb-snippet[data-which=curl] .cbnb-copy").click()
            page.wait_for_function("""() => /Copied the curl snippet/.test(
                document.querySelector('.cbnb-server > .cbnb-message').textContent)""", timeout=30_000)
            assert "Copied the curl snippet" in lab.kernel_eval({"m": "panel.message"})["m"]
            copied = page.evaluate("() => navigator.clipboard.readText()")
            shown = page.locator(".cbnb-server .cbnb-snippet[data-which=curl] pre").text_content()
            assert copied == shown and url in copied
            out = subprocess.run(["bash", "-c", copied], capture_output=True, text=True, timeout=60)
            assert json.loads(out.stdout)["object"] == "chat.completion"

            switch_theme(page, "JupyterLab Dark")
            page.locator(".cbnb-server").scroll_into_view_if_needed()
            settle(page)
            page.screenshot(path=str(ARTIFACTS / "server-panel-dark.png"))

            # The request board names each request's source: the HTTP client's address, or what a Python
            # caller passed (here a request submitted from the kernel after the HTTP traffic).
            page.wait_for_function("""() => [...document.querySelectorAll(
                '.cbnb-board tr[data-id^="http-"] td.cbnb-col-source')].some(
                (td) => /^http 127[.]0[.]0[.]1:[0-9]+$/.test(td.textContent) && td.title === td.textContent)""",
                                   timeout=60_000)
            src = lab.kernel_eval({"s": "engine.submit('hello', max_new_tokens=4, source='kernel cell')"
                                        ".result(60).source"}, timeout=90)["s"]
            assert src == "'kernel cell'"
            page.wait_for_function("""() => [...document.querySelectorAll('.cbnb-board td.cbnb-col-source')]
                .some((td) => td.textContent === 'kernel cell')""", timeout=30_000)
            head = page.locator(".cbnb-board th", has_text=re.compile(r"^source$"))
            assert "client address" in (head.get_attribute("title") or "")
            page.locator(".cbnb-board").scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "board-source-dark.png"))
            switch_theme(page, "JupyterLab Light")
            page.locator(".cbnb-board").scroll_into_view_if_needed()
            settle(page)
            page.screenshot(path=str(ARTIFACTS / "board-source-light.png"))

            # A stopped server leaves the panel, which then says how to start one.
            lab.kernel_eval({"s": "server.stop()"})
            page.wait_for_function("""() => !document.querySelector('.cbnb-server .cbnb-server-item')
                && /Not serving/.test(document.querySelector('.cbnb-server .cbnb-empty').textContent)""",
                                   timeout=30_000)
            assert errors == [], errors
        finally:
            ctx.close()
    finally:
        lab.stop()
