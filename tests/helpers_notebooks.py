"""What each example notebook must show once it ran (the numbers its conclusions are drawn from), shared by the
headless run (tests/test_notebooks.py) and the browser runs (tests/ui/): each notebook is executed in full once per
suite, in the browser where a browser test runs it, else headless."""

from __future__ import annotations

EXPECT = {
    "01_quickstart.ipynb": ["output tok/s", "ContinuousBatchingConfig("],
    "02_tuning_page_size_and_safety_margin.ipynb": ["Fragmentation", "median [min-max]", "Greedy outputs identical",
                                                    "ContinuousBatchingConfig(", "vllm serve"],
    "03_prefix_caching.ipynb": ["of the prompt tokens were served from the cache"],
    "04_offloading_and_soft_reset.ipynb": ["Without a swap pool the engine soft-reset"],
    "05_what_if_production.ipynb": ["llama-3.1-8b: 32 layers", "configs x", "What the numbers say",
                                    "goodput (req/s) by page_size x max_batch_tokens x safety_margin (best: ",
                                    "winner: goodput", "ContinuousBatchingConfig(", "vllm serve meta-llama/Llama-3.1-8B",
                                    "The two policies on the same traffic", "predicted"],
    "06_serve_and_load.ipynb": ["-> '", "sources: ['http 127.0.0.1:", "client TTFT p50/90/99", "engine TTFT p50/90/99",
                                "cbnb_kv_usage_blocks_ratio", "stopped"],
}

#: Notebooks a browser test runs whole (Run All, CBNB_CI=1) and checks against EXPECT: tests/ui/conftest.py's
#: shared session (01) and tests/ui/test_lab_notebooks.py (03, 04). Headless, they run only where the browser
#: tests cannot (tests/ui/lab.py's skip_reason).
IN_BROWSER = ("01_quickstart.ipynb", "03_prefix_caching.ipynb", "04_offloading_and_soft_reset.ipynb")


def missing(name: str, text: str) -> list[str]:
    """The EXPECT needles of notebook `name` absent from `text` (its outputs), plus "Traceback" if present."""
    return [n for n in EXPECT[name] if n not in text] + (["no Traceback"] if "Traceback" in text else [])
