"""Exports to vLLM, SGLang and `transformers serve`, checked against their documented mapping tables."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from cbnb.core.config import TRANSFORMERS_FIELDS, CBNB_FIELDS, ContinuousBatchingConfig as C
from cbnb.export import TARGETS, render_docs, sglang, to_sglang, to_transformers_serve, to_vllm, transformers_serve, vllm
from cbnb.export import flags as flags_mod
from cbnb.export.common import drop_unknown
from cbnb.export.flags import flag_list

MODULES = {"vllm": vllm, "sglang": sglang, "transformers-serve": transformers_serve}
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "exports.md"


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
    ex = to_vllm(TUNED.copy(max_queue_size=100, safety_margin=0.2), model="org/model", shape="smollm2-135m")
    f = _flags(ex)
    kv = 512 * 16 * 2 * 3 * 64 * 2 * 30  # blocks x tokens x (K and V) x KV heads x head_dim x bf16 x layers
    assert f == {"--block-size": "16", "--kv-cache-memory-bytes": str(kv), "--max-num-batched-tokens": "256",
                 "--max-num-seqs": "64", "--enable-prefix-caching": None, "--scheduling-policy": "fcfs",
                 "--enforce-eager": None, "--async-scheduling": None, "--seed": "7", "--watermark": "0.2",
                 "--max-num-queued-reqs": "100"}
    table = {r.field: r.target for r in vllm.MAPPING}
    for name, flag in (("page_size", "--block-size"), ("num_blocks", "--kv-cache-memory-bytes"),
                       ("max_batch_tokens", "--max-num-batched-tokens"), ("max_requests_per_batch", "--max-num-seqs"),
                       ("seed", "--seed"), ("safety_margin", "--watermark"),
                       ("max_queue_size", "--max-num-queued-reqs")):
        assert flag in table[name] and flag in f
    assert ex.ok and ex.command.startswith("vllm serve org/model --block-size 16")
    assert shlex.split(ex.command)[3:] == ex.flags
    # the memory fraction means another thing in vLLM: reported, not copied; vLLM 0.33 has no swap space
    unmapped = {u[0]: u[2] for u in ex.unmapped}
    assert "--gpu-memory-utilization" not in f and "whole GPU" in unmapped["max_memory_percent"]
    assert "--swap-space" not in f and "cpu_offload_space" in unmapped


def test_vllm_reports_what_it_cannot_take():
    ex = to_vllm(C(page_size=48, scheduler_type="prefill_first", safety_margin=1.0, use_cuda_graph=(True, False)))
    assert not ex.ok and _flags(ex)["--block-size"] == "48"  # any positive block size in vLLM 0.33
    assert any("safety_margin=1" in p and "[0, 1)" in p for p in ex.problems) and "--watermark" not in ex.flags
    names = {u[0] for u in ex.unmapped}
    assert {"scheduler_type", "use_cuda_graph"} <= names
    assert "--scheduling-policy" not in ex.flags and "--enforce-eager" not in ex.flags
    assert "--no-enable-prefix-caching" in to_vllm(C(allow_block_sharing=False)).flags
    assert _flags(to_vllm(C(scheduler_type="prefill_first")))["--watermark"] == "0"  # its scheduler's default


def test_cache_size_is_exported_exactly():
    """The cache the engine ran with, also when the sizing chose it (resolved=engine.config)."""
    user = C(page_size=32, max_memory_percent=0.5)
    ran = user.copy(num_blocks=1234)
    with pytest.warns(UserWarning, match="--max-model-len 39488"):  # 1,234 x 32 tokens < 131,072
        v = to_vllm(user, resolved=ran, shape="llama-3.1-8b")
    s = to_sglang(user, resolved=ran)
    assert _flags(v)["--kv-cache-memory-bytes"] == str(1234 * 32 * 131072)  # llama-3.1-8b: 128 KiB per token
    assert _flags(s)["--max-total-tokens"] == str(1234 * 32)
    assert "--gpu-memory-utilization" not in v.flags and "--mem-fraction-static" not in s.flags
    assert "--num-gpu-blocks-override" not in v.flags  # vLLM's testing knob
    assert any("sizing chose" in n for n in v.notes)
    unpinned = to_vllm(user)
    assert "--kv-cache-memory-bytes" not in unpinned.flags
    assert any("resolved=engine.config" in n for n in unpinned.notes)
    with pytest.raises(ValueError, match="resolved.page_size"):
        to_vllm(user, resolved=ran.copy(page_size=16))


def test_the_cache_is_pinned_by_bytes_of_the_models_shape():
    # the shape from the model's id (a bundled shape of that Hugging Face id, an -Instruct variant included)
    ex = to_vllm(C(page_size=16, num_blocks=8192), model="meta-llama/Llama-3.1-8B-Instruct")
    assert _flags(ex)["--kv-cache-memory-bytes"] == str(8192 * 16 * 131072) and "--max-model-len" not in ex.flags
    assert any("llama-3.1-8b in bfloat16" in n for n in ex.notes)
    # per GPU at tensor parallel 2: the KV heads are split
    tp = to_vllm(C(page_size=16, num_blocks=8192), model="meta-llama/Llama-3.1-8B", tensor_parallel_size=2)
    assert _flags(tp)["--kv-cache-memory-bytes"] == str(8192 * 16 * 131072 // 2)
    # no shape known: not exported, and the problem says what to pass (never the testing knob)
    unknown = to_vllm(C(page_size=16, num_blocks=512), model="org/model")
    assert not unknown.ok and "--num-gpu-blocks-override" not in unknown.flags
    assert "pass shape=" in unknown.problems[0] and "testing knob" in unknown.problems[0]


def test_a_cache_smaller_than_the_context_caps_the_length_with_a_warning():
    small = C(page_size=16, num_blocks=256)  # 4,096 tokens for a 131,072-token model
    with pytest.warns(UserWarning, match=r"vllm export: the exported cache holds 4,096 tokens, less than "
                                         r"llama-3.1-8b's context of 131,072.*num_blocks >= 8,192"):
        ex = to_vllm(small, model="meta-llama/Llama-3.1-8B")
    assert _flags(ex)["--max-model-len"] == "4096" and ex.ok
    with pytest.warns(UserWarning, match="sglang export"):
        s = to_sglang(small, model="meta-llama/Llama-3.1-8B")
    assert _flags(s)["--context-length"] == "4096"
    with pytest.warns(UserWarning, match="transformers-serve export"):
        t = to_transformers_serve(small, model="meta-llama/Llama-3.1-8B")
    assert _flags(t)["--max-model-len"] == "4096"


def test_max_blocks_per_request_is_not_a_length_cap():
    for ex in (to_vllm(C(max_blocks_per_request=8)), to_sglang(C(max_blocks_per_request=8))):
        assert not any(x in ex.flags for x in ("--max-model-len", "--context-length"))
        why = {u[0]: u[2] for u in ex.unmapped}["max_blocks_per_request"]
        assert "not a length cap" in why


CONFIGS = [C(), TUNED, TUNED.copy(max_queue_size=5, prefix_eviction="lru", use_async_batching=False),
           C(allow_block_sharing=False, scheduler_type="prefill_first", use_cuda_graph=(False, False), seed=1,
             safety_margin=0.3, max_requests_per_batch=8, num_blocks=64)]


@pytest.mark.parametrize("target", ["vllm", "sglang"])
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_commands_use_only_flags_of_the_checked_version(target, config):
    mod = MODULES[target]
    known = flag_list(target, mod.VERSION)
    ex = TARGETS[target](config, model="org/model")
    args = shlex.split(ex.command)[len(shlex.split(ex.program)) + 1:]
    assert args and known.unknown(args) == [], known.unknown(args)
    i = 0
    while i < len(args):  # a switch takes no value, every other option one
        assert args[i] in known.flags, args[i]
        i += 1 if args[i] in known.switches else 2
    assert mod.VERSION in mod.CHECKED_AGAINST and mod.VERSION in ex.report().splitlines()[0]


def test_unknown_flags_are_dropped_and_reported():
    ex = to_vllm(C())
    ex.flags += ["--swap-space", "4"]
    drop_unknown(ex, flag_list("vllm", vllm.VERSION))
    assert "--swap-space" not in ex.flags and "4" not in ex.flags and "--swap-space" in ex.problems[-1]


def test_the_lists_show_why_the_export_changed():
    """vLLM 0.16 (the version the first mapping was checked against) had --swap-space; 0.33 has not, and its
    --max-num-queued-reqs and --watermark are new."""
    old, new = flag_list("vllm", "0.16.0"), flag_list("vllm", vllm.VERSION)
    assert "--swap-space" in old and "--swap-space" not in new
    assert {"--max-num-queued-reqs", "--watermark"} <= new.flags - old.flags
    assert flags_mod.versions("vllm")[-1] == vllm.VERSION and flag_list("vllm") == new  # the newest by default


@pytest.mark.parametrize("package", ["vllm", "sglang"])
def test_flag_lists_are_generated_data(package):
    import json

    path = pathlib.Path(flags_mod.DATA) / f"{package}-{MODULES[package].VERSION}.json"
    d = json.loads(path.read_text())
    assert d["generated_by"].startswith("scripts/refresh_export_flags.py") and len(d["wheel_sha256"]) == 64
    assert d["flags"] == sorted(set(d["flags"])) and set(d["switches"]) <= set(d["flags"])
    assert len(d["flags"]) > 200  # a whole parser, not a hand-picked list
    with pytest.raises(ValueError, match="version must be one of"):
        flag_list(package, "0.0.0")


def test_transformers_serve_flags_follow_the_table():
    ex = to_transformers_serve(TUNED)
    assert _flags(ex) == {"--continuous-batching": None, "--cb-block-size": "16", "--cb-num-blocks": "512",
                          "--cb-max-batch-tokens": "256", "--cb-max-memory-percent": "0.5",
                          "--default-seed": "7", "--no-cb-use-cuda-graph": None}
    unmapped = {u[0] for u in ex.unmapped}
    assert {"max_requests_per_batch", "cpu_offload_space", "use_async_batching"} <= unmapped
    assert _flags(to_transformers_serve(C(seed=7)))["--default-seed"] == "7"  # transformers 5.25
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
    assert ctx.params["default_seed"] == 7  # new in transformers 5.25
    for config in CONFIGS:  # every exported config parses, strictly (an unknown option is an error)
        cmd.make_context("serve", ["org/model", *to_transformers_serve(config).flags])


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_defaults_export_cleanly(target):
    ex = TARGETS[target](C())
    assert ex.ok and ex.flags and ex.report().splitlines()[1] == ex.command


def test_the_last_parser_check_is_of_todays_exports_and_passed():
    """scripts/check_exports.py ran every export through vLLM 0.33's EngineArgs.from_cli_args and
    create_engine_config, and through transformers serve's parser; its committed result must be of the commands
    the exporters emit now (re-run the script when an exporter changes) and every one must have passed."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("check_exports", pathlib.Path(__file__).resolve().parents[2]
                                                  / "scripts" / "check_exports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = json.loads(mod.OUT.read_text())
    assert data["exports"] == mod.exports(), "the exporters changed: re-run scripts/check_exports.py"
    assert data["vllm"]["wheel"].startswith(f"vllm-{vllm.VERSION}-")
    for target in ("vllm", "transformers-serve"):
        results = data[target]["results"]
        assert [r["config"] for r in results] == [name for name, _ in mod.configs()]
        assert all(r["ok"] for r in results), results
    by_name = {r["config"]: r["read_back"] for r in data["vllm"]["results"]}
    assert by_name["tuned"]["kv_cache_memory_bytes"] == 512 * 16 * 30 * 2 * 3 * 64 * 2
    assert by_name["tuned"]["num_gpu_blocks_override"] is None and by_name["short cache"]["max_model_len"] == 2048
