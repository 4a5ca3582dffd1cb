#!/usr/bin/env python
"""Regenerate the flag lists `cbnb.export` checks its commands against (cbnb/export/data/<pkg>-<version>.json).

    python scripts/refresh_export_flags.py                      # pip download --no-deps the newest vllm and sglang
    python scripts/refresh_export_flags.py --vllm vllm==0.33.0  # a pinned version
    python scripts/refresh_export_flags.py --vllm path/to/vllm-0.33.0-...whl --sglang path/to/sglang-...whl

Nothing is imported from the packages (they need GPUs and hundreds of dependencies): the wheels are read as zip files
and their CLI definitions are parsed with `ast`, following how each release builds its parser:

- vLLM (``vllm serve``): ``make_arg_parser`` (vllm/entrypoints/common/cli_args.py, or openai/cli_args.py in older
  releases) adds a few ``add_argument`` calls of its own, then ``FrontendArgs.add_cli_args`` (one ``--field-name``
  per dataclass field of FrontendArgs and its bases) and ``AsyncEngineArgs.add_cli_args``, which calls
  ``EngineArgs.add_cli_args`` (vllm/engine/arg_utils.py): literal ``add_argument("--flag", **kwargs["field"])`` calls
  whose kwargs come from ``get_kwargs(SomeConfig)``. A field whose type contains ``bool`` (other than
  ``bool | str | None``) becomes ``argparse.BooleanOptionalAction``, which also adds ``--no-<flag>``.
- SGLang (``python -m sglang.launch_server``): ``ServerArgs.add_cli_args`` (sglang/srt/server_args.py) calls
  ``add_cli_args_from_dataclass`` over the namespaces in ``_INPUT_NAMESPACES`` (classes in
  sglang/srt/arg_groups/fields/): every field annotated ``A[T, "help"]`` or ``A[T, Arg(...)]`` is a flag
  (``Arg.cli_name`` or ``--field-name``, plus ``Arg.aliases``; ``Arg(no_cli=True)`` is skipped), then adds a few
  ``add_argument`` calls of its own (deprecated spellings among them).

The output lists every option string and, separately, those that take no value (``switches``). If a release changes
how its parser is built, this script fails loudly (a flag everyone has, e.g. ``--max-num-seqs``, goes missing)
rather than writing a short list.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Iterable

OUT = pathlib.Path(__file__).resolve().parents[1] / "cbnb" / "export" / "data"

#: Flags each parser must have: a sanity check that the extraction followed the release's parser.
MUST_HAVE = {
    "vllm": {"--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--seed", "--port", "--enforce-eager"},
    "sglang": {"--model-path", "--page-size", "--max-running-requests", "--port", "--mem-fraction-static"},
}


# ------------------------------------------------------------------------------------------------ wheels
def fetch_wheel(spec: str, dest: str) -> pathlib.Path:
    """`spec` is a path to a wheel, or a requirement (``vllm``, ``vllm==0.33.0``) fetched with pip --no-deps."""
    p = pathlib.Path(spec)
    if p.suffix == ".whl" and p.exists():
        return p
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest, spec],
                   check=True, stdout=sys.stderr)
    name = re.split(r"[<>=!~ \[]", spec, maxsplit=1)[0].replace("-", "_").lower()
    found = sorted(pathlib.Path(dest).glob(f"{name}-*.whl"))
    if not found:
        raise SystemExit(f"pip download {spec!r} gave no wheel in {dest}")
    return found[-1]


def wheel_version(path: pathlib.Path, zf: zipfile.ZipFile) -> str:
    for n in zf.namelist():
        if n.endswith(".dist-info/METADATA"):
            for line in zf.read(n).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return path.name.split("-")[1]


class Source:
    """The .py files of a wheel, parsed on demand, with an index of class definitions by name."""

    def __init__(self, zf: zipfile.ZipFile) -> None:
        self.zf = zf
        self.names = set(zf.namelist())
        self._trees: dict[str, ast.Module] = {}
        self.classes: dict[str, ast.ClassDef] = {}

    def tree(self, name: str) -> ast.Module:
        if name not in self._trees:
            self._trees[name] = ast.parse(self.zf.read(name).decode("utf-8"), filename=name)
        return self._trees[name]

    def index(self, names: Iterable[str]) -> None:
        for n in names:
            for node in ast.walk(self.tree(n)):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, node)

    def glob(self, prefix: str) -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(".py"))


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def _lineage(src: Source, cls_name: str) -> list[ast.ClassDef]:
    """The class and its bases found in the index, most derived first."""
    out, todo = [], [cls_name]
    while todo:
        c = src.classes.get(todo.pop(0))
        if c is None or c in out:
            continue
        out.append(c)
        todo += [b.id for b in c.bases if isinstance(b, ast.Name)]
    return out


def _fields(src: Source, cls_name: str) -> dict[str, ast.expr]:
    """Annotated class-body fields (name -> annotation) of a class and its bases, ClassVars and init=False left out."""
    out: dict[str, ast.expr] = {}
    for c in reversed(_lineage(src, cls_name)):
        for node in c.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ann = ast.unparse(node.annotation)
                if "ClassVar" in ann:
                    continue
                if isinstance(node.value, ast.Call) and any(
                        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                        for k in node.value.keywords):
                    continue
                out[node.target.id] = node.annotation
    return out


def _options(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            and a.value.startswith("-")]


def _is_add_argument(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument")


# ------------------------------------------------------------------------------------------------ vLLM
def _vllm_bool(ann: ast.expr) -> bool:
    """get_kwargs' rule: a type containing bool -> BooleanOptionalAction, except ``bool | str | None``."""
    names = {n.id for n in ast.walk(ann) if isinstance(n, ast.Name)} | {
        n.value for n in ast.walk(ann) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return "bool" in names and not (names >= {"bool", "str"})


def _action(call: ast.Call) -> str | None:
    for k in call.keywords:
        if k.arg == "action":
            return ast.unparse(k.value)
    return None


def _kwargs_source(call: ast.Call, kw_vars: dict[str, str]) -> tuple[str, str] | None:
    """(config class, field) behind ``**x_kwargs["field"]`` or ``**{**x_kwargs["field"], ...}``."""
    for k in call.keywords:
        if k.arg is not None:
            continue
        v = k.value
        if isinstance(v, ast.Dict):
            for key, val in zip(v.keys, v.values):
                if key is None:
                    v = val
                    break
        if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id in kw_vars \
                and isinstance(v.slice, ast.Constant):
            return kw_vars[v.value.id], v.slice.value
    return None


def _dict_override(call: ast.Call, key: str) -> ast.expr | None:
    for k in call.keywords:
        if k.arg is None and isinstance(k.value, ast.Dict):
            for dk, dv in zip(k.value.keys, k.value.values):
                if isinstance(dk, ast.Constant) and dk.value == key:
                    return dv
    return None


def _vllm_function(src: Source, fn: ast.FunctionDef, cls_name: str | None, flags: set, switches: set,
                   seen: set) -> None:
    """Flags a parser-building function adds: its literal add_argument calls, the classes' add_cli_args it calls,
    and, for a loop that adds ``--{field}`` per ``get_kwargs(cls)`` entry, every field of `cls_name`."""
    kw_vars: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and node.value.func.id == "get_kwargs" and node.value.args:
            arg = node.value.args[0]
            target = node.targets[0]
            if isinstance(target, ast.Name):
                kw_vars[target.id] = cls_name if isinstance(arg, ast.Name) and arg.id == "cls" else ast.unparse(arg)
    for node in ast.walk(fn):
        if _is_add_argument(node):
            opts = _options(node)
            if opts:
                action = _action(node)
                ov = _dict_override(node, "action")
                if ov is not None:
                    action = ast.unparse(ov)
                src_field = _kwargs_source(node, kw_vars)
                if action is None and src_field is not None:
                    ann = _fields(src, src_field[0]).get(src_field[1])
                    if ann is not None and _vllm_bool(ann):
                        action = "argparse.BooleanOptionalAction"
                _add(opts, action, flags, switches)
            elif any(isinstance(a, ast.JoinedStr) for a in node.args):
                # for key, value in frontend_kwargs.items(): add_argument(f"--{key.replace('_', '-')}", **value)
                if cls_name is None:
                    raise SystemExit(f"line {node.lineno}: a per-field add_argument outside a class method")
                for name, ann in _fields(src, cls_name).items():
                    if name.startswith("_"):
                        continue
                    _add(["--" + name.replace("_", "-")],
                         "argparse.BooleanOptionalAction" if _vllm_bool(ann) else None, flags, switches)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_cli_args" \
                and isinstance(node.func.value, ast.Name):
            _vllm_class(src, node.func.value.id, flags, switches, seen)


def _vllm_class(src: Source, cls_name: str, flags: set, switches: set, seen: set) -> None:
    if cls_name in seen:
        return
    seen.add(cls_name)
    for c in _lineage(src, cls_name):
        fn = _method(c, "add_cli_args")
        if fn is not None:
            _vllm_function(src, fn, cls_name, flags, switches, seen)
            return
    raise SystemExit(f"{cls_name}.add_cli_args not found in the wheel's source")


def _add(opts: list[str], action: str | None, flags: set, switches: set) -> None:
    flags.update(opts)
    a = (action or "").strip("'\"")
    if a.endswith("BooleanOptionalAction"):
        no = ["--no-" + o[2:] for o in opts if o.startswith("--")]
        flags.update(no)
        switches.update(opts + no)
    elif a in ("store_true", "store_false", "store_const", "count") or "StoreTrue" in a or "StoreConst" in a:
        switches.update(opts)


def vllm_flags(zf: zipfile.ZipFile) -> tuple[set, set, str]:
    src = Source(zf)
    src.index([*src.glob("vllm/config/"), "vllm/engine/arg_utils.py",
               *src.glob("vllm/entrypoints/common/"), *src.glob("vllm/entrypoints/openai/")])
    parser_file = next((n for n in ("vllm/entrypoints/common/cli_args.py", "vllm/entrypoints/openai/cli_args.py")
                        if n in src.names), None)
    if parser_file is None:
        raise SystemExit("no vllm/entrypoints/*/cli_args.py in this wheel")
    make = next((n for n in ast.walk(src.tree(parser_file))
                 if isinstance(n, ast.FunctionDef) and n.name == "make_arg_parser"), None)
    if make is None:
        raise SystemExit(f"{parser_file} has no make_arg_parser")
    flags: set[str] = set()
    switches: set[str] = set()
    _vllm_function(src, make, None, flags, switches, set())
    return flags, switches, f"{parser_file}:make_arg_parser"


# ------------------------------------------------------------------------------------------------ SGLang
def _sglang_field(name: str, ann: ast.expr) -> tuple[list[str], str | None] | None:
    """(option strings, action) of one ``A[T, ...]`` field, or None when it is not a CLI flag."""
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in ("A", "Annotated")):
        return None
    elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if len(elts) < 2:
        return None
    typ, metas = elts[0], elts[1:]
    for m in metas:
        if isinstance(m, ast.Constant) and isinstance(m.value, str):
            kw: dict[str, ast.expr] = {}
        elif isinstance(m, ast.Call) and isinstance(m.func, ast.Name) and m.func.id == "Arg":
            kw = {k.arg: k.value for k in m.keywords if k.arg}
        else:
            continue
        if "no_cli" in kw and isinstance(kw["no_cli"], ast.Constant) and kw["no_cli"].value is True:
            return None
        cli = kw["cli_name"].value if isinstance(kw.get("cli_name"), ast.Constant) else "--" + name.replace("_", "-")
        aliases = [e.value for e in kw["aliases"].elts] if isinstance(kw.get("aliases"), (ast.List, ast.Tuple)) else []
        if "action" in kw:
            action = ast.unparse(kw["action"])
        else:
            t = ast.unparse(typ).replace(" ", "")
            action = "store_true" if t in ("bool", "Optional[bool]", "bool|None") else None
        return [cli, *aliases], action
    return None


def sglang_flags(zf: zipfile.ZipFile) -> tuple[set, set, str]:
    src = Source(zf)
    sa = "sglang/srt/server_args.py"
    src.index([sa, *src.glob("sglang/srt/arg_groups/")])
    tree = src.tree(sa)
    namespaces: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                for t in node.targets):
            namespaces = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
    if not namespaces:
        raise SystemExit(f"{sa}: no _INPUT_NAMESPACES list (the parser is built another way in this release)")
    flags: set[str] = set()
    switches: set[str] = set()
    for ns in [*namespaces, "ServerArgs"]:
        cls = src.classes.get(ns)
        if cls is None:
            raise SystemExit(f"namespace class {ns} not found in the wheel's source")
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                got = _sglang_field(node.target.id, node.annotation)
                if got:
                    _add(got[0], got[1], flags, switches)
    fn = _method(src.classes["ServerArgs"], "add_cli_args")
    for node in ast.walk(fn):
        if _is_add_argument(node) and _options(node):
            _add(_options(node), _action(node), flags, switches)
    return flags, switches, f"{sa}:ServerArgs.add_cli_args over _INPUT_NAMESPACES"


# ------------------------------------------------------------------------------------------------ main
EXTRACTORS = {"vllm": (vllm_flags, "vllm serve"), "sglang": (sglang_flags, "python -m sglang.launch_server")}


def refresh(package: str, wheel: pathlib.Path, out: pathlib.Path = OUT) -> pathlib.Path:
    extract, program = EXTRACTORS[package]
    with zipfile.ZipFile(wheel) as zf:
        version = wheel_version(wheel, zf)
        flags, switches, where = extract(zf)
    missing = MUST_HAVE[package] - flags
    if missing:
        raise SystemExit(f"{package} {version}: the extraction missed {sorted(missing)}; the parser is built "
                         "differently in this release: update scripts/refresh_export_flags.py")
    data = {"package": package, "version": version, "program": program, "wheel": wheel.name,
            "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "generated_by": "scripts/refresh_export_flags.py (ast over the wheel's source, nothing imported)",
            "parser": where, "flags": sorted(flags), "switches": sorted(switches)}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{package}-{version}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="vllm", help="wheel path or requirement (default: the newest vllm)")
    ap.add_argument("--sglang", default="sglang", help="wheel path or requirement (default: the newest sglang)")
    ap.add_argument("--only", choices=sorted(EXTRACTORS), help="refresh one package")
    ap.add_argument("--out", default=str(OUT), help="output folder (default: cbnb/export/data)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for pkg in ([a.only] if a.only else sorted(EXTRACTORS)):
            path = refresh(pkg, fetch_wheel(getattr(a, pkg), tmp), pathlib.Path(a.out))
            n = len(json.loads(path.read_text())["flags"])
            print(f"{path}: {n} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
