"""Import boundaries: the core is torch-free, and the engine needs neither the UI libraries nor gguf."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import cbnb

# cbnb.core: the deciding side (config, requests, the KV cache, scheduler, offload policy, EngineCore, plain step data).
CORE = ["cbnb.core", "cbnb.core.config", "cbnb.core.requests", "cbnb.core.sampling_params", "cbnb.core.generation",
        "cbnb.core.plan", "cbnb.core.scheduler", "cbnb.core.offload", "cbnb.core.engine_core", "cbnb.core.segments",
        "cbnb.core.cache", "cbnb.core.cache.layout", "cbnb.core.cache.pool", "cbnb.core.cache.allocators",
        "cbnb.core.cache.prefix", "cbnb.core.cache.swap", "cbnb.core.cache.manager", "cbnb.core.cache.sizing",
        "cbnb.core.cache.snapshot",
        # cbnb.telemetry: the Recorder, events, stats, a request's story
        "cbnb.telemetry", "cbnb.telemetry.recorder", "cbnb.telemetry.events", "cbnb.telemetry.stats",
        "cbnb.telemetry.explain",
        # the engine's runner-agnostic parts, shared with the simulator: the loop, its phases, the inbox, handles,
        # prompts, the step mode, stop strings, the shell both engines share, its protocol, incremental detokenizer,
        # the submit keywords' declaration
        "cbnb.engine", "cbnb.engine.inbox", "cbnb.engine.handle", "cbnb.engine.prompts", "cbnb.engine.phases",
        "cbnb.engine.loop", "cbnb.engine.step_mode", "cbnb.engine.stops", "cbnb.engine.shell",
        "cbnb.engine.engine_like", "cbnb.engine.detok", "cbnb.engine.submit_schema",
        "cbnb.lab.workloads"]
# The simulator: importable (and usable) on a machine without torch.
SIM = ["cbnb.sim", "cbnb.sim.shapes", "cbnb.sim.profiles", "cbnb.sim.cost", "cbnb.sim.loads", "cbnb.sim.engine",
       "cbnb.sim.arrivals", "cbnb.sim.build", "cbnb.sim.playback", "cbnb.sim.clock", "cbnb.sim.executor",
       "cbnb.sim.driving",
       # measuring this machine (calibrate falls back to NumPy), and the old names kept as aliases
       "cbnb.measure", "cbnb.measure.calibrate", "cbnb.measure.validate", "cbnb.measure.scale",
       "cbnb.measure.fit_vllm", "cbnb.measure.rates", "cbnb.sim.validate", "cbnb.sim.scale", "cbnb.sim.fit_vllm"]


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_core_modules_do_not_import_torch():
    mods = _loaded_after("\n".join(f"import {m}" for m in CORE))
    assert "torch" not in mods and "transformers" not in mods
    assert set(CORE) <= mods


def test_sim_imports_and_simulates_without_torch():
    # torch, transformers and plotly made unimportable: the simulator must still load its data files and run a step.
    code = ("import sys\nfor m in ('torch', 'transformers', 'plotly'): sys.modules[m] = None\n"
            + "\n".join(f"import {m}" for m in SIM)
            + "\nfrom cbnb.sim import SimEngine\ne = SimEngine('qwen3-0.6b', 'h100-sxm')\n"
            "e.submit(list(range(100, 164)), 4)\nassert e.run()['run']['output_tokens'] == 4")
    mods = _loaded_after(code)
    assert set(SIM) <= mods


# The tuning lab drives any engine-like object, the simulator's too: it imports no torch either.
LAB = ["cbnb.lab", "cbnb.lab.traffic", "cbnb.lab.traces", "cbnb.lab.mooncake", "cbnb.lab.workloads", "cbnb.lab.driver",
       "cbnb.lab.metrics", "cbnb.lab.runs", "cbnb.lab.tuning", "cbnb.lab.load_sweep", "cbnb.export",
       "cbnb.lab.heatmap", "cbnb.lab.compare", "cbnb.telemetry.runs", "cbnb.tuning"]


def test_tuning_lab_does_not_import_torch():
    mods = _loaded_after("\n".join(f"import {m}" for m in LAB))
    assert "torch" not in mods and "transformers" not in mods and "pandas" not in mods
    assert set(LAB) <= mods


def test_public_aliases():
    # cbnb.tuning is the lab's module itself (not a copy); the public names of the package keep working.
    import cbnb.lab.tuning
    import cbnb.tuning

    assert cbnb.tuning is cbnb.lab.tuning and cbnb.tuning.sweep is cbnb.lab.tuning.sweep
    assert cbnb.ContinuousBatchingConfig.__module__ == "cbnb.core.config"
    assert cbnb.Engine.__module__ == "cbnb.engine.engine" and cbnb.load_model.__module__ == "cbnb.engine.models"


def test_engine_imports_without_ui_or_gguf():
    # Make the UI libraries and gguf unimportable, as on the GPU machine.
    code = ("import sys\nfor m in ('ipywidgets', 'anywidget', 'plotly', 'gguf'): sys.modules[m] = None\n"
            "import cbnb, cbnb.engine.engine, cbnb.bench, cbnb.runner.model_runner\n"
            "print(cbnb.Engine.__name__, cbnb.ContinuousBatchingConfig.__name__)")
    mods = _loaded_after(code)
    assert "cbnb.engine.engine" in mods and "torch" in mods


def test_engine_and_server_package_import_without_the_web_stack():
    # Without the `serve` extra, cbnb and cbnb.server still import; serve() names the install command.
    code = ("import sys\nfor m in ('uvicorn', 'starlette', 'pydantic', 'prometheus_client'): sys.modules[m] = None\n"
            "import cbnb, cbnb.engine.engine, cbnb.server\n"
            "from cbnb.server import serve\n"
            "try:\n    serve(None)\nexcept ImportError as e:\n    print('ERR', e)\n"
            "try:\n    cbnb.Engine.serve(None, port=0)\nexcept ImportError as e:\n    print('METHOD', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'cbnb[serve]'" in out and "uvicorn" in out
    method = out[out.index("METHOD"):]  # engine.serve() says the same
    assert "pip install 'cbnb[serve]'" in method and "uvicorn" in method


def test_plan_data_imports_nothing_that_decides():
    mods = _loaded_after("import cbnb.core.plan")
    assert not {"cbnb.core.scheduler", "cbnb.core.engine_core", "cbnb.core.offload", "cbnb.core.cache.manager",
                "cbnb.core.requests"} & mods


def test_runners_take_plan_types_from_plain_data_and_form_no_cycle():
    # The runner executes plans; it does not make them: no scheduler, core or offload policy behind it.
    mods = _loaded_after("import cbnb.runner.model_runner, cbnb.runner.batch, cbnb.runner.kv")
    assert "cbnb.core.plan" in mods
    assert not {"cbnb.core.scheduler", "cbnb.core.engine_core", "cbnb.core.offload",
                "cbnb.runner.cuda.cuda_runner"} & mods
    # cuda_runner imports model_runner (a subclass), never the other way; the factory is the one chooser.
    mods = _loaded_after("import cbnb.runner.cuda.cuda_runner")
    assert {"cbnb.runner.model_runner", "cbnb.core.plan"} <= mods and "cbnb.runner.factory" not in mods
    assert not {"cbnb.core.scheduler", "cbnb.core.engine_core", "cbnb.core.offload"} & mods


# ---------------------------------------------------------------------------------------------- import circles
def _module_files(root: Path) -> dict[str, Path]:
    """Every module of the `cbnb` package by dotted name (a package is its __init__)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The cbnb modules `name` imports anywhere in its body, function-level (lazy) imports included; imports under
    ``if TYPE_CHECKING:`` never run and are left out. ``from pkg import x`` is an edge to ``pkg.x`` when that is a
    module, else to ``pkg``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking_only(node)
            for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    if "importlib" in path.read_text():  # `importlib.import_module("cbnb.x")` (the package's lazy attributes)
        out |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value.startswith("cbnb.") and n.value in mods} - {name}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # `import cbnb.sim.cost` -> cbnb.sim.cost; unknown tails -> their module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _module_files(Path(cbnb.__file__).parent)
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_walker_sees_lazy_imports():
    g = import_graph()
    assert "cbnb.telemetry.explain" in g["cbnb.engine.shell"]  # imported inside `EngineShell.explain`
    assert "cbnb.engine.engine" in g["cbnb"] and "cbnb.sim.engine" in g["cbnb.sim"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_lazy_imports_included():
    cycles = import_cycles(import_graph())
    assert cycles == [], "import circles (each a strongly connected set of cbnb modules):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_runners_never_import_the_cache_manager_and_layer_by_device():
    # A runner is built from the cache's plain `KVGeometry` and reads each step's `StepWork` (cbnb/core/plan.py's
    # contract): no runner module imports the cache manager, not even lazily.
    g = import_graph()
    runner = {m: deps for m, deps in g.items() if m.startswith("cbnb.runner.")}
    assert "cbnb.runner.cuda.cuda_runner" in runner and "cbnb.runner.cpu.cpu_kernels" in runner
    assert not [m for m, deps in runner.items() if "cbnb.core.cache.manager" in deps]
    # cpu/ imports nothing of the runner outside cpu/; the shared modules import cuda/ only in the factory (lazily).
    assert not {(m, d) for m, deps in runner.items() if m.startswith("cbnb.runner.cpu.")
                for d in deps if d.startswith("cbnb.runner.") and not d.startswith("cbnb.runner.cpu.")}
    assert {(m, d) for m, deps in runner.items() if not m.startswith(("cbnb.runner.cpu.", "cbnb.runner.cuda."))
            for d in deps if d.startswith("cbnb.runner.cuda.")} == {("cbnb.runner.factory",
                                                                     "cbnb.runner.cuda.cuda_runner")}


# ---------------------------------------------------------------------------------------------- package layers
def _package(module: str) -> str:
    """cbnb.sim.cost -> cbnb.sim; cbnb.tuning -> cbnb.tuning (a top-level module is its own node)."""
    return ".".join(module.split(".")[:2])


#: Modules that only forward an old name to the package that now holds it (imported by nobody in cbnb).
ALIASES = {"cbnb.sim.validate", "cbnb.sim.scale", "cbnb.sim.fit_vllm", "cbnb.lab.runs"}
#: The lazy conveniences that import a package above their own (inside a function, so never at import time):
#: (importing package, imported package) -> where.
LAZY_UP = {
    ("cbnb.engine", "cbnb.server"): "EngineShell.serve() starts the HTTP server",
    ("cbnb.sim", "cbnb.measure"): "cbnb.sim.calibrate, a lazy alias of cbnb.measure.calibrate (module __getattr__)",
    ("cbnb.lab", "cbnb.measure"): "python -m cbnb.lab.load_sweep --profile calibrate calibrates this machine",
}

_RECORD = r'''
import builtins, json, pkgutil, sys, importlib
import cbnb
edges = set()
real = builtins.__import__
def hook(name, globals=None, locals=None, fromlist=(), level=0):
    me = (globals or {}).get("__name__", "")
    if me.startswith("cbnb"):
        if level:
            base = me if (globals or {}).get("__path__") else me.rpartition(".")[0]
            base = base.split(".")
            base = ".".join(base[:len(base) - level + 1])
            target = f"{base}.{name}" if name else base
        else:
            target = name
        if target.startswith("cbnb"):
            for t in [target] + [f"{target}.{f}" for f in fromlist or () if f != "*"]:
                edges.add((me, t))
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = hook
names = sorted(m.name for m in pkgutil.walk_packages(cbnb.__path__, "cbnb.")
               if m.name not in ALIASES and not m.name.endswith(".__main__"))  # a __main__ runs its command
for m in names:
    importlib.import_module(m)
print(json.dumps(sorted(edges)))
'''


def _cycles_between_packages(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        pa, pb = _package(a), _package(b)
        if pa != pb and pb != "cbnb" and pa != "cbnb":
            graph.setdefault(pa, set()).add(pb)
    return import_cycles(graph)


def test_no_package_imports_one_that_imports_it_back_at_import_time():
    # Every cbnb module imported in a fresh interpreter, each import statement that runs recorded (importing module,
    # imported module): no cycle between packages. Lazy (function-level) imports do not run here.
    code = f"ALIASES = {sorted(ALIASES)!r}\n" + _RECORD
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    edges = {tuple(e) for e in json.loads(out.stdout.strip().splitlines()[-1])}
    assert ("cbnb.engine.engine", "cbnb.telemetry.runs") in edges  # the recorder sees relative imports
    cycles = _cycles_between_packages(edges)
    assert cycles == [], f"packages that import each other at import time: {cycles}"
    # In particular the old ones: the engine no longer imports the lab, the simulator neither lab nor measure.
    pkgs = {(_package(a), _package(b)) for a, b in edges}
    assert not {("cbnb.engine", "cbnb.lab"), ("cbnb.sim", "cbnb.lab"), ("cbnb.sim", "cbnb.measure"),
                ("cbnb.lab", "cbnb.bench")} & pkgs


def test_lazy_imports_up_the_layers_are_the_named_few():
    # Function-level imports included (ast), the aliases left out: removing the named lazy conveniences leaves no
    # cycle between packages, and each named one is still there (the list stays true).
    graph = import_graph()
    edges = {(a, b) for a, deps in graph.items() if a not in ALIASES for b in deps}
    pkgs = {(_package(a), _package(b)) for a, b in edges}
    assert set(LAZY_UP) <= pkgs
    cycles = _cycles_between_packages({(a, b) for a, b in edges if (_package(a), _package(b)) not in LAZY_UP})
    assert cycles == [], f"packages that import each other, lazy imports included: {cycles}"


def test_the_old_names_are_the_moved_modules():
    code = ("import cbnb.sim, cbnb.measure, cbnb.sim.validate, cbnb.sim.scale, cbnb.sim.fit_vllm, cbnb.lab.runs\n"
            "import cbnb.measure.validate, cbnb.measure.scale, cbnb.measure.fit_vllm, cbnb.telemetry.runs\n"
            "assert cbnb.sim.calibrate is cbnb.measure.calibrate and callable(cbnb.sim.calibrate)\n"
            "assert cbnb.sim.validate is cbnb.measure.validate and cbnb.sim.scale is cbnb.measure.scale\n"
            "assert cbnb.sim.fit_vllm is cbnb.measure.fit_vllm and cbnb.lab.runs is cbnb.telemetry.runs\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-m", "cbnb.sim.validate", "--workloads", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "unknown nope" in out.stderr  # the old command still runs the moved module
