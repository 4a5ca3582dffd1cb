"""The flag lists the exports are checked against: data written by ``scripts/refresh_export_flags.py``.

Each file ``cbnb/export/data/<package>-<version>.json`` holds every option string of one release's CLI parser
(``flags``) and those that take no value (``switches``), read from the release's wheel with `ast` (nothing
imported). Never edit them by hand: re-run the script, which downloads the newest wheels (or takes paths).
``vllm-0.16.0.json`` (``--only vllm --vllm vllm==0.16.0``) is kept to show what changed since the version the
first mapping was checked against (``--swap-space`` was an option then).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["FlagList", "flag_list", "versions"]

DATA = pathlib.Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class FlagList:
    """One release's CLI options: `flags` (all option strings) and `switches` (those without a value)."""

    package: str
    version: str
    program: str
    flags: frozenset[str]
    switches: frozenset[str]
    source: str

    def __contains__(self, flag: str) -> bool:
        return flag in self.flags

    def unknown(self, args: list[str]) -> list[str]:
        """The options in an argument list (``--flag`` tokens) that this release does not have."""
        return [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in self.flags]


def _key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.replace("-", ".").split("."))


def versions(package: str) -> list[str]:
    """The versions with a flag list in the repository, oldest first."""
    return sorted((p.stem[len(package) + 1:] for p in DATA.glob(f"{package}-*.json")), key=_key)


@lru_cache(maxsize=None)
def flag_list(package: str, version: str | None = None) -> FlagList:
    """The flag list of `package` ("vllm", "sglang") at `version` (default: the newest one in the repository).

    Raises:
        ValueError: no list for that package or version (names the versions there are).
    """
    have = versions(package)
    if not have:
        raise ValueError(f"no flag list for {package!r} in {DATA} (run scripts/refresh_export_flags.py)")
    version = version or have[-1]
    if version not in have:
        raise ValueError(f"version must be one of {', '.join(have)} for {package}; got {version!r}")
    d = json.loads((DATA / f"{package}-{version}.json").read_text())
    return FlagList(d["package"], d["version"], d["program"], frozenset(d["flags"]), frozenset(d["switches"]),
                    f"{d['wheel']} ({d['parser']})")
