"""OpenAI-compatible request schemas, their validation, and OpenAI-style error bodies.

A request body is parsed once (`parse_request`) into a `GenerationRequest`: the prompt as the engine takes it (text,
token ids or chat messages) plus the engine's `submit` arguments. Every problem becomes an `ApiError` carrying the
HTTP status and the body OpenAI's API would send::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Schemas follow the OpenAI API reference for `POST /v1/completions` and `POST /v1/chat/completions` (every field the
openai SDK's types carry, in requests and in messages: see `ChatMessage` and `ChatCompletionBody`), plus vLLM's
extra fields (`VLLM_FIELDS`, `VLLM_CHAT_FIELDS`: sampling, detokenization, structured output, template, prompt
logprobs, truncation, request ids; mapped in `cbnb.server.extras`; load generators such as GuideLLM send
`ignore_eos`). OpenAI's metadata fields that do not change the output (`METADATA_FIELDS`: `metadata`, `store`,
`service_tier`, `user`, ...) are accepted and ignored. Unknown fields are refused (400, naming the field), never
ignored. Fields the engine cannot honour (`suffix`, `best_of` > 1, `echo` with `stream` and `logprobs`, ...) are
parsed and range-checked, and then either mapped to an engine argument when `engine.submit` takes one (see
`ENGINE_ARGS`) or answered with 400 "not supported yet: <field>" when the value would change the output; a neutral
value (`best_of=1`, `suffix=""`) is accepted.

Structured output (both endpoints): `response_format` ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {...}}``, and vLLM's `guided_*` / `structured_outputs` spellings (`cbnb.server.extras`), go to the
engine's `response_format` (a grammar mask, `cbnb.engine.structured`); a grammar that does not compile is a 400
naming the field it came in. Tools (chat): `tools`, `tool_choice` ("none", "auto", "required" or
``{"type": "function", "function": {"name": ...}}``) and `parallel_tool_calls`; "required" and a named function
become the engine's `json_schema` (one valid call, `cbnb.server.tools.call_schema`), so they cannot be combined
with `response_format`; assistant messages may carry `tool_calls` and tool messages `tool_call_id`.

Several outputs: `n` choices per prompt, and for completions a batch of prompts (`prompt` as a list of strings or
of token-id lists); each (prompt, choice) is one engine request, at most `MAX_CHOICES` of them per HTTP request.

Sampling: `temperature=0` is greedy, and so is any temperature below 1e-5 (as in vLLM: dividing float32 logits by
a temperature near 1e-38 overflows to inf and the sampler's probabilities become NaN); any other temperature
samples (OpenAI's default is 1.0, so a request without `temperature` samples). `top_p=1` means no top-p.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pydantic import ValidationError

from .extras import FieldError, TemplateOptions, structured_format
# the schemas (and field lists) live in `schemas`; importable from here as before
from .schemas import (GREEDY_BELOW, INT64, MAX_CHOICES, METADATA_FIELDS, VLLM_CHAT_FIELDS, VLLM_FIELDS,  # noqa: F401
                      VLLM_UNIMPLEMENTED, ChatCompletionBody, ChatMessage, CompletionBody, DetokenizeBody, TokenizeBody, _Body, _short)
from .tools import FunctionSpec, ToolSpec, call_schema

__all__ = ["ApiError", "GenerationRequest", "CompletionBody", "ChatCompletionBody", "parse_json", "parse_request",
           "ENGINE_ARGS", "METADATA_FIELDS", "VLLM_FIELDS", "VLLM_CHAT_FIELDS", "MAX_CHOICES", "error_body"]

# OpenAI field -> the `engine.submit` keyword that implements it (used when the engine's signature has it; the
# issue "generation parity" adds these to the engine).
ENGINE_ARGS = {
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "logit_bias": "logit_bias",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
}


class ApiError(Exception):
    """An error answered as OpenAI-style JSON.

    Args:
        status: HTTP status (400 invalid field, 401, 404 unknown model or route, 413, 429, 500, 503).
        message: what went wrong, naming the field and the allowed range where there is one.
        type: OpenAI's error type ("invalid_request_error", "authentication_error", "rate_limit_error",
            "server_error").
        param: the offending field (dotted path, e.g. "messages[0].content"), or None.
        code: a machine-readable code (e.g. "invalid_api_key", "model_not_found", "context_length_exceeded").
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an OpenAI error response."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> ApiError:
    return ApiError(400, f"not supported yet: {param}{detail}", param=param, code="unsupported_parameter")


# ----------------------------------------------------------------------------------------------------- parsing
@dataclasses.dataclass
class GenerationRequest:
    """A validated request, ready for the engine.

    Attributes:
        kind: "completion" or "chat".
        prompts: the prompts, in order: text or token ids (completions, one or a batch), or one list of chat
            messages ({"role", "content"} dicts) for chat.
        n: choices per prompt (each one engine request); the choice of prompt i, number j has index ``i * n + j``.
        max_tokens: tokens to generate at most, or None (chat without a limit: up to the model's context).
        submit_kwargs: `engine.submit` keyword arguments (sampling, seed, ignore_eos, mapped extensions); with a
            seed, choice j is submitted with ``seed + j``.
        logprobs: the engine's `logprobs` (the number of alternatives per token, 0..20), or None for none.
        stop_token_ids: token ids that end a choice besides the EOS (vLLM's `stop_token_ids`), or None.
        echo: completions' `echo`: the prompt comes first in each choice's text (and, with `logprobs`, its tokens'
            logprobs, from the engine's `prompt_logprobs`); with ``max_tokens == 0`` nothing is generated.
        stop: stop strings the server itself must find in the text (None when the engine handles `stop`).
        stream, include_usage: streaming flags; continuous_usage: usage so far in every chunk (with include_usage).
        model: the model name asked for (None: the served one).
        user: the OpenAI `user` field, if any (shown as part of the request's source).
        tools: chat's `tools` as dicts (rendered into the prompt), or None; tool_choice: "none", "auto",
            "required" or {"type": "function", ...} (None: "auto" with tools).
        template: chat's `TemplateOptions` (vLLM's template fields).
        add_special_tokens: completions: tokenize text prompts with the tokenizer's special tokens (default True).
        truncate: keep the prompt's last `truncate` tokens (-1: the model's context), or None.
        prompt_logprobs: vLLM's `prompt_logprobs` (alternatives per prompt token), or None.
        skip_special_tokens, include_stop_str: vLLM's detokenization options (the server decodes the text itself
            when either differs from the default; see `cbnb.server.generation.Choice`).
        token_ids_as_text: vLLM's `return_tokens_as_token_ids` (logprob tokens as "token_id:<id>").
        request_id: vLLM's `request_id` (the response's id), or None.
        chat_echo: chat's `echo` (the last message's content starts the answer when it is the assistant's).
    """

    kind: str
    prompts: list[Any]
    max_tokens: int | None
    submit_kwargs: dict[str, Any]
    stop: list[str] | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str | None
    user: str | None
    n: int = 1
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    echo: bool = False
    tools: list[dict] | None = None
    tool_choice: Any = None
    template: TemplateOptions = dataclasses.field(default_factory=TemplateOptions)
    add_special_tokens: bool = True
    truncate: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    token_ids_as_text: bool = False
    request_id: str | None = None
    chat_echo: bool = False
    structured_field: str | None = None

    @property
    def own_detokenizer(self) -> bool:
        """Whether the server decodes the text itself (special tokens kept, or stop strings kept in the text)."""
        return not self.skip_special_tokens or self.include_stop_str

    @property
    def prompt(self) -> Any:
        """The first prompt (the only one for chat and for a single completion)."""
        return self.prompts[0]

    def seed_of(self, choice: int) -> int | None:
        """The seed of choice `choice` (``seed + choice``), or None without a seed."""
        seed = self.submit_kwargs.get("seed")
        return None if seed is None else seed + choice


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body.

    Raises:
        ApiError: 400 when the body is not UTF-8 JSON or not an object.
    """
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise invalid("body", "request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("body", f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise invalid("body", f"request body must be a JSON object; got {type(obj).__name__}")
    return obj


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    param = _param(loc) or "body"
    if err["type"] == "extra_forbidden":
        if param in VLLM_UNIMPLEMENTED:  # known to a vLLM user: say it is vLLM's and not here, not "unknown"
            return unsupported(param, " (a vLLM field this server does not implement)")
        return invalid(param, f"Unrecognized request argument supplied: {param}", "unknown_parameter")
    if err["type"] == "missing":
        return invalid(param, f"Missing required parameter: {param}", "missing_parameter")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    got = "" if "; got " in msg else f"; got {_short(err.get('input'))}"  # our own validators may say it already
    item = re.match(rf"({re.escape(param)}\[\d+\]) ", msg)  # a batch's element named by the validator
    if item:
        return invalid(item.group(1), msg)
    return invalid(param, f"Invalid value for {param}: {msg}{got}")


def parse_request(kind: str, obj: dict[str, Any], engine_args: frozenset[str]) -> GenerationRequest:
    """Validate a completions ("completion") or chat ("chat") body and map it to engine arguments.

    Args:
        kind: "completion" or "chat".
        obj: the parsed JSON object.
        engine_args: the keyword names `engine.submit` takes (what the engine supports).

    Raises:
        ApiError: 400 naming the first invalid, unknown or unsupported field.
    """
    schema = CompletionBody if kind == "completion" else ChatCompletionBody
    try:
        body = schema.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None
    try:
        return _parse(kind, body, engine_args)
    except FieldError as e:
        if e.unsupported:
            raise ApiError(400, str(e), param=e.param, code="unsupported_parameter") from None
        raise invalid(e.param, str(e)) from None


def _parse(kind: str, body: Any, engine_args: frozenset[str]) -> GenerationRequest:
    _refuse_unsupported(body, engine_args)
    kw: dict[str, Any] = {}
    t = 1.0 if body.temperature is None else body.temperature
    if t >= GREEDY_BELOW:
        kw.update(do_sample=True, temperature=t)
        if body.top_p is not None and body.top_p < 1:
            kw["top_p"] = body.top_p
        if body.top_k is not None and body.top_k > 0:
            kw["top_k"] = body.top_k
        if body.min_p:
            kw["min_p"] = body.min_p
    if body.seed is not None:
        kw["seed"] = body.seed
    if body.ignore_eos:
        kw["ignore_eos"] = True
    if body.repetition_penalty is not None and body.repetition_penalty != 1:
        kw["repetition_penalty"] = body.repetition_penalty
    for field, arg in ENGINE_ARGS.items():
        value = getattr(body, field, None)
        if field != "stop" and arg in engine_args and value not in (None, 0, {}):
            kw[arg] = {int(k): v for k, v in value.items()} if field == "logit_bias" else value
    stop = body.stop
    skip_special = body.skip_special_tokens is not False
    include_stop = bool(body.include_stop_str_in_output)
    if stop and "stop" in engine_args and skip_special and not include_stop:
        kw["stop"] = stop  # else the server finds them in its own text (Choice)
        stop = None
    structured = structured_format(body)
    n = 1 if body.n is None else body.n
    if kind == "completion":
        prompts: list[Any] = body.prompt
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        logprobs = body.logprobs
        echo = bool(body.echo)
        if echo and logprobs is not None:
            kw["prompt_logprobs"] = logprobs
        if structured is not None:
            _grammar(kw, structured, engine_args)
        template = TemplateOptions()
    else:
        prompts = [[_message(m, i) for i, m in enumerate(body.messages)]]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        echo = False
        template = TemplateOptions.of(body)
        tools, choice = _tools(body, kw, engine_args, structured)
    if body.prompt_logprobs is not None:
        if "prompt_logprobs" not in engine_args:
            raise unsupported("prompt_logprobs")
        if body.stream:
            raise unsupported("prompt_logprobs", " with stream=true (prompt logprobs come with the whole response)")
        kw["prompt_logprobs"] = max(body.prompt_logprobs, kw.get("prompt_logprobs", 0))
    if len(prompts) * n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; at most {MAX_CHOICES} "
                      "per request")
    if logprobs is not None:
        kw["logprobs"] = logprobs
    structured_field = kw.pop("_structured_field", None)
    opts = body.stream_options
    if opts is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    return GenerationRequest(kind=kind, prompts=prompts, max_tokens=max_tokens, submit_kwargs=kw, stop=stop,
                             stream=bool(body.stream), include_usage=bool(opts and opts.include_usage),
                             continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
                             model=body.model, user=body.user, n=n, logprobs=logprobs,
                             stop_token_ids=body.stop_token_ids or None, echo=echo,
                             tools=tools if kind == "chat" else None, tool_choice=choice if kind == "chat" else None,
                             template=template, add_special_tokens=body.add_special_tokens is not False,
                             truncate=body.truncate_prompt_tokens, prompt_logprobs=body.prompt_logprobs,
                             skip_special_tokens=skip_special, include_stop_str=include_stop,
                             token_ids_as_text=bool(body.return_tokens_as_token_ids), request_id=body.request_id,
                             chat_echo=kind == "chat" and bool(body.echo), structured_field=structured_field)


def _message(m: "ChatMessage", i: int) -> dict[str, Any]:
    if m.audio is not None:
        raise unsupported(f"messages[{i}].audio", " (an earlier audio answer: this server serves text)")
    role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
    out: dict[str, Any] = {"role": role, "content": m.content or m.refusal or ""}
    calls = [c.model_dump() for c in m.tool_calls or ()]
    if m.function_call is not None:  # the legacy form of one call
        calls.append({"id": f"call_{m.function_call.name}", "type": "function",
                      "function": m.function_call.model_dump()})
    if calls:
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and role == "tool":
        out["name"] = m.name
    return out


def _grammar(kw: dict[str, Any], structured: tuple[str, dict], engine_args: frozenset[str]) -> None:
    field, rf = structured
    if "response_format" not in engine_args:
        raise unsupported(field, " (this engine has no structured output)")
    kw["response_format"] = rf
    kw["_structured_field"] = field  # for the param of an error the engine raises (popped before submit)


def _legacy_functions(body: "ChatCompletionBody") -> None:
    """OpenAI's pre-tools `functions` / `function_call`, read as `tools` / `tool_choice`."""
    if body.functions is None and body.function_call is None:
        return
    if body.tools is not None or body.tool_choice is not None:
        raise invalid("functions", "functions / function_call cannot be combined with tools / tool_choice")
    if body.functions:
        body.tools = [ToolSpec(type="function", function=FunctionSpec(**f.model_dump())) for f in body.functions]
    fc = body.function_call
    if fc is None or fc in ("none", "auto"):
        body.tool_choice = fc
    elif isinstance(fc, dict) and set(fc) == {"name"} and isinstance(fc["name"], str):
        body.tool_choice = {"type": "function", "function": {"name": fc["name"]}}
    else:
        raise invalid("function_call", "function_call must be 'none', 'auto' or {'name': ...}")


def _tools(body: "ChatCompletionBody", kw: dict[str, Any], engine_args: frozenset[str],
           structured: tuple[str, dict] | None) -> tuple[Any, Any]:
    """(tools as dicts, tool_choice); maps structured output and a forced call to the engine's arguments."""
    _legacy_functions(body)
    if structured is not None:
        _grammar(kw, structured, engine_args)
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", f"tool_choice {_short(choice) if isinstance(choice, str) else 'a function'} "
                          "needs tools")
        return None, None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools", f"function names must be unique; got {names}")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise invalid("tool_choice", f"tool_choice names {choice['function']['name']!r}, which is not in tools "
                      f"({', '.join(names)})")
    forced = choice == "required" or isinstance(choice, dict)
    if forced:
        if "response_format" in kw:
            field = kw["_structured_field"]
            raise invalid(field, f"{field} cannot be combined with tool_choice 'required' or a named function (the "
                          "call's own schema constrains the output)")
        if "json_schema" not in engine_args:
            raise unsupported("tool_choice", " (the engine has no json_schema)")
        kw["json_schema"] = call_schema(tools, choice["function"]["name"] if isinstance(choice, dict) else None)
    return tools, (choice or "auto")


def parse_tokenize(obj: dict[str, Any]) -> TokenizeBody:
    """Validate a `/tokenize` body.

    Raises:
        ApiError: 400 naming the field (unknown, wrong type, or neither / both of `prompt` and `messages`).
    """
    try:
        body = TokenizeBody.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "send exactly one of prompt (text) and messages (chat)")
    if body.prompt is not None and body.add_generation_prompt is not None:
        raise invalid("add_generation_prompt", "add_generation_prompt is only allowed with messages")
    return body


def parse_detokenize(obj: dict[str, Any]) -> DetokenizeBody:
    """Validate a `/detokenize` body.

    Raises:
        ApiError: 400 naming the field.
    """
    try:
        return DetokenizeBody.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None


def _refuse_unsupported(body: _Body, engine_args: frozenset[str]) -> None:
    """400 "not supported yet" for every field whose value would change the output and that nothing implements."""
    for field in ("presence_penalty", "frequency_penalty", "min_tokens"):
        if getattr(body, field) not in (None, 0) and ENGINE_ARGS[field] not in engine_args:
            raise unsupported(field)
    if body.logit_bias and "logit_bias" not in engine_args:
        raise unsupported("logit_bias")
    if body.use_beam_search:
        raise unsupported("use_beam_search", " (beam search; sample n choices and compare their logprobs)")
    for field, neutral, arg in (("min_p", 0, "min_p"), ("repetition_penalty", 1, "repetition_penalty")):
        if getattr(body, field) not in (None, neutral) and arg not in engine_args:
            raise unsupported(field)
    logprobs = body.logprobs if isinstance(body, CompletionBody) else (body.top_logprobs if body.logprobs else None)
    if logprobs is not None and "logprobs" not in engine_args:
        raise unsupported("logprobs")
    if isinstance(body, CompletionBody):
        if body.echo and body.stream and body.logprobs is not None:
            raise unsupported("echo", " with stream=true and logprobs (echo with logprobs works without streaming)")
        if body.echo and body.logprobs is not None and "prompt_logprobs" not in engine_args:
            raise unsupported("echo", " with logprobs (the engine does not compute prompt logprobs)")
        if body.max_tokens == 0 and not body.echo:
            raise invalid("max_tokens", "max_tokens must be >= 1; 0 is allowed only with echo=true (the prompt "
                          "alone); got 0")
        if body.suffix:
            raise unsupported("suffix", " (fill-in-the-middle needs a model trained for it and its template)")
        if body.best_of not in (None, 1):
            raise unsupported("best_of", " > 1 (ask for n choices and pick among them; their logprobs say how "
                              "likely each is)")
    else:
        assert isinstance(body, ChatCompletionBody)
        if body.web_search_options is not None:
            raise unsupported("web_search_options", " (nothing searches the web here)")
        if body.audio is not None or (body.modalities and body.modalities != ["text"]):
            raise unsupported("audio", " (this server answers with text)")

