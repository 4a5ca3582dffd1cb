"""`cbnb.sim.ModelShape`: bundled shapes, loading from dicts / files / caches, the KV spec the engine's sizing reads,
exact parameter counts, and the bundled smollm2-135m / gemma3-270m shapes against the real models."""

from __future__ import annotations

import json

import pytest

from cbnb.core.cache.layout import layout_for, model_kv_spec
from cbnb.sim import SHAPE_NAMES, ModelShape, load_shape
from cbnb.sim.shapes import _DATA, normalize_dtype

# Published facts (each bundled file cites its config.json): layers, hidden, intermediate, heads, kv heads, head_dim,
# vocab, tied, full-attention layers, sliding window.
FACTS = {
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152, True, 30, None),
    "gemma3-270m": (18, 640, 2048, 4, 1, 256, 262144, True, 3, 512),
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151936, True, 28, None),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256, False, 32, None),
    "llama-3.1-70b": (80, 8192, 28672, 64, 8, 128, 128256, False, 80, None),
    "qwen3-32b": (64, 5120, 25600, 64, 8, 128, 151936, False, 64, None),
    "gemma-3-27b": (62, 5376, 21504, 32, 16, 128, 262208, True, 10, 1024),
}
# Parameter counts (billions, 2 decimals) as the model cards state them; gemma-3-27b is the text model only.
PARAMS_B = {"smollm2-135m": 0.13, "gemma3-270m": 0.27, "qwen3-0.6b": 0.60, "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55,
            "qwen3-32b": 32.76,
            "gemma-3-27b": 27.01}


def test_bundled_shapes_are_the_published_facts():
    assert set(SHAPE_NAMES) == set(FACTS)
    for name, (L, h, i, H, Hkv, d, V, tied, n_full, window) in FACTS.items():
        s = load_shape(name)
        assert (s.num_layers, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim,
                s.vocab_size, s.tie_word_embeddings) == (L, h, i, H, Hkv, d, V, tied), name
        types = s.layer_types or ("full_attention",) * L
        assert sum(t == "full_attention" for t in types) == n_full, name
        assert s.sliding_window == window, name
        assert s.dtype == "bfloat16" and s.itemsize == 2
        assert round(s.num_parameters / 1e9, 2) == PARAMS_B[name], name
        assert s.weight_bytes() == 2 * s.num_parameters and s.weight_bytes("float32") == 4 * s.num_parameters
        assert s.source.startswith("https://huggingface.co/"), name
        assert load_shape(f"shape:{name}") == s


def test_bundled_files_cite_their_source():
    for name in SHAPE_NAMES:
        data = json.loads((_DATA / f"{name}.json").read_text())
        assert data["name"] == name and data["source"].endswith("config.json") and data["hf_id"] in data["source"]


def test_gemma_27b_hybrid_pattern():
    s = load_shape("gemma-3-27b")
    full = [i for i, t in enumerate(s.layer_types) if t == "full_attention"]
    assert full == list(range(5, 62, 6))
    lay = s.layout(page_size=16)
    assert [g.attention_type for g in lay.groups] == ["sliding_attention", "full_attention"]
    assert [len(g.layers) for g in lay.groups] == [52, 10]
    assert lay.groups[0].window == 1024


def test_kv_spec_is_the_engines_spec():
    # The simulator sizes its cache from kv_spec(): it must be exactly what the engine extracts from the config.
    for name in SHAPE_NAMES:
        s = load_shape(name)
        cfg = json.loads((_DATA / f"{name}.json").read_text())["config"]
        ns = type("Cfg", (), {k: cfg.get(k) for k in (
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
            "vocab_size", "layer_types", "sliding_window", "max_position_embeddings")})
        if "use_sliding_window" in cfg:
            ns.use_sliding_window = cfg["use_sliding_window"]
        want = model_kv_spec(ns)
        got = s.kv_spec()
        assert got.pop("intermediate_size") == s.intermediate_size
        assert got == want, name
        assert layout_for(got, 2, 256) == s.layout(256)


def test_tiny_models_shapes_match_their_configs():
    pytest.importorskip("torch")
    from helpers_engine import tiny_model

    for name in ("tiny:llama", "tiny:qwen3", "tiny:gemma3", "tiny:mistral", "tiny:qwen2"):
        model = tiny_model(name)
        s = load_shape(model.config)
        assert s.num_parameters == sum(p.numel() for p in model.parameters()), name
        spec = model_kv_spec(model.config)
        got = s.kv_spec()
        got.pop("intermediate_size")
        assert got == spec, name
        assert s.dtype == "float32"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_bundled_shape_matches_the_real_model(name):
    pytest.importorskip("torch")
    import cbnb

    model, _ = cbnb.load_model(name)
    real = load_shape(model.config)
    bundled = load_shape(name)
    for f in ("model_type", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "layer_types", "sliding_window", "max_position_embeddings", "tie_word_embeddings",
              "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norms_per_layer"):
        assert getattr(bundled, f) == getattr(real, f), f
    assert bundled.num_parameters == sum(p.numel() for p in model.parameters())
    spec = model_kv_spec(model.config)
    got = bundled.kv_spec()
    assert got.pop("intermediate_size") == model.config.intermediate_size
    assert got == spec


def test_from_config_dict_and_multimodal_text_config():
    cfg = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 100,
           "max_position_embeddings": 128, "sliding_window": 64, "use_sliding_window": False,
           "tie_word_embeddings": True, "torch_dtype": "float16"}
    s = ModelShape.from_config(cfg, "toy")
    assert s.sliding_window is None and s.layer_types is None  # unused window dropped, as the engine does
    assert s.qk_norm and s.norms_per_layer == 2 and s.dtype == "float16"
    wrapped = load_shape({"model_type": "gemma3", "torch_dtype": "bfloat16",
                          "text_config": {**cfg, "model_type": "gemma3_text", "torch_dtype": None}})
    assert wrapped.model_type == "gemma3_text" and wrapped.norms_per_layer == 4 and wrapped.dtype == "bfloat16"
    assert load_shape(cfg, dtype="fp32").dtype == "float32"
    assert s.with_dtype("bf16").itemsize == 2


def test_load_from_path_folder_and_caches(tmp_path, monkeypatch):
    cfg = json.loads((_DATA / "qwen3-0.6b.json").read_text())["config"]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    assert load_shape(str(f)).num_layers == 28
    assert load_shape(tmp_path).num_layers == 28
    # A Hugging Face id found in the local hub cache (nothing downloaded).
    snap = tmp_path / "hub" / "models--acme--tiny-lm" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    s = load_shape("acme/tiny-lm")
    assert s.num_layers == 3 and s.name == "acme/tiny-lm" and s.source.endswith("config.json")
    # A model cbnb converted (its cache folder).
    monkeypatch.setenv("CBNB_CACHE_DIR", str(tmp_path / "cbnb"))
    (tmp_path / "cbnb" / "my-model").mkdir(parents=True)
    (tmp_path / "cbnb" / "my-model" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    assert load_shape("my-model").num_layers == 5


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="unknown model shape 'nope'.*llama-3.1-8b"):
        load_shape("nope")
    with pytest.raises(ValueError, match="config has no 'num_attention_heads'"):
        load_shape({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ValueError, match="config has no 'num_hidden_layers'"):
        load_shape({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 4})
    with pytest.raises(ValueError, match="ModelShape.num_heads"):
        ModelShape("x", "llama", 2, 8, 16, 3, 2, 4, 10)
    with pytest.raises(ValueError, match="ModelShape.hidden_size"):
        ModelShape("x", "llama", 2, 0, 16, 2, 1, 4, 10)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelShape("x", "llama", 2, 8, 16, 2, 1, 4, 10, dtype="int4")
    with pytest.raises(ValueError, match="attention type"):
        ModelShape("x", "llama", 2, 8, 16, 2, 1, 4, 10, layer_types=("full_attention", "linear_attention"))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelShape("x", "llama", 1, 8, 16, 2, 1, 4, 10, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="cannot build a model shape"):
        load_shape(3.5)
    assert normalize_dtype("torch.bfloat16") == "bfloat16"
