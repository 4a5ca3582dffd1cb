"""Tool calling for chat completions: `tools` into the prompt, the model's answer back into OpenAI `tool_calls`.

Prompt. `render` applies the tokenizer's chat template with ``tools=`` (transformers' `apply_chat_template`). When
the template ignores tools (it renders the same text with and without them: SmolLM2-Instruct's does), the server
renders a fallback instead: a system message (the conversation's own system message, or a new first one) that
lists the functions as JSON and asks for a call as one JSON object ``{"name": ..., "arguments": {...}}``; earlier
assistant tool calls are shown in that same JSON form and tool results as ``tool`` messages.

Answer. `parse_calls` reads tool calls from the generated text: the whole text as one call object (or a list of
them), or ``<tool_call>{...}</tool_call>`` blocks (the Hermes / Qwen form that tool-aware templates ask for). A
call counts only when its name is one of the request's functions and its arguments are a JSON object; anything
else is the message's content. With ``tool_choice`` "required" or a named function, the request carries a JSON
schema (`call_schema`) so the output is always one valid call: ``{"name": <a function's name>, "arguments": <its
parameters' schema>}``, where objects take only the properties they list (`cbnb.engine.structured.closed`: a model never
invents an argument) (at most one call per choice; `parallel_tool_calls` is accepted and changes nothing). With
"auto" the model chooses freely and the text is parsed; with "none" tools are rendered but never parsed.

Streaming, as OpenAI's deltas: a chunk with the call's index, id, type and name (empty arguments), then chunks of
its arguments, then ``finish_reason: "tool_calls"``. A forced call (`CallStream`; the grammar's output is exactly
``{"name":"<name>","arguments":<arguments>}``) streams its arguments as they are generated. With "auto"
(`ToolStream`), content is streamed as it comes while it cannot be a call (its first non-blank character is none of
``{``, ``[``, ``<``); a possible call is held back until the choice ends, then parsed and sent.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.structured import closed

__all__ = ["ToolSpec", "FunctionSpec", "render", "call_schema", "parse_calls", "tool_calls_body", "ToolStream",
           "CallStream", "FALLBACK_INSTRUCTIONS"]

FALLBACK_INSTRUCTIONS = ("You can call these functions:\n{tools}\nTo call one, answer with only a JSON object "
                         '{{"name": <the function\'s name>, "arguments": <an object of its arguments>}}.')
_CALL_IDS = itertools.count(1)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FORCED_HEAD = re.compile(r'^\{"name":"([A-Za-z0-9_.-]+)","arguments":')


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """One entry of `tools`: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str = Field(..., pattern="^function$")
    function: FunctionSpec


def _function_json(t: dict) -> dict:
    f = t["function"]
    out = {"name": f["name"]}
    if f.get("description"):
        out["description"] = f["description"]
    out["parameters"] = f.get("parameters") or {"type": "object", "properties": {}}
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return json.dumps({"name": fn.get("name"), "arguments": args})


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool calls with `arguments` as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _fallback_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    listing = json.dumps([_function_json(t) for t in tools], indent=1)
    note = FALLBACK_INSTRUCTIONS.format(tools=listing)
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            text = "\n".join(_call_text(c) for c in m["tool_calls"])
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + note).strip()}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


def template_ignores_tools(tokenizer: Any, messages: list[dict], tools: list[dict]) -> bool:
    """Whether the chat template renders `messages` the same with and without `tools`."""
    plain = tokenizer.apply_chat_template(_template_messages(messages), add_generation_prompt=True, tokenize=False)
    with_tools = tokenizer.apply_chat_template(_template_messages(messages), tools=tools,
                                               add_generation_prompt=True, tokenize=False)
    return plain == with_tools


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None, options: Any = None) -> list[int]:
    """Token ids of a chat with `tools` (see the module docstring), rendered with `options` (a
    `cbnb.server.extras.TemplateOptions`: vLLM's template fields; None: the defaults). Raises what the template
    raises."""
    kw: dict[str, Any] = {"add_generation_prompt": True}
    if options is not None:
        kw = {"add_generation_prompt": options.add_generation_prompt, **options.kwargs}
        if options.continue_final_message:
            kw["continue_final_message"] = True
        if options.chat_template is not None:
            kw["chat_template"] = options.chat_template
    if not tools:
        msgs = _template_messages(messages)
    elif template_ignores_tools(tokenizer, messages, tools):
        msgs = _fallback_messages(messages, tools)
    else:
        msgs = _template_messages(messages)
        kw["tools"] = tools
    if options is not None and options.add_special_tokens:  # vLLM's chat add_special_tokens: BOS added too
        text = tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    out = tokenizer.apply_chat_template(msgs, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call: of function `name`, or of any of `tools`."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = closed(f.get("parameters") or {"type": "object", "properties": {}})
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _as_call(obj: Any, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


def parse_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, calls) of a generated text: calls as ``{"name", "arguments"}`` dicts; content is None when the
    text is only calls."""
    names = {t["function"]["name"] for t in tools}
    s = text.strip()
    blocks = _TAGGED.findall(s)
    if blocks:
        calls = []
        for b in blocks:
            try:
                c = _as_call(json.loads(b), names)
            except ValueError:
                c = None
            if c is None:
                return text, []
            calls.append(c)
        rest = _TAGGED.sub("", s).strip()
        return (rest or None), calls
    try:
        obj = json.loads(s)
    except ValueError:
        return text, []
    items = obj if isinstance(obj, list) and obj else [obj]
    calls = [_as_call(o, names) for o in items]
    if any(c is None for c in calls):
        return text, []
    return None, calls


def cut_forced_call(text: str) -> dict | None:
    """A forced call cut short (``max_tokens``): its name and the arguments' text so far, as OpenAI returns a call
    cut by the length limit (``{"id", "type", "function": {"name", "arguments"}}``, arguments unfinished JSON);
    None when the cut came before the name was complete (then the choice has neither content nor call)."""
    m = _FORCED_HEAD.match(text.strip())
    if m is None:
        return None
    args = text.strip()[m.end():]
    return {"id": new_call_id(), "type": "function", "function": {"name": m.group(1), "arguments": args}}


def tool_calls_body(calls: list[dict], ids: list[str]) -> list[dict]:
    """OpenAI's ``message.tool_calls``: arguments as a JSON string."""
    return [{"id": i, "type": "function", "function": {"name": c["name"], "arguments": json.dumps(
        c["arguments"], separators=(",", ":"), ensure_ascii=False)}} for c, i in zip(calls, ids)]


def new_call_id() -> str:
    return f"call_{next(_CALL_IDS):08d}"


class ToolStream:
    """Splits a choice's streamed text into content to send now and a possible call held back (module
    docstring)."""

    def __init__(self, tools: list[dict]) -> None:
        self.tools = tools
        self.held = ""
        self.passing = False  # the text is plain content: pass it through

    def push(self, text: str) -> str:
        """The part of `text` to stream as content now."""
        if self.passing:
            return text
        self.held += text
        head = self.held.lstrip()
        if head and head[0] not in "{<[":
            self.passing, out, self.held = True, self.held, ""
            return out
        return ""

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content still to send, calls) at the end of the choice."""
        if self.passing or not self.held:
            return None, []
        content, calls = parse_calls(self.held, self.tools)
        return content, calls


class CallStream:
    """A forced call's streamed text -> OpenAI tool-call deltas (``{"index", "id", "type", "function"}`` dicts):
    the head once the name is complete, then the arguments as they come (the outer object's closing brace held
    back). `text` is what never became a call (an answer cut before its name)."""

    def __init__(self) -> None:
        self.buf = ""
        self.started = False
        self.tail = ""  # the last character seen, held back (it may be the outer closing brace)

    def push(self, text: str) -> list[dict]:
        if not self.started:
            self.buf += text
            m = _FORCED_HEAD.match(self.buf)
            if m is None:
                return []
            self.started = True
            rest = self.buf[m.end():]
            out = [{"index": 0, "id": new_call_id(), "type": "function",
                    "function": {"name": m.group(1), "arguments": ""}}]
            return out + self._args(rest)
        return self._args(text)

    def _args(self, text: str) -> list[dict]:
        if not text:
            return []
        piece, self.tail = self.tail + text[:-1], text[-1]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def finish(self, complete: bool) -> list[dict]:
        """The last arguments; `complete`: the answer ended on its own (its last character closes the call)."""
        if not self.started:
            return []
        last = "" if complete and self.tail == "}" else self.tail
        self.tail = ""
        return [{"index": 0, "function": {"arguments": last}}] if last else []

    @property
    def text(self) -> str:
        return "" if self.started else self.buf
