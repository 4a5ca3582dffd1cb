"""`ModelShape`: a model's architecture without its weights (torch-free).

A shape holds what the simulator needs from a transformers config: layers, hidden and intermediate sizes, query and
KV heads, head dimension, vocabulary, layer types / sliding window, the dtype and whether the embeddings are tied.
It gives the KV-cache geometry through cbnb's own `model_kv_spec` / `layout_for` (so the simulator sizes its cache
with the same code as the engine), the parameter count and the weights' bytes.

Where a shape comes from (`load_shape(source)`):

- a dict (a transformers config as a dict, or a shape file's content), a `transformers` config object, or a
  ``config.json`` path;
- a bundled shape name (`SHAPE_NAMES`: smollm2-135m, gemma3-270m, qwen3-0.6b, llama-3.1-8b, qwen3-32b, gemma-3-27b),
  also with the ``shape:`` prefix; each file under ``cbnb/sim/data/shapes/`` cites the public config.json it copies;
- a model cbnb has converted (``~/.cache/cbnb/<name>/config.json``, see `cbnb.engine.models.model_cache_dir`);
- a Hugging Face id whose config is in the local HF cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
  ``~/.cache/huggingface/hub``); nothing is downloaded.

Parameter count (transformers' decoder layout, per layer): q/k/v/o projections ``h*H*d + 2*h*Hkv*d + H*d*h`` (plus
biases where the config has them), a gated MLP ``3*h*I``, ``norms_per_layer`` RMSNorm vectors of ``h`` (2 for
Llama/Qwen, 4 for Gemma 2/3) and, for Qwen3/Gemma 3, q/k norms of ``d`` each; plus the embedding ``V*h``, the final
norm ``h`` and, when not tied, the LM head ``V*h``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

from ..core.cache.layout import KVLayout, layout_for, model_kv_spec

__all__ = ["ModelShape", "load_shape", "SHAPE_NAMES", "DTYPE_BYTES"]

_DATA = pathlib.Path(__file__).resolve().parent / "data" / "shapes"
SHAPE_NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in _DATA.glob("*.json")))

#: Bytes per element of the dtypes a shape may name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "f16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}

# Model families whose decoder layer has 4 RMSNorms (pre/post attention and pre/post MLP).
_FOUR_NORMS = ("gemma2", "gemma3", "gemma3_text")
# Families with per-head q/k RMSNorm vectors (head_dim each).
_QK_NORM = ("qwen3", "gemma3", "gemma3_text", "olmo2")
# Families whose q/k/v projections always have biases (their configs carry no flag).
_QKV_BIAS = ("qwen2",)


def normalize_dtype(dtype: Any) -> str:
    """A dtype name from a string or a torch dtype ("torch.bfloat16", "bf16", torch.float32 ...).

    Raises:
        ValueError: for a dtype cbnb's simulator does not know (the message lists the choices).
    """
    key = str(dtype).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}; got {dtype!r}")
    return key


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a decoder-only model (no weights).

    Attributes:
        name: a label (the shape name, HF id or path it came from).
        model_type: transformers' `model_type` ("llama", "qwen3", "gemma3_text", ...).
        num_layers, hidden_size, intermediate_size: decoder layers, model width, MLP width (elements).
        num_heads, num_kv_heads, head_dim: query heads, K/V heads, head dimension (elements).
        vocab_size: embedding rows (tokens).
        layer_types: per-layer attention type ("full_attention" / "sliding_attention"), or None (all alike).
        sliding_window: window of the sliding layers (tokens), or None.
        max_position_embeddings: the longest sequence (tokens), or None.
        dtype: weights and KV-cache dtype name ("bfloat16", "float32", ...).
        tie_word_embeddings: the LM head shares the embedding matrix.
        qkv_bias, o_bias, mlp_bias: which projections have bias vectors.
        qk_norm: per-head q/k RMSNorm (Qwen3, Gemma 3).
        norms_per_layer: RMSNorm vectors of `hidden_size` per decoder layer.
        source: where the facts come from (a URL or a path).
        hf_id: the Hugging Face model id (bundled shapes; "" when unknown), e.g. for `cbnb.export` commands.
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    source: str = ""
    hf_id: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelShape.{f} must be a positive integer; got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.kv_spec()  # validates layer types and the window the same way the engine does

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: Any, name: str | None = None, *, source: str = "",
                    dtype: Any = None, hf_id: str = "") -> "ModelShape":
        """A shape from a transformers config (object or dict; a multimodal config's `text_config` is used).

        Args:
            config: `PretrainedConfig`, or a dict with config.json's keys.
            name: label (default: the config's `_name_or_path`, else its model_type).
            dtype: override of the config's `dtype` / `torch_dtype` (default "bfloat16" when the config has none).

        Raises:
            ValueError: a missing or invalid field (named in the message).
        """
        get = _getter(config)
        text = get("text_config")
        if text is not None:
            outer_dtype = get("dtype") or get("torch_dtype")
            get = _getter(text)
        else:
            outer_dtype = None
        model_type = str(get("model_type") or "")

        def need(key: str) -> int:
            v = get(key)
            if v is None:
                raise ValueError(f"config has no {key!r}: not a decoder-only transformers config")
            return int(v)

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        cfg_dtype = dtype if dtype is not None else (get("dtype") or get("torch_dtype") or outer_dtype or "bfloat16")
        spec = model_kv_spec(_namespace(get))  # the engine's own normalisation of layer types / window
        attn_bias = bool(get("attention_bias") or False)
        label = name or get("_name_or_path") or get("name_or_path") or model_type or "model"
        return cls(
            name=str(label),
            model_type=model_type,
            num_layers=spec["num_layers"],
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_heads=heads,
            num_kv_heads=spec["num_kv_heads"],
            head_dim=spec["head_dim"],
            vocab_size=spec["vocab_size"],
            layer_types=tuple(spec["layer_types"]) if spec["layer_types"] is not None else None,
            sliding_window=spec["sliding_window"],
            max_position_embeddings=spec["max_position_embeddings"],
            dtype=normalize_dtype(cfg_dtype),
            tie_word_embeddings=bool(get("tie_word_embeddings") if get("tie_word_embeddings") is not None
                                     else False),
            qkv_bias=attn_bias or model_type in _QKV_BIAS,
            o_bias=attn_bias,
            mlp_bias=bool(get("mlp_bias") or False),
            qk_norm=model_type in _QK_NORM,
            norms_per_layer=4 if model_type in _FOUR_NORMS else 2,
            source=source,
            hf_id=hf_id,
        )

    def with_dtype(self, dtype: Any) -> "ModelShape":
        """The same shape with another weights/KV dtype (e.g. "float32" for CPU runs)."""
        return dataclasses.replace(self, dtype=normalize_dtype(dtype))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        return d

    # ------------------------------------------------------------------------------------------ KV cache
    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return DTYPE_BYTES[self.dtype]

    def kv_spec(self) -> dict[str, Any]:
        """`cbnb.core.cache.layout.model_kv_spec` of this shape, plus "intermediate_size" (what `plan_cache` reads)."""
        ns = SimpleNamespace(num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                             num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                             hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                             layer_types=list(self.layer_types) if self.layer_types is not None else None,
                             sliding_window=self.sliding_window,
                             max_position_embeddings=self.max_position_embeddings)
        spec = model_kv_spec(ns)
        spec["intermediate_size"] = self.intermediate_size
        layout_for(spec, self.itemsize, 16)  # raises on unsupported layer types / a missing window
        return spec

    def layout(self, page_size: int, itemsize: int | None = None) -> KVLayout:
        """The paged KV-cache geometry for `page_size` tokens per page (`cbnb.core.cache.layout.layout_for`)."""
        return layout_for(self.kv_spec(), self.itemsize if itemsize is None else itemsize, page_size)

    def kv_bytes_per_token(self, itemsize: int | None = None) -> int:
        """K and V of one token over all layers (bytes)."""
        a = self.itemsize if itemsize is None else itemsize
        return 2 * self.num_kv_heads * self.head_dim * a * self.num_layers

    # ------------------------------------------------------------------------------------------ weights
    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer."""
        h, d, H, Hkv, i = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        n = h * H * d + 2 * h * Hkv * d + H * d * h + 3 * h * i
        if self.qkv_bias:
            n += H * d + 2 * Hkv * d
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * i + h
        n += self.norms_per_layer * h
        if self.qk_norm:
            n += 2 * d
        return n

    @property
    def num_parameters(self) -> int:
        """All parameters: embedding, layers, final norm and (untied) LM head."""
        emb = self.vocab_size * self.hidden_size
        return emb + self.num_layers * self.layer_parameters + self.hidden_size + (
            0 if self.tie_word_embeddings else emb)

    def weight_bytes(self, dtype: Any = None) -> int:
        """Bytes of all parameters in `dtype` (default: the shape's)."""
        a = DTYPE_BYTES[normalize_dtype(dtype)] if dtype is not None else self.itemsize
        return self.num_parameters * a

    def linear_weight_bytes(self) -> int:
        """Bytes of the linear layers' weights (every decoder projection and the LM head, biases excluded): what the
        CPU runner keeps a second, packed copy of (`cbnb.runner.cpu.cpu_linear`)."""
        h, d, H, Hkv, i = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        per_layer = h * H * d + 2 * h * Hkv * d + H * d * h + 3 * h * i
        return (self.num_layers * per_layer + self.vocab_size * h) * self.itemsize

    def __repr__(self) -> str:
        kinds = "hybrid" if self.layer_types and len(set(self.layer_types)) > 1 else (
            "sliding" if self.sliding_window else "full")
        return (f"ModelShape({self.name!r}, {self.num_layers} layers, h={self.hidden_size}, I={self.intermediate_size}, "
                f"heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, V={self.vocab_size}, {kinds}, "
                f"{self.dtype}, {self.num_parameters / 1e9:.2f}B params)")


def _getter(config: Any):
    if isinstance(config, Mapping):
        return config.get
    return lambda key: getattr(config, key, None)


def _namespace(get) -> SimpleNamespace:
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size",
            "layer_types", "sliding_window", "use_sliding_window", "max_position_embeddings")
    ns = SimpleNamespace(**{k: get(k) for k in keys})
    for k in ("num_hidden_layers", "vocab_size"):
        if getattr(ns, k) is None:
            raise ValueError(f"config has no {k!r}: not a decoder-only transformers config")
    if ns.use_sliding_window is None:
        del ns.use_sliding_window  # model_kv_spec reads it with a default of True
    return ns


# ------------------------------------------------------------------------------------------------ loading
def _hf_cache_dirs() -> list[pathlib.Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(pathlib.Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(pathlib.Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(pathlib.Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def _cbnb_cache_dir() -> pathlib.Path:
    env = os.environ.get("CBNB_CACHE_DIR")  # same rule as cbnb.engine.models.model_cache_dir (which imports torch)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "cbnb"


def _cached_config(name: str) -> pathlib.Path | None:
    p = _cbnb_cache_dir() / name / "config.json"
    if p.is_file():
        return p
    if "/" in name:
        folder = "models--" + name.replace("/", "--")
        for root in _hf_cache_dirs():
            hits = sorted(glob.glob(str(root / folder / "snapshots" / "*" / "config.json")))
            if hits:
                return pathlib.Path(hits[-1])
    return None


def load_shape(source: Any, *, dtype: Any = None) -> ModelShape:
    """A `ModelShape` from a name, a path, a dict or a config object (see the module docstring).

    Args:
        source: a `ModelShape` (returned as is, or with `dtype`), a bundled name ("llama-3.1-8b",
            "shape:qwen3-0.6b"), a converted cbnb model name, a cached HF id, a config.json path or folder, a dict,
            or a transformers config.
        dtype: override the shape's dtype.

    Raises:
        ValueError: an unknown name (the message lists the bundled shapes) or an invalid config.
    """
    if isinstance(source, ModelShape):
        return source.with_dtype(dtype) if dtype is not None else source
    if isinstance(source, Mapping):
        if "config" in source and isinstance(source["config"], Mapping):  # a shape file's content
            return ModelShape.from_config(source["config"], source.get("name"), source=source.get("source", ""),
                                          dtype=dtype, hf_id=source.get("hf_id", ""))
        return ModelShape.from_config(source, dtype=dtype)
    if isinstance(source, (str, os.PathLike)):
        text = str(source)
        key = text.removeprefix("shape:")
        if key in SHAPE_NAMES:
            return load_shape(json.loads((_DATA / f"{key}.json").read_text()), dtype=dtype)
        path = pathlib.Path(text).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            cached = _cached_config(key)
            if cached is None:
                raise ValueError(f"unknown model shape {text!r}: not a bundled shape ({', '.join(SHAPE_NAMES)}), "
                                 "not a config.json path, and not a model whose config is cached locally "
                                 "(~/.cache/cbnb or the Hugging Face cache)")
            path = cached
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if "config" in data and isinstance(data["config"], Mapping):
            return load_shape(data, dtype=dtype)
        return ModelShape.from_config(data, key if not pathlib.Path(text).exists() else str(path),
                                      source=str(path), dtype=dtype)
    if hasattr(source, "num_hidden_layers") or hasattr(source, "text_config"):
        return ModelShape.from_config(source, dtype=dtype)
    raise ValueError(f"cannot build a model shape from {type(source).__name__}: pass a name, a path, a dict or a "
                     "transformers config")
