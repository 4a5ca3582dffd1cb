"""vLLM's extra request fields, mapped onto what cbnb already has (dependency-free; used by `protocol`).

Structured output. Every spelling becomes the engine's one `response_format` (llguidance grammars,
`cbnb.engine.structured`), so a request carries at most one of them (400 naming the second otherwise):

- OpenAI's ``response_format`` (``json_object``, ``json_schema``), on chat and, as vLLM, on completions;
- vLLM's older ``guided_json`` (a schema, as an object or JSON text; its objects closed, as vLLM's default backend
  builds them: an object that lists ``properties`` takes no other), ``guided_regex``, ``guided_choice`` (a list of
  strings), ``guided_grammar`` (GBNF or Lark);
- vLLM's ``structured_outputs``: an object with exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object`` (true), plus the options ``disable_any_whitespace`` (JSON here never has free whitespace, so it
  changes nothing), ``disable_additional_properties`` (objects always take only the properties they list, here as
  with vLLM's default backend, xgrammar: the option exists in vLLM to make its guidance backend do the same),
  ``disable_fallback`` and ``backend`` (llguidance is the one backend); ``whitespace_pattern`` and
  ``structural_tag`` are refused (not supported yet). ``guided_decoding_backend`` is accepted and changes nothing.

Template and tokenization (chat; see `TemplateOptions`): ``chat_template``, ``chat_template_kwargs``,
``add_generation_prompt`` (default true), ``continue_final_message`` (the last message is left open and the model
continues it; needs ``add_generation_prompt`` false, as in vLLM), ``add_special_tokens`` (default false for chat:
the template writes them), ``documents`` (passed to the template). ``truncate_prompt_tokens`` = k keeps the prompt's
last k tokens (-1: the model's context); completions' ``add_special_tokens`` (default true).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["structured_format", "TemplateOptions", "STRUCTURED_FIELDS"]

STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")
_SO_FORMS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "backend",
               "whitespace_pattern")


class FieldError(ValueError):
    """A bad value of `param` (turned into a 400 naming it by `protocol`)."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param, self.unsupported = param, unsupported


def _schema_form(schema: Any, param: str, name: str, strict: bool = False) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise FieldError(param, f"{param} must be a JSON schema (an object, or JSON text of one): {e}") from None
    if not isinstance(schema, dict):
        raise FieldError(param, f"{param} must be a JSON schema (an object); got {type(schema).__name__}")
    js: dict[str, Any] = {"name": name, "schema": schema}
    if strict:
        js["strict"] = True
    return {"type": "json_schema", "json_schema": js}


def _structured_outputs(so: dict) -> dict:
    p = "structured_outputs"
    unknown = set(so) - set(_SO_FORMS) - set(_SO_OPTIONS)
    if unknown:
        raise FieldError(f"{p}.{sorted(unknown)[0]}", f"Unrecognized request argument supplied: "
                         f"{p}.{sorted(unknown)[0]} (forms: {', '.join(_SO_FORMS[:5])})")
    forms = [k for k in _SO_FORMS if so.get(k) not in (None, False)]
    if len(forms) != 1:
        raise FieldError(p, f"{p} must hold exactly one of {', '.join(_SO_FORMS[:5])}; got "
                         f"{', '.join(forms) or 'none'}")
    kind = forms[0]
    for opt in ("structural_tag", "whitespace_pattern"):
        if so.get(opt) is not None:
            raise FieldError(f"{p}.{opt}", f"not supported yet: {p}.{opt}", unsupported=True)
    for opt in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if so.get(opt) is not None and not isinstance(so[opt], bool):
            raise FieldError(f"{p}.{opt}", f"{p}.{opt} must be a boolean; got {type(so[opt]).__name__}")
    if so.get("backend") is not None and not isinstance(so["backend"], str):
        raise FieldError(f"{p}.backend", f"{p}.backend must be a string")
    v = so[kind]
    if kind == "json_object":
        if v is not True:
            raise FieldError(f"{p}.json_object", f"{p}.json_object must be true; got {v!r}")
        return {"type": "json_object"}
    if kind == "json":
        # closed objects, as vLLM's default backend (xgrammar) builds them; disable_additional_properties exists
        # in vLLM to make its guidance backend do the same, so it changes nothing here
        return _schema_form(v, f"{p}.json", "structured_outputs", strict=True)
    return {"type": kind, kind: v}


def structured_format(body: Any) -> tuple[str, dict] | None:
    """(the field it came from, the engine's `response_format`) of a request body, or None without one.

    Raises:
        FieldError: two forms at once, or a malformed one (the message names the field).
    """
    given = [f for f in STRUCTURED_FIELDS if getattr(body, f, None) is not None]
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.get("type", "text") == "text":
        if set(rf) - {"type"}:
            raise FieldError("response_format", f"response_format.{sorted(set(rf) - {'type'})[0]} is not a field "
                             "of a 'text' response_format")
        given.remove("response_format")  # plain text: no grammar
    if not given:
        return None
    if len(given) > 1:
        raise FieldError(given[1], f"{given[1]} cannot be combined with {given[0]}: give one structured-output "
                         "form")
    field = given[0]
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise FieldError("guided_whitespace_pattern", "not supported yet: guided_whitespace_pattern",
                         unsupported=True)
    if field == "response_format":
        kind = rf.get("type")
        if kind not in ("json_object", "json_schema"):
            raise FieldError("response_format", "response_format.type must be 'text', 'json_object' or "
                             f"'json_schema'; got {json.dumps(kind) if isinstance(kind, str) else type(kind).__name__}")
        return field, rf
    if field == "guided_json":
        return field, _schema_form(body.guided_json, "guided_json", "guided_json", strict=True)  # closed, as vLLM
    if field == "guided_regex":
        return field, {"type": "regex", "regex": body.guided_regex}
    if field == "guided_choice":
        return field, {"type": "choice", "choice": body.guided_choice}
    if field == "guided_grammar":
        return field, {"type": "grammar", "grammar": body.guided_grammar}
    return field, _structured_outputs(body.structured_outputs)


@dataclasses.dataclass(frozen=True)
class TemplateOptions:
    """How a chat's messages become its prompt (vLLM's chat fields; see the module docstring).

    Attributes:
        add_generation_prompt: end with the assistant turn's opening (default True).
        continue_final_message: leave the last message open for the model to continue.
        chat_template: a Jinja template replacing the tokenizer's own, or None.
        kwargs: extra variables for the template (`chat_template_kwargs`, and `documents`).
        add_special_tokens: tokenize the rendered text with the tokenizer's special tokens (BOS) added.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    add_special_tokens: bool = False

    @property
    def default(self) -> bool:
        return self == TemplateOptions()

    @classmethod
    def of(cls, body: Any) -> "TemplateOptions":
        """The options of a chat body.

        Raises:
            FieldError: continue_final_message with add_generation_prompt true, or without a final assistant
                message; template variables that shadow the template's own.
        """
        cont = bool(body.continue_final_message)
        gen = (not cont) if body.add_generation_prompt is None else body.add_generation_prompt
        if cont and gen:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt=false "
                             "(the last message is continued, no new turn is opened)")
        if cont and body.messages[-1].role != "assistant":
            raise FieldError("continue_final_message", "continue_final_message needs the last message to be the "
                             f"assistant's (to continue); got a {body.messages[-1].role!r} message")
        kw = dict(body.chat_template_kwargs or {})
        reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                    "tokenize", "return_dict", "return_tensors"} & set(kw)
        if reserved:
            raise FieldError("chat_template_kwargs", f"chat_template_kwargs.{sorted(reserved)[0]} is set by the "
                             "request itself, not a template variable")
        if body.documents is not None:
            kw["documents"] = body.documents
        return cls(gen, cont, body.chat_template, kw, bool(body.add_special_tokens))
