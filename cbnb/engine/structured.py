"""Structured output: a request's grammar (a JSON schema, or any JSON object), compiled with llguidance for the
engine's tokenizer (torch-free; llguidance is imported on first use).

Forms (`request_grammar`):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ..., "description": ...}}``;
- ``json_schema=``: a schema as a dict, a JSON string, or a pydantic model class (its ``model_json_schema()``);
- three forms beyond OpenAI's, for vLLM's structured-output fields (the server maps ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` to them): ``{"type": "regex", "regex": "..."}``
  (llguidance's regex syntax, that of Rust's regex crate, matched whole), ``{"type": "choice", "choice": ["a",
  "b"]}`` (exactly one of the strings) and ``{"type": "grammar", "grammar": "..."}`` (a Lark grammar, or GBNF as
  vLLM and llama.cpp write it, converted by llguidance's ``gbnf_to_lark``).

JSON is generated without free whitespace (llguidance's ``whitespace_flexible: false``: ``{"a":1,"b":[2]}``), so a
small model cannot spend its token budget on blank lines; a schema's own ``"x-guidance"`` options override that.
The grammar ends the request: once it is complete only EOS is allowed (the engine's EOS ids, plus the request's own;
see `cbnb.runner.grammar`). A request still cut by ``max_new_tokens`` ends with unfinished JSON (finish reason
"length"), as with OpenAI.

With OpenAI's ``"strict": true`` (as in its strict mode), an object schema that lists ``properties`` and says
nothing of ``additionalProperties`` takes no other property (`closed`); without it, JSON Schema's default (other
properties allowed) holds. A pydantic model class given as ``json_schema=`` is always closed that way (the openai
SDK's ``parse()`` sends its models strict too; a model with ``extra="allow"`` says ``additionalProperties`` itself
and keeps it); a dict or JSON text is taken as written.

A grammar that does not compile raises `ValueError` naming the field (``response_format.json_schema.schema`` or
``json_schema``) and llguidance's message, at submit.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["CompiledGrammar", "request_grammar", "json_schema_of", "closed", "warm", "MISSING_LIBRARY"]

MISSING_LIBRARY = "structured output needs the llguidance package: pip install llguidance"
_JSON_OPTIONS = {"whitespace_flexible": False}
_lock = threading.Lock()
_tokenizers: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}  # (id(tokenizer), vocab, eos) -> (hf, ll)


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ValueError(MISSING_LIBRARY) from None
    return llguidance


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated grammar for one tokenizer (shared by the requests that use it; compared by identity).

    Attributes:
        field: the request field it came from ("response_format" or "json_schema").
        kind: "json_object", "json_schema", "regex", "choice" or "grammar".
        name: the schema's name (OpenAI's ``json_schema.name``) or "".
        source: llguidance's grammar definition (a JSON string).
        tokenizer: llguidance's ``LLTokenizer`` (vocabulary and EOS ids of the engine).
        schema: the JSON schema ({} for the regex, choice and grammar forms).
    """

    field: str
    kind: str
    name: str
    source: str
    tokenizer: Any
    schema: dict

    def matcher(self) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the grammar's start."""
        return _llg().LLMatcher(self.tokenizer, self.source, log_level=0)

    def describe(self) -> str:
        return f"{self.kind}({self.name})" if self.name else self.kind


def json_schema_of(v: Any, field: str) -> dict:
    """A JSON schema as a dict, from a dict, a JSON string or a pydantic model class.

    Raises:
        ValueError: naming `field`, for anything else.
    """
    if isinstance(v, type) and hasattr(v, "model_json_schema"):
        v = v.model_json_schema()
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"{field} must be a JSON schema (an object); got text that is not JSON: {e}") from None
    if not isinstance(v, dict):
        raise ValueError(f"{field} must be a JSON schema (a dict, a JSON string or a pydantic model class); got "
                         f"{type(v).__name__}")
    return v


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed(schema: Any) -> Any:
    """A copy of `schema` where every object schema with ``properties`` and no ``additionalProperties`` gets
    ``"additionalProperties": false`` (nested schemas included)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: closed(sub) for name, sub in v.items()}
        elif k in _SUBSCHEMA_LISTS or k in ("items", "not", "if", "then", "else", "additionalProperties"):
            out[k] = closed(v)
        else:
            out[k] = v
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _text_form(rf: dict) -> tuple[str, str, str]:
    """(kind, "", llguidance source) of the regex, choice and grammar forms (not compiled yet)."""
    f, kind = "response_format", rf["type"]
    extra = set(rf) - {"type", kind}
    if extra:
        raise ValueError(f"{f}.{sorted(extra)[0]} is not a field of a {kind!r} response_format")
    v = rf.get(kind)
    M = _llg().LLMatcher
    try:
        if kind == "choice":
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise ValueError(f"{f}.choice must be a non-empty list of non-empty strings; got {v!r}")
            return kind, "", M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in v))
        if not isinstance(v, str) or not v:
            raise ValueError(f"{f}.{kind} must be a non-empty string; got {v!r}")
        if kind == "regex":
            return kind, "", M.grammar_from_regex(v)
        from llguidance.gbnf_to_lark import any_to_lark

        return kind, "", M.grammar_from_lark(any_to_lark(v))
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"{f}.{kind} does not compile: {e}") from None
    except ValueError as e:
        if str(e).startswith(f):
            raise
        raise ValueError(f"{f}.{kind} does not compile: {e}") from None


def _response_format(rf: Any) -> tuple[str, str, dict] | None:
    """(kind, name, schema) of OpenAI's response_format, or None for text."""
    f = "response_format"
    if not isinstance(rf, dict):
        raise ValueError(f"{f} must be an object such as {{'type': 'json_object'}}; got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        extra = set(rf) - {"type"}
        if extra:
            raise ValueError(f"{f}.{sorted(extra)[0]} is not a field of a 'text' response_format")
        return None
    if kind == "json_object":
        extra = set(rf) - {"type"}
        if extra:
            raise ValueError(f"{f}.{sorted(extra)[0]} is not a field of a 'json_object' response_format")
        return "json_object", "", {"type": "object"}
    if kind != "json_schema":
        raise ValueError(f"{f}.type must be 'text', 'json_object', 'json_schema', 'regex', 'choice' or 'grammar'; "
                         f"got {kind!r}")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise ValueError(f"{f}.{sorted(extra)[0]} is not a field of a 'json_schema' response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError(f"{f}.json_schema must be an object {{'name': ..., 'schema': {{...}}}}; got "
                         f"{type(js).__name__}")
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValueError(f"{f}.json_schema.{sorted(extra)[0]} is not a field (name, schema, strict, description)")
    name = js.get("name", "")
    if not isinstance(name, str) or len(name) > 64:
        raise ValueError(f"{f}.json_schema.name must be a string of at most 64 characters; got {name!r}")
    if js.get("strict") not in (None, True, False):
        raise ValueError(f"{f}.json_schema.strict must be true, false or null; got {js.get('strict')!r}")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise ValueError(f"{f}.json_schema.description must be a string")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ValueError(f"{f}.json_schema.schema must be a JSON schema object; got {type(schema).__name__}")
    return "json_schema", name, closed(schema) if js.get("strict") else schema


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's tokenizer for a transformers fast tokenizer (built once per tokenizer, ~0.5 s)."""
    key = (id(tokenizer), vocab_size, eos)
    with _lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    _llg()
    import llguidance.hf

    n_vocab = max(vocab_size, len(tokenizer))
    try:
        ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=list(eos) or None)
    except ValueError as e:
        raise ValueError(f"structured output needs a fast (Rust) transformers tokenizer: {e}") from None
    with _lock:
        if len(_tokenizers) > 8:
            _tokenizers.clear()
        _tokenizers[key] = (tokenizer, ll)
    return ll


def warm(tokenizer: Any, vocab_size: int, eos: Any) -> None:
    """Build llguidance's tokenizer for this engine now (~0.5 s once), e.g. on a worker thread, so that the first
    `request_grammar` does not pay it. Raises ValueError as `request_grammar`."""
    if tokenizer is not None:
        _ll_tokenizer(tokenizer, int(vocab_size), tuple(sorted(int(i) for i in eos or ())))


def request_grammar(tokenizer: Any, vocab_size: int, eos: Any, *, response_format: Any = None,
                    json_schema: Any = None) -> CompiledGrammar | None:
    """The compiled grammar of a request (None when it has none), from at most one of the two forms.

    Args:
        tokenizer: the engine's transformers tokenizer (a fast one).
        vocab_size: the model's vocabulary (the logits' width).
        eos: the engine's EOS ids (the grammar's end token).
        response_format, json_schema: see the module docstring.

    Raises:
        ValueError: more than one form, a malformed form, no tokenizer, or a grammar that does not compile (the
            message names the field and gives llguidance's reason).
    """
    if response_format is None and json_schema is None:
        return None
    if response_format is not None and json_schema is not None:
        raise ValueError("json_schema: give response_format or json_schema, not both")
    field = "response_format" if response_format is not None else "json_schema"
    source = None
    if field == "response_format" and isinstance(response_format, dict) and response_format.get("type") in (
            "regex", "choice", "grammar"):
        kind, name, source = _text_form(response_format)
        schema, where = {}, f"response_format.{kind}"
    elif field == "response_format":
        parsed = _response_format(response_format)
        if parsed is None:
            return None
        kind, name, schema = parsed
        where = "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    else:
        kind, name, schema, where = "json_schema", "", json_schema_of(json_schema, "json_schema"), "json_schema"
        if isinstance(json_schema, type):  # a pydantic model: closed, as the openai SDK's parse() asks (strict)
            schema = closed(schema)
    if tokenizer is None:
        raise ValueError(f"{field} needs the engine's tokenizer (structured output works on text); this engine "
                         "has none")
    llg = _llg()
    M = llg.LLMatcher
    try:
        if source is None:
            source = M.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where} does not compile: {e}") from None
    ll = _ll_tokenizer(tokenizer, int(vocab_size), tuple(sorted(int(i) for i in eos or ())))
    is_error, messages = M.validate_grammar_with_warnings(source, ll)
    if is_error:
        raise ValueError(f"{where} does not compile: {messages[0] if messages else 'invalid grammar'}")
    return CompiledGrammar(field, kind, name, source, ll, schema)
