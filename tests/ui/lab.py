"""Helpers for the real-browser tests: an isolated JupyterLab on 127.0.0.1, headless Debian Chromium, and a
silent side channel into the notebook's kernel (jupyter_client)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# --host-resolver-rules: without it Chromium still sends DNS queries for Google hosts (measured in the recipe).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1 , EXCLUDE localhost"]
TOKEN = "cbnb-test-token"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "ui"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Lab:
    """A JupyterLab server in a temp dir (own config, data, runtime, settings), started with Popen, stopped by PID."""

    def __init__(self, notebooks: list[Path], env: dict[str, str] | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="cbnb-lab-"))
        self.nbdir = self.tmp / "nb"
        self.nbdir.mkdir()
        for nb in notebooks:
            shutil.copy(nb, self.nbdir / nb.name)
        self.port = free_port()
        self.env = dict(os.environ, JUPYTER_CONFIG_DIR=str(self.tmp / "cfg"), JUPYTER_DATA_DIR=str(self.tmp / "data"),
                        JUPYTER_RUNTIME_DIR=str(self.tmp / "rt"), JUPYTERLAB_SETTINGS_DIR=str(self.tmp / "settings"),
                        JUPYTERLAB_WORKSPACES_DIR=str(self.tmp / "ws"), IPYTHONDIR=str(self.tmp / "ipy"),
                        TOKENIZERS_PARALLELISM="false", **(env or {}))
        s = self.tmp / "settings" / "@jupyterlab" / "apputils-extension"
        s.mkdir(parents=True)
        (s / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        self.proc: subprocess.Popen | None = None
        self._kc = None  # the kernel side channel's client (`_client`) and the kernel id it talks to
        self._kc_id: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Lab":
        jupyter = Path(sys.executable).parent / "jupyter"
        cmd = [str(jupyter), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={self.port}",
               f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={self.nbdir}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.expose_app_in_browser=True"]
        self.log = open(self.tmp / "lab.log", "w")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.nbdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={TOKEN}", timeout=1).read()
                return self
            except Exception:
                if self.proc.poll() is not None:
                    raise RuntimeError("jupyter lab exited:\n" + (self.tmp / "lab.log").read_text())
                time.sleep(0.1)
        raise RuntimeError("jupyter lab did not answer in time")

    def stop(self) -> None:
        """SIGTERM to the server's PID (it shuts its kernels down), then any child it left, by PID."""
        if self.proc is None:
            return
        self._close_client()
        try:
            import psutil

            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:
            kids = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for k in kids:
            try:
                if k.is_running():
                    k.terminate()
                    k.wait(5)
            except Exception:
                pass
        self.proc = None
        self.log.close()
        # Keep the server log for a failed run's diagnosis; drop the temp config, data and notebook copies.
        artifacts = Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"
        artifacts.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.tmp / "lab.log", artifacts / "lab.log")
        if not os.environ.get("CBNB_KEEP_LAB"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ kernel side channel
    def _client(self):
        """One shell-only client per notebook kernel, kept for the Lab's life. A client per call leaked: each new
        zmq context and heartbeat thread made the test process's descriptors spike to ~2,000 and a heartbeat
        thread died of "Too many open files" (seen in CI, then in 1 of ~70 calls of a plain loop)."""
        import jupyter_client

        with urllib.request.urlopen(f"{self.url}/api/sessions?token={TOKEN}") as r:
            kid = json.load(r)[0]["kernel"]["id"]
        if self._kc is not None and self._kc_id == kid:
            return self._kc
        self._close_client()
        kc = jupyter_client.BlockingKernelClient(connection_file=str(self.tmp / "rt" / f"kernel-{kid}.json"))
        kc.load_connection_file()
        kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        self._kc, self._kc_id = kc, kid
        return kc

    def _close_client(self) -> None:
        kc, self._kc = self._kc, None
        if kc is not None:
            kc.stop_channels()

    def kernel_eval(self, exprs: dict[str, str], timeout: float = 30.0) -> dict[str, str]:
        """Evaluate expressions silently in the (only) notebook kernel; returns their text/plain reprs."""
        kc = self._client()
        mid = kc.execute("", silent=True, store_history=False, user_expressions=exprs)
        deadline = time.monotonic() + timeout
        while True:  # replies to earlier calls that timed out are skipped here
            rep = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if rep["parent_header"].get("msg_id") == mid:
                break
        out = {}
        for k, v in rep["content"]["user_expressions"].items():
            if v.get("status") != "ok":
                raise RuntimeError(f"{k}: {v.get('ename')}: {v.get('evalue')}")
            out[k] = v["data"]["text/plain"]
        return out


def skip_reason() -> str | None:
    """Why the real-browser tests cannot run here (None: they can)."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not installed (scripts/setup.sh --browser)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "python playwright not installed"
    if shutil.which("jupyter", path=str(Path(sys.executable).parent)) is None:
        return "jupyter not installed in this environment"
    return None


# ---------------------------------------------------------------------------------------------- page helpers
def open_notebook(page, lab: "Lab", name: str, reset: bool = False) -> None:
    """Open a notebook of `lab` in `page` and wait until its kernel is idle. `reset`: in a fresh workspace (else
    tabs of notebooks opened before come back, in front of this one)."""
    page.goto(f"{lab.url}/lab/tree/{name}?{'reset&' if reset else ''}token={TOKEN}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_function("""() => { const w = window.jupyterapp && jupyterapp.shell.currentWidget;
        return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
               && w.sessionContext.kernelDisplayStatus === 'idle'; }""", timeout=90_000)


def run_all(page) -> None:
    """Run ▸ Run All Cells, through the real menu."""
    import re

    page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def wait_run_all_done(page, timeout_ms: int = 240_000) -> None:
    """Wait until a Run All has finished: the kernel idle and every code cell numbered.

    Raises:
        AssertionError: a cell showed an error (at once: the cells after it would never be numbered).
    """
    # Run All leaves the kernel briefly idle between cells: also require every code cell to show "[n]".
    page.wait_for_function("""() => {
        if (document.querySelector('.jp-OutputArea [data-mime-type="application/vnd.jupyter.error"]'))
            return true;
        const w = window.jupyterapp && jupyterapp.shell.currentWidget;
        if (!w || w.sessionContext.kernelDisplayStatus !== 'idle') return false;
        const prompts = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'));
        return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
    }""", timeout=timeout_ms)
    err = page.evaluate("""() => { const e = document.querySelector(
        '.jp-OutputArea [data-mime-type="application/vnd.jupyter.error"]'); return e ? e.textContent : null; }""")
    assert err is None, f"a cell failed during Run All:\n{err[-3000:]}"


def outputs_text(page) -> str:
    """The text of every cell output of the open notebook (streams, markdown, HTML, plain text). textContent, not
    innerText: JupyterLab skips the layout of cells off screen (content-visibility), and innerText is empty there."""
    return page.evaluate("""() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
        .map(e => e.textContent).join('\\n')""")


# The dashboard's charts on screen are drawn in the page's current theme (plotly's font colour is the theme's
# --jp-ui-font-color1; a chart that came on screen is drawn once visible), and the panels' 150 ms debounce after a
# theme switch (widgets/_common.js, cbnbOnTheme) has passed, so their canvases redrew too.
_SETTLED = """() => {
    if (performance.now() - (window.__cbnbThemeAt || 0) < 250) return false;
    const fg = getComputedStyle(document.body).getPropertyValue('--jp-ui-font-color1').trim();
    // Visible as the charts' IntersectionObserver sees it: inside the viewport and the scrolling notebook panel.
    const onScreen = (e) => { const r = e.getBoundingClientRect();
        let top = 0, bottom = innerHeight;
        // (not the body: its overflow applies to the viewport, and its own box may be 0 px high, which clipped
        // every chart out and made this check pass on no chart at all)
        for (let a = e.parentElement; a && a !== document.body; a = a.parentElement) {
            if (/(auto|scroll|hidden)/.test(getComputedStyle(a).overflowY)) {
                const q = a.getBoundingClientRect(); top = Math.max(top, q.top); bottom = Math.min(bottom, q.bottom); }
        }
        return r.width > 0 && r.height > 0 && r.bottom > top && r.top < bottom; };
    return Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).filter(onScreen)
        .every(g => g.layout && g.layout.font && String(g.layout.font.color).trim() === fg);
}"""

_LATE = """() => {
    const fg = getComputedStyle(document.body).getPropertyValue('--jp-ui-font-color1').trim();
    return {fg, since_theme_ms: performance.now() - (window.__cbnbThemeAt || 0),
            charts: Array.from(document.querySelectorAll('.cbnb-plots .js-plotly-plot')).map((g, i) => {
                const r = g.getBoundingClientRect();
                return {i, top: Math.round(r.top), h: Math.round(r.height), w: Math.round(r.width),
                        color: g.layout && g.layout.font ? String(g.layout.font.color) : null}; })};
}"""


def settle(page, timeout_ms: int = 15_000) -> None:
    """Before a screenshot: wait until the panels on screen have redrawn (theme switch, scroll, resize). The
    screenshot is taken anyway when they have not by `timeout_ms` (a busy machine draws late: a worse picture, not a
    failed test)."""
    try:
        page.wait_for_function(_SETTLED, timeout=timeout_ms, polling="raf")
    except Exception:  # playwright's TimeoutError: screenshots are artifacts, not assertions; say what was late
        late = page.evaluate(_LATE)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        with open(ARTIFACTS / "settle_timeouts.txt", "a") as f:
            f.write(json.dumps({"t": time.strftime("%H:%M:%S"), "late": late}) + "\n")


def switch_theme(page, theme_name: str) -> None:
    """Switch JupyterLab's theme through its own command ("JupyterLab Light" / "JupyterLab Dark") and wait until the
    page is in it and the panels have redrawn."""
    page.evaluate("(t) => { window.__cbnbThemeAt = performance.now();"
                  " return window.jupyterapp.commands.execute('apputils:change-theme', {theme: t}); }", theme_name)
    page.wait_for_function("(t) => document.body.dataset.jpThemeName === t", arg=theme_name, timeout=30_000)
    # JupyterLab shows a splash during a theme change and removes it 200 ms after the change ends, once per change:
    # two changes within those 200 ms remove it twice, and the second throws "Failed to execute 'removeChild'" in
    # jlab_core (JupyterLab 4's apputils splash). Wait until it is gone, so that switches never overlap.
    page.wait_for_function("() => !document.getElementById('jupyterlab-splash')", timeout=30_000)
    settle(page)
