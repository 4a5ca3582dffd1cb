"""Import boundaries: the core is torch-free, and the engine needs neither the UI libraries nor gguf."""

from __future__ import annotations

import subprocess
import sys

CORE = ["cbnb.config", "cbnb.requests", "cbnb.cache.layout", "cbnb.cache.pool", "cbnb.cache.allocators",
        "cbnb.cache.prefix", "cbnb.cache.swap", "cbnb.cache.manager", "cbnb.cache.sizing", "cbnb.cache.snapshot",
        "cbnb.scheduler", "cbnb.offload", "cbnb.core", "cbnb.events", "cbnb.stats", "cbnb.workloads",
        # the engine's runner-agnostic parts, shared with the simulator
        "cbnb.plan", "cbnb.telemetry", "cbnb.inbox", "cbnb.handle", "cbnb.prompts", "cbnb.phases", "cbnb.loop",
        "cbnb.explain", "cbnb.step_mode", "cbnb.sampling_params", "cbnb.generation", "cbnb.stops"]
# The simulator: importable (and usable) on a machine without torch.
SIM = ["cbnb.sim", "cbnb.sim.shapes", "cbnb.sim.profiles", "cbnb.sim.cost", "cbnb.sim.engine", "cbnb.sim.loop",
       "cbnb.sim.playback", "cbnb.sim.calibrate", "cbnb.sim.validate", "cbnb.sim.scale", "cbnb.sim.clock",
       "cbnb.sim.heatmap", "cbnb.sim.compare"]


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
LAB = ["cbnb.traffic", "cbnb.driver", "cbnb.metrics", "cbnb.runs", "cbnb.tuning", "cbnb.export", "cbnb.peers"]


def test_tuning_lab_does_not_import_torch():
    mods = _loaded_after("\n".join(f"import {m}" for m in LAB))
    assert "torch" not in mods and "transformers" not in mods and "pandas" not in mods
    assert set(LAB) <= mods


def test_engine_imports_without_ui_or_gguf():
    # Make the UI libraries and gguf unimportable, as on the GPU machine.
    code = ("import sys\nfor m in ('ipywidgets', 'anywidget', 'plotly', 'gguf'): sys.modules[m] = None\n"
            "import cbnb, cbnb.engine, cbnb.bench, cbnb.runner.model_runner\n"
            "print(cbnb.Engine.__name__, cbnb.ContinuousBatchingConfig.__name__)")
    mods = _loaded_after(code)
    assert "cbnb.engine" in mods and "torch" in mods


def test_engine_and_server_package_import_without_the_web_stack():
    # Without the `serve` extra, cbnb and cbnb.server still import; serve() names the install command.
    code = ("import sys\nfor m in ('uvicorn', 'starlette', 'pydantic', 'prometheus_client'): sys.modules[m] = None\n"
            "import cbnb, cbnb.engine, cbnb.server\n"
            "from cbnb.server import serve\n"
            "try:\n    serve(None)\nexcept ImportError as e:\n    print('ERR', e)\n"
            "try:\n    cbnb.Engine.serve(None, port=0)\nexcept ImportError as e:\n    print('METHOD', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'cbnb[serve]'" in out and "uvicorn" in out
    method = out[out.index("METHOD"):]  # engine.serve() says the same
    assert "pip install 'cbnb[serve]'" in method and "uvicorn" in method


def test_plan_data_imports_nothing_that_decides():
    mods = _loaded_after("import cbnb.plan")
    assert not {"cbnb.scheduler", "cbnb.core", "cbnb.offload", "cbnb.cache.manager", "cbnb.requests"} & mods


def test_runners_take_plan_types_from_plain_data_and_form_no_cycle():
    # The runner executes plans; it does not make them: no scheduler, core or offload policy behind it.
    mods = _loaded_after("import cbnb.runner.model_runner, cbnb.runner.batch, cbnb.runner.kv")
    assert "cbnb.plan" in mods
    assert not {"cbnb.scheduler", "cbnb.core", "cbnb.offload", "cbnb.runner.cuda_runner"} & mods
    # cuda_runner imports model_runner (a subclass), never the other way; the factory is the one chooser.
    mods = _loaded_after("import cbnb.runner.cuda_runner")
    assert {"cbnb.runner.model_runner", "cbnb.plan"} <= mods and "cbnb.runner.factory" not in mods
    assert not {"cbnb.scheduler", "cbnb.core", "cbnb.offload"} & mods
