"""The request bodies of the OpenAI-compatible routes as pydantic schemas, and the server's field lists (used by
`cbnb.server.protocol`, which validates with them and maps a body to the engine's arguments).

Strict (no "5" -> 5 coercion) and closed (an unknown field is an error naming it, never ignored). Every field the
openai SDK's types carry is declared, in requests and in messages (see `ChatMessage` and `ChatCompletionBody`), and
vLLM's extra fields (`VLLM_FIELDS`, `VLLM_CHAT_FIELDS`; their meaning: `cbnb.server.extras`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .tools import ToolSpec

__all__ = ["CompletionBody", "ChatCompletionBody", "ChatMessage", "TokenizeBody", "DetokenizeBody", "StreamOptions",
           "LegacyFunction", "METADATA_FIELDS", "VLLM_FIELDS", "VLLM_CHAT_FIELDS", "VLLM_UNIMPLEMENTED",
           "MAX_CHOICES", "INT64"]

INT64 = 2**63
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_STOP = 4  # OpenAI accepts up to 4 stop sequences
MAX_STOP_CHARS = 256  # per stop sequence: the server searches each streamed piece for them
MAX_CHOICES = 128  # engine requests per HTTP request: prompts x n
MAX_STOP_TOKEN_IDS = 64

# OpenAI fields that describe the request for the caller's own records: accepted, never change the output.
METADATA_FIELDS = ("metadata", "store", "service_tier", "user", "prompt_cache_key", "safety_identifier",
                   "prompt_cache_retention", "prompt_cache_options", "moderation")
# vLLM's extra sampling fields this server takes (besides OpenAI's own).
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens", "priority",
               "request_id", "truncate_prompt_tokens", "prompt_logprobs", "add_special_tokens",
               "return_tokens_as_token_ids", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "use_beam_search",
               "length_penalty")
# vLLM's request fields this server does not implement: 400 "not supported yet" (not "Unrecognized").
VLLM_UNIMPLEMENTED = ("allowed_token_ids", "bad_words", "cache_salt", "logits_processors", "return_token_ids",
                      "vllm_xargs", "kv_transfer_params", "mm_processor_kwargs", "media_io_kwargs",
                      "thinking_token_budget")
# vLLM's chat-only fields: the chat template's options and chat echo (cbnb.server.extras).
VLLM_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                    "echo", "documents")



def _short(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__
    return s if len(s) <= 80 else s[:77] + "..."



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
    spaces_between_special_tokens: bool | None = None
    # vLLM's beam search: false (its default, which clients send) is accepted; true is "not supported yet".
    # length_penalty only weighs beams, so without beam search it changes nothing.
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    # vLLM's request and structured-output fields (cbnb.server.extras)
    priority: int | None = Field(None, ge=-INT64, lt=INT64)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    guided_decoding_backend: str | None = Field(None, max_length=64)  # accepted: llguidance is the one backend
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's newer cache and moderation options: accepted, change nothing here (METADATA_FIELDS)
    prompt_cache_retention: str | None = Field(None, max_length=64)
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

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
    logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's limit is 5; vLLM's (--max-logprobs) 20

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


class FunctionCallBody(BaseModel):
    """The legacy `function_call` of an assistant message (OpenAI's pre-tools form)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


_TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text", "output_text": "text"}


class ChatMessage(BaseModel):
    """One message, with every field the openai SDK's message types carry (an assistant message dumped with
    `ChatCompletionMessage.model_dump()` holds `refusal`, `annotations`, `audio` and `function_call`, mostly null).

    `refusal` (an earlier refusal's text) stands in for an empty `content`; `annotations` (URL citations of the
    text) and vLLM's `reasoning_content` / `reasoning` change nothing here; a non-null `audio` (an earlier audio
    answer, known only to OpenAI by its id) is refused; a legacy `function_call` is read as one tool call; a
    ``"function"`` message (the legacy function result) as a tool message.
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None  # an earlier audio answer (by id): refused when set, see the docstring
    function_call: FunctionCallBody | None = None
    reasoning_content: str | None = None  # vLLM's messages carry it
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list):  # content parts: text parts (and an assistant's refusal parts)
            texts = []
            for i, part in enumerate(v):
                key = _TEXT_PARTS.get(part.get("type")) if isinstance(part, dict) else None
                if key is None or not isinstance(part.get(key), str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    what = f"'{kind}' parts are not supported (this server serves a text model); " if isinstance(
                        kind, str) else ""
                    raise ValueError(f"part {i}: {what}only {{'type': 'text', 'text': ...}} parts are supported")
                texts.append(part[key])
            return "".join(texts)
        raise ValueError("must be a string or a list of text parts")


class LegacyFunction(BaseModel):
    """An entry of the legacy `functions` list (read as a tool)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionBody(_Body):
    """`POST /v1/chat/completions`: the tokenizer's chat template turns `messages` into the prompt.

    Besides the fields of `_Body`: OpenAI's `audio` and `modalities` (text only: null / ["text"]), `prediction`
    (a speed hint: ignored), `reasoning_effort` and `verbosity` (options of OpenAI's reasoning models: ignored, as
    they mean nothing to the served model), `web_search_options` (refused: nothing searches the web here), the
    legacy `functions` / `function_call` (read as `tools` / `tool_choice`); vLLM's `VLLM_CHAT_FIELDS`.
    """

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[LegacyFunction] | None = Field(None, max_length=128)
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(None, max_length=32)
    verbosity: str | None = Field(None, max_length=32)
    web_search_options: dict[str, Any] | None = None
    # vLLM's chat fields (VLLM_CHAT_FIELDS)
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    echo: bool | None = None
    documents: list[dict[str, Any]] | None = None

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
