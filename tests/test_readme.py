"""The README's promises hold: its API tour runs as written (and its reconfigure line keeps `user_config` free of
device-resolved values), it points to nothing outside the repository, pandas comes with cbnb, and it says where
converted models live and how to reach JupyterLab on a remote machine."""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _tour() -> str:
    tour = README[README.index("## API tour"):]
    return re.search(r"```python\n(.*?)```", tour, re.S).group(1)


def test_no_pointer_outside_the_repository():
    texts = {"README.md": README}
    for folder in ("cbnb", "widgets", "tests", "docs", "scripts", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".js", ".sh", ".ipynb") and path.name != "test_readme.py":
                texts[str(path.relative_to(ROOT))] = path.read_text()
    bad = [name for name, text in texts.items() if "../shared" in text or "shared/design" in text]
    assert not bad, f"pointers to files outside the repository in {bad}"
    for link in re.findall(r"`(docs/[^`]+)`", README):
        assert (ROOT / link).exists(), link


def test_pandas_is_a_dependency():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"pandas\b", d) for d in deps), deps


def test_readme_says_where_models_are_cached_and_how_to_move_them(monkeypatch, tmp_path):
    from cbnb.engine.models import model_cache_dir

    assert "~/.cache/cbnb" in README and "CBNB_CACHE_DIR" in README
    monkeypatch.delenv("CBNB_CACHE_DIR", raising=False)
    assert model_cache_dir() == pathlib.Path.home() / ".cache" / "cbnb"
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path))
    assert model_cache_dir() == tmp_path


def test_readme_explains_a_remote_instance():
    section = README[README.index("### On a remote GPU instance"):]
    section = section[:section.index("\n## ")]
    for needed in ("ssh -L", "--ip=", "token", "scripts/quickstart.sh"):
        assert needed in section, needed
    assert re.search(r"\d+ (s|min)", README[:README.index("## API tour")]), "no expected durations"


@pytest.mark.slow
def test_api_tour_runs_as_written(monkeypatch):
    # The tour as printed, on the bundled SmolLM2 (converted once and cached), with a shorter story.
    from helpers_engine import converted_smollm2

    converted_smollm2()  # the tour loads it; converted here if no earlier test did
    code = _tour().replace("max_new_tokens=64", "max_new_tokens=8").replace("max_new_tokens=16", "max_new_tokens=4")
    assert "engine.user_config.copy(" in code and "engine.config.copy(" not in code
    assert "\nDashboard(engine)" in code
    code = code.replace("\nDashboard(engine)", "\ndashboard = Dashboard(engine)")
    ns: dict = {}
    exec(compile(code, "README.md (API tour)", "exec"), ns)
    engine = ns["engine"]
    assert engine.config.page_size == 16 and ns["outs"][0].token_ids
    assert engine.events.to_dataframe().shape[0] > 0
    pasted = engine.user_config.to_code()
    # What you set, not what this device resolved: nothing CPU-specific is pasted into a GPU deployment.
    assert "page_size=16" in pasted and "num_blocks=256" in pasted
    for resolved in ("use_cuda_graph", "max_memory_percent", "use_async_batching", "max_requests_per_batch"):
        assert resolved not in pasted, pasted
    ns["dashboard"].close()
