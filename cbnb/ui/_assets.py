"""Front-end assets of the panels: ES modules and CSS from `widgets/` (shipped in the wheel as `cbnb.widgets`).

In a wheel the files live in the package `cbnb.widgets` (pyproject maps the top-level `widgets/` folder onto it);
in a checkout whose editable install predates that mapping they are read from `<repo>/widgets/` instead.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib

__all__ = ["read_asset", "esm", "css", "asset_origin"]

_CHECKOUT = pathlib.Path(__file__).resolve().parents[2] / "widgets"
_COMMON = "_common.js"


def _from_package(name: str) -> str | None:
    try:
        f = importlib.resources.files("cbnb.widgets") / name
        if f.is_file():
            return f.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def read_asset(name: str) -> str:
    """Text of a front-end file, e.g. ``read_asset("kvmap.js")``.

    Raises:
        FileNotFoundError: when neither the installed package nor the checkout has the file.
    """
    text = _from_package(name)
    if text is not None:
        return text
    path = _CHECKOUT / name
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"cbnb widget asset {name!r} not found in package cbnb.widgets nor in {_CHECKOUT}")


def asset_origin(name: str = "cbnb.css") -> str:
    """Where `name` is read from: "package" (installed `cbnb.widgets`) or "checkout"."""
    return "package" if _from_package(name) is not None else "checkout"


def esm(name: str) -> str:
    """A panel's ES module: the shared helpers (`_common.js`) followed by the panel's own module.

    No build step: the two files are concatenated, so each panel module can call the helpers directly.
    """
    return read_asset(_COMMON) + "\n" + read_asset(name)


def css() -> str:
    """The stylesheet shared by all panels."""
    return read_asset("cbnb.css")
