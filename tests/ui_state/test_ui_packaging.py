"""The panels' front-end files ship inside the wheel (package `cbnb.widgets`) and load from an installed copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

try:
    import tomllib
except ImportError:  # pragma: no cover - Python < 3.11
    tomllib = None


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_cbnb_package_is_listed_for_the_wheel():
    # pyproject lists packages explicitly (so widgets/ can be mapped); a new subpackage must be added there.
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.relative_to(REPO).parts) for p in (REPO / "cbnb").rglob("*")
             if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))} | {"cbnb"}
    missing = found - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_every_data_folder_is_listed_too():
    """A folder of data files inside a package must be a listed package too: else setuptools prints a 35-line
    "Package ... is absent from the `packages` configuration" warning at set-up (issue 40), which a newcomer reads
    as a broken install."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    data = {".".join(p.relative_to(REPO).parts) for p in (REPO / "cbnb").rglob("*")
            if p.is_dir() and p.name != "__pycache__" and any(f.is_file() for f in p.iterdir())}
    missing = data - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_widgets_folder_is_mapped_and_complete():
    st = _pyproject()["tool"]["setuptools"]
    assert "cbnb.widgets" in st["packages"] and st["package-dir"]["cbnb.widgets"] == "widgets"
    assert set(st["package-data"]["cbnb.widgets"]) >= {"*.js", "*.css"}
    for name in ("_common.js", "cbnb.css", "submit.js", "stream.js", "board.js", "kvmap.js", "plots.js", "config.js"):
        assert (REPO / "widgets" / name).is_file(), name


@pytest.mark.slow
def test_wheel_ships_widgets_and_loads_them_installed(tmp_path):
    """Build a wheel from a copy of the sources, install it (no deps) into a fresh target, import it from there."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for d in ("cbnb", "widgets"):
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("cbnb-*.whl"))
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp_path)
    assert (site / "cbnb" / "widgets" / "kvmap.js").is_file()
    check = textwrap.dedent(f"""
        import cbnb, cbnb.ui._assets as a
        from cbnb.ui.kvmap import KVPageMapPanel
        assert cbnb.__file__.startswith({str(site)!r}), cbnb.__file__
        assert a.asset_origin() == "package", a.asset_origin()
        assert a.read_asset("kvmap.js") == open({str(REPO / "widgets" / "kvmap.js")!r}).read()
        assert "export default" in KVPageMapPanel._esm and "cbnbFrame" in KVPageMapPanel._esm
        print("ok", cbnb.__file__)
    """)
    env = dict(os.environ, PYTHONPATH=str(site))
    res = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ok")
