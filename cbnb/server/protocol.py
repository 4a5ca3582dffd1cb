"""OpenAI-compatible request schemas, their validation, and OpenAI-style error bodies.

A request body is parsed once (`parse_request`) into a `GenerationRequest`: the prompt as the engine takes it (text,
token ids or chat messages) plus the engine's `submit` arguments. Every problem becomes an `ApiError` carrying the
HTTP status and the body OpenAI's API would send::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Schemas follow the OpenAI API reference for `POST /v1/completions` and `POST /v1/chat/completions`, plus vLLM's
extra sampling fields (`VLLM_FIELDS`: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`; load generators such as GuideLLM send
`ignore_eos`). OpenAI's metadata fields that do not change the output (`METADATA_FIELDS`: `metadata`, `store`,
`service_tier`, `user`, ...) are accepted and ignored. Unknown fields are refused (400, naming the field), never
ignored. Fields the engine cannot honour (`suffix`, `best_of` > 1, `echo` with `stream` and `logprobs`, ...) are
parsed and range-checked, and then either mapped to an engine argument when `engine.submit` takes one (see
`ENGINE_ARGS`) or answered with 400 "not supported yet: <field>" when the value would change the output; a neutral
value (`best_of=1`, `suffix=""`) is accepted.

Structured output (chat): `response_format` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
{...}}`` goes to the engine's `response_format` (a grammar mask, `cbnb.engine.structured`); a schema that does not
compile is a 400 naming `response_format`. Tools (chat): `tools`, `tool_choice` ("none", "auto", "required" or
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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .tools import ToolSpec, call_schema

__all__ = ["ApiError", "GenerationRequest", "CompletionBody", "ChatCompletionBody", "parse_json", "parse_request",
           "ENGINE_ARGS", "METADATA_FIELDS", "VLLM_FIELDS", "MAX_CHOICES", "error_body"]

INT64 = 2**63
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_STOP = 4  # OpenAI accepts up to 4 stop sequences
MAX_STOP_CHARS = 256  # per stop sequence: the server searches each streamed piece for them
MAX_CHOICES = 128  # engine requests per HTTP request: prompts x n
MAX_STOP_TOKEN_IDS = 64

# OpenAI fields that describe the request for the caller's own records: accepted, never change the output.
METADATA_FIELDS = ("metadata", "store", "service_tier", "user", "prompt_cache_key", "safety_identifier")
# vLLM's extra sampling fields this server takes (besides OpenAI's own).
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "include_stop_str_in_output")

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


# ----------------------------------------------------------------------------------------------------- schemas
class _Body(BaseModel):
    # strict: no "5" -> 5 coercion; forbid: an unknown field is an error, not silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: "StreamOptions | None" = None
    stop: Any = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    # OpenAI metadata: accepted, ignored (METADATA_FIELDS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=256)
    # vLLM extensions (VLLM_FIELDS)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:  # OpenAI's limits: 16 pairs, keys <= 64 and values <= 512 characters
            raise ValueError(f"at most 16 key-value pairs; got {len(v)}")
        for k, val in (v or {}).items():
            if len(k) > 64 or len(val) > 512:
                raise ValueError("keys must have at most 64 characters and values at most 512")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(i < 0 for i in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences; got {len(v)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"stop sequences must have 1 to {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isdigit():
                raise ValueError(f"keys must be token ids (digit strings); got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"bias of token {k} must be in [-100, 100]; got {b}")
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk (GuideLLM asks for it)


class CompletionBody(_Body):
    """`POST /v1/completions`. `prompt`: a string, a list of token ids, or a batch: a non-empty list of strings
    and/or token-id lists (validated into a list of prompts)."""

    prompt: Any
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (the prompt's logprobs alone)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        def one(p: Any) -> bool:
            return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in p))

        if one(v):
            return [v]
        if isinstance(v, list) and v and all(one(p) for p in v):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts in one request; got {len(v)}")
            return v
        if isinstance(v, list) and v and any(isinstance(p, (str, list)) for p in v):  # a batch with a bad element
            i, bad = next((i, p) for i, p in enumerate(v) if not one(p))
            raise ValueError(f"prompt[{i}] must be a string or a non-empty list of token ids; got "
                             f"{_short(bad)}")
        raise ValueError("must be a string, a non-empty list of token ids, or a non-empty list of those")


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    """An assistant message's earlier call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list):  # content parts: only text parts are supported
            texts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only {{'type': 'text', 'text': ...}} parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string or a list of text parts")


class ChatCompletionBody(_Body):
    """`POST /v1/chat/completions`: the tokenizer's chat template turns `messages` into the prompt."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if (isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
                and isinstance(v["function"].get("name"), str) and set(v) == {"type", "function"}
                and set(v["function"]) == {"name"}):
            return v
        raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")


class TokenizeBody(BaseModel):
    """vLLM's `POST /tokenize`: `prompt` (text) or `messages` (the chat template applied), not both."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool | None = None  # messages only; default true


class DetokenizeBody(BaseModel):
    """vLLM's `POST /detokenize`: `tokens`, a list of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


_Body.model_rebuild()
CompletionBody.model_rebuild()
ChatCompletionBody.model_rebuild()


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


def _short(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__
    return s if len(s) <= 80 else s[:77] + "..."


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
    if stop and "stop" in engine_args:
        kw["stop"] = stop
        stop = None
    n = 1 if body.n is None else body.n
    if kind == "completion":
        prompts: list[Any] = body.prompt
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        logprobs = body.logprobs
        echo = bool(body.echo)
        if echo and logprobs is not None:
            kw["prompt_logprobs"] = logprobs
    else:
        prompts = [[_message(m) for m in body.messages]]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        echo = False
        tools, choice = _tools(body, kw, engine_args)
    if len(prompts) * n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; at most {MAX_CHOICES} "
                      "per request")
    if logprobs is not None:
        kw["logprobs"] = logprobs
    opts = body.stream_options
    if opts is not None and not body.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    return GenerationRequest(kind=kind, prompts=prompts, max_tokens=max_tokens, submit_kwargs=kw, stop=stop,
                             stream=bool(body.stream), include_usage=bool(opts and opts.include_usage),
                             continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
                             model=body.model, user=body.user, n=n, logprobs=logprobs,
                             stop_token_ids=body.stop_token_ids or None, echo=echo,
                             tools=tools if kind == "chat" else None, tool_choice=choice if kind == "chat" else None)


def _message(m: "ChatMessage") -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role if m.role != "developer" else "system", "content": m.content or ""}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role == "tool":
        out["name"] = m.name
    return out


def _tools(body: "ChatCompletionBody", kw: dict[str, Any], engine_args: frozenset[str]) -> tuple[Any, Any]:
    """(tools as dicts, tool_choice); maps response_format and a forced call to the engine's arguments."""
    rf = body.response_format
    if rf is not None and rf.get("type", "text") != "text":
        if "response_format" not in engine_args:
            raise unsupported("response_format", " (only {'type': 'text'})")
        kw["response_format"] = rf
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
            raise invalid("response_format", "response_format cannot be combined with tool_choice 'required' or a "
                          "named function (the call's own schema constrains the output)")
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
    for field, neutral, arg in (("min_p", 0, "min_p"), ("repetition_penalty", 1, "repetition_penalty")):
        if getattr(body, field) not in (None, neutral) and arg not in engine_args:
            raise unsupported(field)
    if body.skip_special_tokens is False:
        raise unsupported("skip_special_tokens", " = false (special tokens are always left out of the text)")
    if body.include_stop_str_in_output:
        raise unsupported("include_stop_str_in_output", " = true (the text always ends before a stop string)")
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
            raise unsupported("suffix")
        if body.best_of not in (None, 1):
            raise unsupported("best_of", " (only best_of=1)")
    else:
        assert isinstance(body, ChatCompletionBody)
        rf = body.response_format
        if rf is not None and rf.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise invalid("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema'; "
                          f"got {_short(rf.get('type'))}")
