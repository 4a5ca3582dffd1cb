"""Exports to vLLM, SGLang and `transformers serve`, checked against their documented mapping tables."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from cbnb.config import TRANSFORMERS_FIELDS, CBNB_FIELDS, ContinuousBatchingConfig as C
from cbnb.export import TARGETS, render_docs, sglang, to_sglang, to_transformers_serve, to_vllm, transformers_serve, vllm

MODULES = {"vllm": vllm, "sglang": sglang, "transformers-serve": transformers_serve}
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "exports.md"


def _flags(ex) -> dict[str, str | None]:
    """Flag -> value (None for a switch)."""
    out, toks, i = {}, ex.flags, 0
    while i < len(toks):
        assert toks[i].startswith("--") and toks[i] not in out, toks
        has_value = i + 1 < len(toks) and not toks[i + 1].startswith("--")
        out[toks[i]] = toks[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


@pytest.mark.parametrize("target", sorted(MODULES))
def test_every_field_has_a_row(target):
    rows = {r.field for r in MODULES[target].MAPPING}
    assert rows == set(TRANSFORMERS_FIELDS) | set(CBNB_FIELDS)
    assert all(r.how in ("same", "mapped", "approx", "none") for r in MODULES[target].MAPPING)
    assert all((r.how == "none") == (r.target == "") for r in MODULES[target].MAPPING if r.field != "prefix_eviction")


def test_docs_page_is_the_mapping_tables():
    assert DOCS.read_text() == render_docs(), "docs/exports.md is stale: regenerate it with cbnb.export.render_docs()"
    for mod in MODULES.values():
        assert mod.CHECKED_AGAINST and mod.CHECKED_AGAINST.split()[0] in DOCS.read_text()


TUNED = C(page_size=16, num_blocks=512, max_batch_tokens=256, max_requests_per_batch=64, max_memory_percent=0.5,
          cpu_offload_space=2.0, seed=7, use_cuda_graph=False, use_async_batching=True)


def test_vllm_flags_follow_the_table():
    ex = to_vllm(TUNED, model="org/model")
    f = _flags(ex)
    assert f == {"--block-size": "16", "--num-gpu-blocks-override": "512", "--gpu-memory-utilization": "0.5",
                 "--max-num-batched-tokens": "256", "--max-num-seqs": "64", "--enable-prefix-caching": None,
                 "--swap-space": "2", "--scheduling-policy": "fcfs", "--enforce-eager": None,
                 "--async-scheduling": None, "--seed": "7"}
    table = {r.field: r.target for r in vllm.MAPPING}
    for name, flag in (("page_size", "--block-size"), ("num_blocks", "--num-gpu-blocks-override"),
                       ("max_batch_tokens", "--max-num-batched-tokens"), ("max_requests_per_batch", "--max-num-seqs"),
                       ("cpu_offload_space", "--swap-space"), ("seed", "--seed"),
                       ("max_memory_percent", "--gpu-memory-utilization")):
        assert flag in table[name] and flag in f
    assert ex.ok and ex.command.startswith("vllm serve org/model --block-size 16")
    assert shlex.split(ex.command)[3:] == ex.flags
    assert any("gpu-memory-utilization" in n for n in ex.notes)


def test_vllm_reports_what_it_cannot_take():
    ex = to_vllm(C(page_size=48, scheduler_type="prefill_first", safety_margin=0.3, max_queue_size=8,
                   use_cuda_graph=(True, False)))
    assert not ex.ok and "--block-size" not in ex.flags  # reported, never rounded to 32 or 64
    assert "page_size=48" in ex.problems[0] and "1, 8, 16, 32, 64, 128, 256" in ex.problems[0]
    names = {u[0] for u in ex.unmapped}
    assert {"scheduler_type", "safety_margin", "max_queue_size", "use_cuda_graph"} <= names
    assert "--scheduling-policy" not in ex.flags and "--enforce-eager" not in ex.flags
    big = to_vllm(C(page_size=128))
    assert big.ok and "--block-size" in big.flags and any("up to 32" in n for n in big.notes)
    assert "--no-enable-prefix-caching" in to_vllm(C(allow_block_sharing=False)).flags


def test_sglang_flags_follow_the_table():
    ex = to_sglang(TUNED.copy(max_queue_size=100, prefix_eviction="lru"), model="org/model")
    f = _flags(ex)
    assert f == {"--page-size": "16", "--max-total-tokens": str(512 * 16), "--mem-fraction-static": "0.5",
                 "--chunked-prefill-size": "256", "--max-running-requests": "64", "--radix-eviction-policy": "lru",
                 "--schedule-policy": "fcfs", "--disable-cuda-graph": None, "--random-seed": "7",
                 "--max-queued-requests": "100"}
    assert ("cpu_offload_space", 2.0) in [(u[0], u[1]) for u in ex.unmapped]
    assert ex.command.startswith("python -m sglang.launch_server --model-path org/model --page-size 16")
    off = to_sglang(C(allow_block_sharing=False, use_async_batching=False))
    assert "--disable-radix-cache" in off.flags and "--disable-overlap-schedule" in off.flags
    table = {r.field: r.target for r in sglang.MAPPING}
    assert table["num_blocks"] == "--max-total-tokens" and table["max_requests_per_batch"] == "--max-running-requests"


def test_transformers_serve_flags_follow_the_table():
    ex = to_transformers_serve(TUNED)
    assert _flags(ex) == {"--continuous-batching": None, "--cb-block-size": "16", "--cb-num-blocks": "512",
                          "--cb-max-batch-tokens": "256", "--cb-max-memory-percent": "0.5",
                          "--no-cb-use-cuda-graph": None}
    unmapped = {u[0] for u in ex.unmapped}
    assert {"max_requests_per_batch", "cpu_offload_space", "seed", "use_async_batching"} <= unmapped
    assert to_transformers_serve(C()).flags == ["--continuous-batching"]  # all defaults: nothing else to say
    assert to_transformers_serve(C()).unmapped == []


def test_transformers_serve_flags_parse_with_the_installed_cli():
    """The emitted flags are options of the installed `transformers serve` (typer's own parser, no server)."""
    typer = pytest.importorskip("typer")
    from typer.main import get_command

    from transformers.cli.serve import Serve

    app = typer.Typer()
    app.command()(Serve)
    cmd = get_command(app)
    ctx = cmd.make_context("serve", ["org/model", *to_transformers_serve(TUNED).flags], resilient_parsing=True)
    assert ctx.params["continuous_batching"] is True and ctx.params["cb_block_size"] == 16
    assert ctx.params["cb_num_blocks"] == 512 and ctx.params["cb_use_cuda_graph"] is False


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_defaults_export_cleanly(target):
    ex = TARGETS[target](C())
    assert ex.ok and ex.flags and ex.report().splitlines()[1] == ex.command
