"""The README's main-job command starts a JupyterLab that serves the quickstart notebook, and stops cleanly."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_names_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [b.strip() for b in blocks]
    assert "scripts/quickstart.sh" in commands and "scripts/test.sh" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_quickstart_command_serves_the_notebook(tmp_path):
    port, token = _free_port(), "cbnb-test-token"
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "cfg"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "rt"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "ws"),
                     ("IPYTHONDIR", "ipy")):
        env[var] = str(tmp_path / sub)
    # Reuse this environment: reinstalling cbnb here would delete the files this test process imports from
    # (it made later tests fail in CI). The set-up itself runs in full in CI's own `scripts/test.sh`.
    env["CBNB_SETUP_REUSE"] = "1"
    log = open(tmp_path / "quickstart.log", "w")
    proc = subprocess.Popen(
        # An --ip of our own replaces the script's default (jupyter refuses two): the README's remote set-up.
        [str(ROOT / "scripts" / "quickstart.sh"), "--ip=localhost", f"--port={port}",
         f"--IdentityProvider.token={token}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600  # set-up may install packages on a fresh machine
        while True:
            assert proc.poll() is None, "quickstart exited early:\n" + (tmp_path / "quickstart.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "JupyterLab never became ready"
            time.sleep(0.2)
        url = f"{base}/api/contents/01_quickstart.ipynb?token={token}&content=1"
        with urllib.request.urlopen(url, timeout=10) as r:
            nb = json.load(r)
        assert nb["type"] == "notebook" and nb["content"]["cells"]
        with urllib.request.urlopen(f"{base}/lab/tree/01_quickstart.ipynb?token={token}", timeout=10) as r:
            assert r.status == 200 and "JupyterLab" in r.read().decode()
        log_text = (tmp_path / "quickstart.log").read_text()
        assert f"Serving notebooks from local directory: {ROOT / 'examples'}" in log_text
        assert f"http://localhost:{port}/lab" in log_text and "token=" in log_text  # the URL the README points to
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
    assert proc.returncode is not None
