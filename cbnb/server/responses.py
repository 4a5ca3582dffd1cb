"""`POST /v1/responses`: OpenAI's Responses API for text, on the chat path.

A Responses request is translated into a chat request (`to_chat`) and runs as one: the same validation, template,
tools, structured output and engine request. Then the chat result is written as a Response (`response_body`) or,
streamed, as the Responses API's events (`ResponseEvents`).

Request. `input` is text (one user message) or a list of items: messages (``role`` user / system / developer /
assistant; ``content`` text or ``input_text`` / ``output_text`` / ``refusal`` parts), ``function_call`` items (an
earlier call: an assistant message's tool call) and ``function_call_output`` items (its result: a tool message);
``reasoning`` items are skipped (the served model has none). `instructions` becomes the first system message.
`previous_response_id` continues a response this server made (kept in memory, the last `STORED` of them, when the
request's `store` is not false; its instructions are not carried over, as in OpenAI's API). `max_output_tokens`,
`temperature`, `top_p`, `top_logprobs` (with ``include: ["message.output_text.logprobs"]``), `text.format`
(``text``, ``json_object``, ``json_schema``: the chat's `response_format`), function `tools` and `tool_choice`,
`parallel_tool_calls`, and vLLM's sampling fields are the chat's. Fields that describe the request for the caller
(`metadata`, `user`, `store`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `truncation`, `reasoning`,
`max_tool_calls`, `include` entries other than logprobs, `stream_options`, ...) are accepted and change nothing;
`background`, `conversation`, `prompt`, hosted tools (web search, file search, ...) and image, file or audio
inputs are refused (400 naming the field).

Response: ``output`` holds a ``message`` item (one ``output_text`` part) and/or ``function_call`` items; `status`
"completed", or "incomplete" with ``incomplete_details.reason = "max_output_tokens"``; `usage` in input / output
tokens. Streamed (``stream: true``): ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, for a message ``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``, for a call ``response.function_call_arguments.delta``
..., ``response.function_call_arguments.done``, then ``response.output_item.done``; at the end
``response.completed`` (or ``response.incomplete``); a failure mid-stream sends ``error`` and ``response.failed``.
Each event is ``event: <type>`` + ``data: <json>`` with a `sequence_number` counting from 0.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from typing import Any, Callable

from .protocol import ApiError, ChatCompletionBody, invalid, unsupported

__all__ = ["to_chat", "response_body", "ResponseEvents", "ResponseStore", "STORED"]

STORED = 1024  # responses kept for previous_response_id
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Responses fields with their own meaning here (translated by `to_chat`).
_OWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream",
        "stream_options", "text", "tools", "tool_choice", "parallel_tool_calls", "include", "previous_response_id",
        "store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "truncation",
        "reasoning", "max_tool_calls", "background", "conversation", "prompt", "prompt_cache_retention",
        "prompt_cache_options", "moderation", "context_management"}
# chat fields a Responses request may carry as they are (vLLM's sampling fields, seed, stop, ...)
_PASSED = set(ChatCompletionBody.model_fields) - {
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "n", "response_format", "tools", "tool_choice",
    "functions", "function_call", "audio", "modalities", "web_search_options", "prediction", "stream_options",
    "echo", "prompt_logprobs", "continue_final_message"} - _OWN
# chat fields that are metadata in both APIs
_METADATA = ("metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_retention",
             "prompt_cache_options", "moderation")


class ResponseStore:
    """The conversations of recent responses (for `previous_response_id`): response id -> the chat messages up
    to and including its output, at most `size` of them (the oldest dropped first). Thread-safe."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self._items: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[rid] = messages
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict] | None:
        with self._lock:
            return self._items.get(rid)


def _text_of(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or a list of content parts; got {type(content).__name__}")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"{where}[{i}]", f" ({kind}: this server serves a text model)")
        if kind not in allowed:
            raise invalid(f"{where}[{i}]", f"{where}[{i}].type must be one of {', '.join(allowed)}; got {kind!r}")
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise invalid(f"{where}[{i}].{key}", f"{where}[{i}].{key} must be a string")
        out.append(part[key])
    return "".join(out)


def _messages(items: Any, store: ResponseStore, previous: str | None) -> list[dict]:
    """The chat messages of `input` (after those of `previous_response_id`)."""
    msgs: list[dict] = []
    if previous is not None:
        earlier = store.get(previous)
        if earlier is None:
            raise ApiError(404, f"no stored response {previous!r}: this server keeps the last {store.size} responses "
                           "made with store not false, in memory", param="previous_response_id",
                           code="previous_response_not_found")
        msgs.extend(dict(m) for m in earlier)
    if isinstance(items, str):
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input", "input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", f"{where}.role must be user, system, developer or assistant; got "
                              f"{role!r}")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", parts + ("text",))
            msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid(f"{where}.{key}", f"{where}.{key} must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)  # the same turn's text and calls
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id", f"{where}.call_id must be a string")
            out = _text_of(item.get("output"), f"{where}.output", ("input_text",))
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            continue  # the served model has no reasoning items to read back
        else:
            raise unsupported(f"{where}.type", f" ({kind!r} items; this server takes message, function_call and "
                              "function_call_output items)")
    return msgs


def _format(text: Any) -> dict | None:
    """The chat's response_format of `text.format`, or None."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text", "text must be an object with format (and verbosity)")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format", "text.format must be an object such as {'type': 'json_object'}")
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise invalid(f"text.format.{sorted(extra)[0]}", f"text.format.{sorted(extra)[0]} is not a field of a "
                          "json_schema format (name, schema, strict, description)")
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": js}
    raise invalid("text.format.type", f"text.format.type must be text, json_object or json_schema; got {kind!r}")


def _tools(tools: Any, choice: Any) -> tuple[list | None, Any]:
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools", "tools must be a list")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise unsupported(f"tools[{i}].type", f" ({kind!r} tools; only function tools run here)")
            extra = set(t) - {"type", "name", "description", "parameters", "strict"}
            if extra:
                raise invalid(f"tools[{i}].{sorted(extra)[0]}", f"Unrecognized request argument supplied: "
                              f"tools[{i}].{sorted(extra)[0]}")
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                           "strict") if t.get(k) is not None}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported("tool_choice", " (only 'none', 'auto', 'required' or {'type': 'function', 'name': ...})")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return out, choice


def to_chat(obj: dict[str, Any], store: ResponseStore) -> tuple[dict[str, Any], list[dict]]:
    """(the chat request body, the conversation before the answer without instructions) of a Responses body.

    Raises:
        ApiError: 400 naming the field (unknown, malformed or refused), 404 for an unknown previous_response_id.
    """
    unknown = set(obj) - _OWN - _PASSED
    if unknown:
        f = sorted(unknown)[0]
        raise invalid(f, f"Unrecognized request argument supplied: {f}", "unknown_parameter")
    for f, why in (("background", "responses run in the foreground here"), ("conversation", "no conversations are "
                   "stored: pass previous_response_id or the whole input"), ("prompt", "no prompt templates are "
                                                                                "stored here")):
        if obj.get(f) not in (None, False):
            raise unsupported(f, f" ({why})")
    if "input" not in obj:
        raise invalid("input", "Missing required parameter: input", "missing_parameter")
    prev = obj.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise invalid("previous_response_id", "previous_response_id must be a string")
    history = _messages(obj["input"], store, prev)
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "instructions must be a string")
    chat: dict[str, Any] = {k: obj[k] for k in _PASSED | set(_METADATA) if k in obj}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if obj.get(src) is not None:
            chat[dst] = obj[src]
    if obj.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = obj["max_output_tokens"]
    include = obj.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include", "include must be a list of strings")
    if LOGPROBS_INCLUDE in include or obj.get("top_logprobs") is not None:
        chat["logprobs"] = LOGPROBS_INCLUDE in include
        if obj.get("top_logprobs") is not None:
            chat["top_logprobs"] = obj["top_logprobs"]
        if not chat["logprobs"]:
            raise invalid("top_logprobs", f"top_logprobs needs include: ['{LOGPROBS_INCLUDE}']")
    rf = _format(obj.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    tools, choice = _tools(obj.get("tools"), obj.get("tool_choice"))
    if tools:
        chat["tools"] = tools
    if choice is not None and (tools or choice == "none"):
        chat["tool_choice"] = choice
    elif choice not in (None, "auto"):
        raise invalid("tool_choice", "tool_choice needs tools")
    return chat, history


def _ids() -> str:
    return uuid.uuid4().hex


def _logprobs(chat_lp: Any) -> list[dict]:
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": e["top_logprobs"]} for e in (chat_lp or {}).get("content") or []]


def _envelope(rid: str, obj: dict[str, Any], model: str, created: float, status: str) -> dict[str, Any]:
    """The Response object's fields that echo the request (OpenAI's shape)."""
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in obj.get("tools") or []]
    fmt = (obj.get("text") or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": None, "incomplete_details": None, "instructions": obj.get("instructions"),
            "max_output_tokens": obj.get("max_output_tokens"), "max_tool_calls": obj.get("max_tool_calls"),
            "model": model, "output": [], "parallel_tool_calls": obj.get("parallel_tool_calls", True),
            "previous_response_id": obj.get("previous_response_id"), "reasoning": None,
            "service_tier": obj.get("service_tier"), "store": obj.get("store", True),
            "temperature": obj.get("temperature", 1.0), "text": {"format": fmt},
            "tool_choice": obj.get("tool_choice", "auto"), "tools": tools, "top_logprobs": obj.get("top_logprobs"),
            "top_p": obj.get("top_p", 1.0), "truncation": obj.get("truncation", "disabled"), "usage": None,
            "user": obj.get("user"), "metadata": obj.get("metadata") or {}}


def _usage(u: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _finish(body: dict[str, Any], finish: str | None) -> None:
    if finish == "length":
        body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        body["status"] = "completed"
        body["completed_at"] = time.time()


def response_body(chat: dict[str, Any], obj: dict[str, Any], rid: str) -> tuple[dict[str, Any], dict]:
    """(the Response of a collected chat response, the assistant message to store) for the request `obj`."""
    choice = chat["choices"][0]
    msg = choice["message"]
    body = _envelope(rid, obj, chat["model"], chat["created"], "completed")
    if msg.get("content"):
        body["output"].append({"type": "message", "id": f"msg_{_ids()}", "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": msg["content"], "annotations": [],
                                            "logprobs": _logprobs(choice.get("logprobs"))}]})
    for call in msg.get("tool_calls") or []:
        body["output"].append({"type": "function_call", "id": f"fc_{_ids()}", "call_id": call["id"],
                               "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                               "status": "completed"})
    _finish(body, choice["finish_reason"])
    body["usage"] = _usage(chat["usage"])
    stored = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        stored["tool_calls"] = msg["tool_calls"]
    return body, stored


class ResponseEvents:
    """The Responses API's stream events of one chat choice's chunks (see the module docstring).

    Args:
        obj: the Responses request body.
        rid: the response's id.
        model: the model id echoed.
        emit: ``await emit(bytes)`` sends one server-sent event.
    """

    def __init__(self, obj: dict[str, Any], rid: str, model: str, emit: Callable[[bytes], Any]) -> None:
        self.obj, self.emit = obj, emit
        self.body = _envelope(rid, obj, model, time.time(), "in_progress")
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the open output item
        self.text: list[str] = []
        self.lps: list[dict] = []
        self.stored: dict[str, Any] = {"role": "assistant", "content": ""}

    async def send(self, kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.emit(f"event: {kind}\n".encode() + b"data: " + json.dumps(
            data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")

    async def start(self) -> None:
        await self.send("response.created", response=dict(self.body))
        await self.send("response.in_progress", response=dict(self.body))

    @property
    def index(self) -> int:
        return len(self.body["output"])

    async def _open(self, item: dict[str, Any]) -> None:
        await self.close_item()
        self.item = item
        await self.send("response.output_item.added", output_index=self.index, item=dict(item))

    async def text_delta(self, delta: str, lps: list[dict]) -> None:
        if self.item is None or self.item["type"] != "message":
            await self._open({"type": "message", "id": f"msg_{_ids()}", "status": "in_progress", "role": "assistant",
                              "content": []})
            await self.send("response.content_part.added", item_id=self.item["id"], output_index=self.index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []})
        self.text.append(delta)
        self.lps.extend(lps)
        await self.send("response.output_text.delta", item_id=self.item["id"], output_index=self.index,
                        content_index=0, delta=delta, logprobs=lps)

    async def call_delta(self, d: dict[str, Any]) -> None:
        if d.get("id") is not None:  # a new call
            fn = d.get("function") or {}
            await self._open({"type": "function_call", "id": f"fc_{_ids()}", "call_id": d["id"],
                              "name": fn.get("name", ""), "arguments": "", "status": "in_progress"})
        args = (d.get("function") or {}).get("arguments") or ""
        if args and self.item is not None:
            self.item["arguments"] += args
            await self.send("response.function_call_arguments.delta", item_id=self.item["id"],
                            output_index=self.index, delta=args)

    async def close_item(self) -> None:
        item = self.item
        if item is None:
            return
        self.item = None
        idx = self.index
        item["status"] = "completed"
        if item["type"] == "message":
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.lps}
            await self.send("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                            text=text, logprobs=self.lps)
            await self.send("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                            part=part)
            item["content"] = [part]
            self.stored["content"] = text
            self.text, self.lps = [], []
        else:
            await self.send("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                            name=item["name"], arguments=item["arguments"])
            self.stored.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        await self.send("response.output_item.done", output_index=idx, item=dict(item))
        self.body["output"].append(item)

    async def chunk(self, chunk: dict[str, Any]) -> str | None:
        """Send the events of one chat chunk; returns its finish_reason."""
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        lps = _logprobs(choice.get("logprobs"))
        if delta.get("content") or lps:  # a token that ends inside a character has logprobs and no text yet
            await self.text_delta(delta.get("content") or "", lps)
        for d in delta.get("tool_calls") or []:
            await self.call_delta(d)
        return choice.get("finish_reason")

    async def end(self, finish: str | None, usage: dict[str, int]) -> None:
        await self.close_item()
        _finish(self.body, finish)
        self.body["usage"] = _usage(usage)
        kind = "response.incomplete" if self.body["status"] == "incomplete" else "response.completed"
        await self.send(kind, response=self.body)

    async def fail(self, err: ApiError) -> None:
        await self.send("error", code=err.code, message=err.message, param=err.param)
        self.body["status"] = "failed"
        self.body["error"] = {"code": err.code or "server_error", "message": err.message}
        await self.send("response.failed", response=self.body)
