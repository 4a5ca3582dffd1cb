"""The shared shape of an export: a mapping table row, and the result (flags, command, unmapped, problems)."""

from __future__ import annotations

import shlex
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["MappingRow", "Export", "mapping_table", "changed_fields", "NO_SERVING_EQUIVALENT", "cache_blocks",
           "drop_unknown", "model_shape", "short_cache"]


@dataclass(frozen=True)
class MappingRow:
    """One cbnb field in a target's table.

    Attributes:
        field: the `ContinuousBatchingConfig` field.
        target: the target's flag(s), or "" when there is no equivalent.
        how: "same" (value passed as is), "mapped" (translated, see note), "approx" (nearest equivalent with
            different semantics), "none" (no equivalent: reported in `Export.unmapped` when set).
        note: what differs, in one sentence.
    """

    field: str
    target: str
    how: str
    note: str = ""


@dataclass
class Export:
    """The result of an export.

    Attributes:
        target: "vllm", "sglang" or "transformers-serve".
        checked_against: the target version the mapping was checked against.
        program: the command that takes the flags (e.g. ``vllm serve``).
        flags: the argument list (e.g. ``["--block-size", "16"]``).
        unmapped: (field, value, why) for fields set away from transformers' defaults that do not carry over (no
            equivalent, or only a flag that means something else); `report()` prints them as "not carried over".
        problems: values the target cannot take (the flag is left out; nothing is rounded).
        notes: approximations worth knowing (e.g. a memory fraction measured differently).
    """

    target: str
    checked_against: str
    program: str
    model: str
    flags: list[str] = field(default_factory=list)
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, flag: str, value: Any) -> None:
        """Append ``flag value`` when `value` is not None (floats without trailing zeros: 0.9, not 0.900000)."""
        if value is not None:
            self.flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]

    def report_unmapped(self, config: Any, handled: Iterable[str], mapping: Iterable[MappingRow],
                        default: str) -> None:
        """Add every field of `config` set away from transformers' defaults and not in `handled` to `unmapped`,
        with its `mapping` row's note (or `default`)."""
        handled = set(handled)
        notes = {r.field: r.note for r in mapping}
        for name, value in changed_fields(config).items():
            if name not in handled:
                self.unmapped.append((name, value, notes.get(name) or default))

    @property
    def command(self) -> str:
        """The shell command line (arguments quoted)."""
        return " ".join([self.program, shlex.quote(self.model), *(shlex.quote(f) for f in self.flags)])

    @property
    def ok(self) -> bool:
        """True when no value was refused (unmapped fields are not an error)."""
        return not self.problems

    def report(self) -> str:
        """The command plus what did not transfer, as text for a notebook cell."""
        lines = [f"# {self.target} (mapping checked against {self.checked_against})", self.command]
        for p in self.problems:
            lines.append(f"# NOT EXPORTED: {p}")
        for name, value, why in self.unmapped:
            lines.append(f"# not carried over: {name}={value!r}: {why}")
        for n in self.notes:
            lines.append(f"# note: {n}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


#: "none" rows shared by the serving engines: transformers' fields that none of them has (processor handling,
#: tensor parallelism, deprecated options).
NO_SERVING_EQUIVALENT: tuple[MappingRow, ...] = tuple(MappingRow(k, "", "none", v) for k, v in {
    "drop_unsupported_processors": "", "disable_nccl_graph_mixing": "", "cpu_group_timeout": "",
    "use_default_compile_configs": "deprecated in transformers", "max_cached_graphs": "deprecated in transformers",
}.items())


def mapping_table(rows: Iterable[MappingRow]) -> str:
    """The mapping as a Markdown table (the format of docs/exports.md)."""
    out = ["| cbnb field | target | how | note |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r.field}` | {('`' + r.target + '`') if r.target else '—'} | {r.how} | {r.note} |")
    return "\n".join(out)


def changed_fields(config: Any) -> dict[str, Any]:
    """Fields of `config` that differ from transformers' defaults (a fresh `ContinuousBatchingConfig`)."""
    from ..core.config import ContinuousBatchingConfig

    default = ContinuousBatchingConfig()
    return {k: v for k, v in config.to_dict().items() if getattr(default, k) != v}


def cache_blocks(config: Any, resolved: Any = None) -> tuple[int | None, str]:
    """The cache size to export, in blocks of ``config.page_size`` tokens, and where it came from.

    `config.num_blocks` when set; else `resolved.num_blocks` (the engine's ``engine.config``, after sizing); else
    None (the target sizes its own cache).

    Raises:
        ValueError: `resolved` has another page_size than `config` (its blocks would be another size).
    """
    if config.num_blocks is not None:
        return int(config.num_blocks), ""
    if resolved is None or getattr(resolved, "num_blocks", None) is None:
        return None, ""
    if resolved.page_size != config.page_size:
        raise ValueError(f"resolved.page_size must equal config.page_size ({config.page_size}); got "
                         f"{resolved.page_size} (pass the engine.config of the engine that ran this config)")
    return int(resolved.num_blocks), "num_blocks=None: the size cbnb's sizing chose (resolved config)"


def drop_unknown(ex: Export, known: Any) -> None:
    """Remove from `ex.flags` every option not in `known` (a `FlagList`), with its value, as a problem: an export
    never emits a flag the checked release does not have."""
    out, toks, i = [], ex.flags, 0
    while i < len(toks):
        tok = toks[i]
        value = i + 1 < len(toks) and not toks[i + 1].startswith("--")
        if tok.startswith("--") and tok not in known:
            ex.problems.append(f"{tok} is not an option of {ex.checked_against}; not exported")
        else:
            out += toks[i:i + (2 if value else 1)]
        i += 2 if value else 1
    ex.flags[:] = out


def model_shape(model: str, shape: Any = None) -> tuple[Any, str]:
    """The served model's `cbnb.sim.ModelShape` (its K/V bytes per token and context length) and how it was found.

    `shape` when given (a bundled shape name, a `ModelShape`, a transformers config or a config.json path); else
    the model's config when `cbnb.sim.load_shape` finds it cached locally; else the bundled shape whose Hugging Face
    id is `model` or a variant of it (``<id>-Instruct``); else (None, "").

    Raises:
        ValueError: `shape` is given and `cbnb.sim.load_shape` cannot read it.
    """
    from ..sim.shapes import SHAPE_NAMES, load_shape

    if shape is not None:
        s = load_shape(shape)
        return s, f"shape {s.name}"
    try:
        s = load_shape(model)
        return s, f"the cached config of {model}"
    except ValueError:
        pass
    m = str(model).lower()
    for name in SHAPE_NAMES:
        s = load_shape(name)
        hf = (s.hf_id or "").lower()
        if hf and (m == hf or m.startswith(hf + "-")):
            return s, f"the bundled shape {name} ({s.hf_id})"
    return None, ""


def short_cache(ex: Export, tokens: int, shape: Any, flag: str, page_size: int) -> None:
    """When the cache holds fewer tokens than the model's context (`shape.max_position_embeddings`), cap the
    served length with `flag` and warn: the target refuses to start when one request of the full context cannot
    fit in its cache (vLLM: "max_model_len ... larger than the maximum number of tokens that can be stored in KV
    cache")."""
    ctx = getattr(shape, "max_position_embeddings", None)
    if shape is None or not ctx or tokens >= ctx:
        return
    ex.add(flag, tokens)
    msg = (f"the exported cache holds {tokens:,} tokens, less than {shape.name}'s context of {ctx:,}: {flag} "
           f"{tokens} caps each request at the cache's size (the server would refuse to start otherwise); to serve "
           f"the full context, give the cache num_blocks >= {-(-ctx // page_size):,} of {page_size} tokens")
    ex.notes.append(msg)
    warnings.warn(f"{ex.target} export: {msg}", UserWarning, stacklevel=3)
