"""One HTTP generation request's run: one engine request per choice; each choice's deltas -> text pieces (stop
strings applied) with their logprobs -> an OpenAI response body, or a stream of chunks (one per text delta of any
choice, tagged with the choice's `index`; a finish_reason chunk per choice; usage when asked; [DONE]).

Logprob shapes (OpenAI's), built by `TokenText` from the engine's `TokenLogprob`s (natural log, after the request's
logits processors):

- chat: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...], "refusal": None}``; `top_logprobs` has the request's `top_logprobs` alternatives (fewer when
  the processors ruled tokens out), most likely first.
- completions: ``choices[i].logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob},
  ...], "text_offset": [...]}``; each dict holds the `logprobs` most likely tokens and the sampled one (so up to
  logprobs + 1 entries, as OpenAI's API); `text_offset` is the character offset of each token in the choice's text
  (counted over the tokens' bytes decoded as UTF-8, an unfinished character counting as one: a token that finishes
  a character another token began points just past it). With `echo`, the prompt's tokens come first (the first
  with null logprob and null top_logprobs: nothing predicts it), from the engine's `prompt_logprobs` (the model's
  raw distribution).

A token's string is ``tokenizer.decode([id])`` (special tokens included), except for a token that holds only part
of a UTF-8 character: its string names its bytes, ``"bytes:\\xe2\\x80"`` (OpenAI's form; U+FFFD would make such tokens
indistinguishable). `bytes` are the token's raw bytes (exact for byte-level BPE tokenizers, else the UTF-8 of its
decoded string). Without a tokenizer the string is ``"token_id:<id>"``.

Tool calls (chat with `tools`, `tool_choice` not "none"): the choice's text is parsed by `cbnb.server.tools`; a
call becomes ``message.tool_calls`` (content null) with finish_reason "tool_calls"; streamed, as `ToolStream` says.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import time
from typing import Any, AsyncIterator, Callable

from .counters import ServerCounters
from .protocol import ApiError, GenerationRequest
from .sse import DONE, sse
from ..engine.detok import IncrementalDetokenizer
from ..engine.stops import TextStopFilter
from .tools import CallStream, ToolStream, cut_forced_call, new_call_id, parse_calls, tool_calls_body

__all__ = ["Generation", "Choice", "PrimedHandle", "Slot", "TokenText"]

_FINISH = {"eos": "stop", "length": "length", "stop": "stop"}


class Slot:
    """One of `max_concurrent_requests` places, counted in `ServerCounters`; released exactly once."""

    def __init__(self, counters: ServerCounters, client: str) -> None:
        self.counters, self.client, self.tokens, self._held = counters, client, 0, True
        counters.on_start(client)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.counters.on_end(self.client, self.tokens)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's scheme: printable Latin-1
    bytes stand for themselves, the other bytes for 256, 257, ... in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """A token id's string and bytes for logprob entries (cached per id).

    Args:
        tokenizer: a transformers tokenizer, or None (strings are then ``"token_id:<id>"``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def is_special(self, tid: int) -> bool:
        """Whether the token is one of the tokenizer's special tokens (left out of the text)."""
        return tid in self._special

    def _decoded(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _text(self, tid: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{tid}"
        text = self._decoded(tid)
        if "\ufffd" in text:  # part of a UTF-8 character: name its bytes (OpenAI's form), not U+FFFD
            raw = bytes(self._bytes(tid))
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def _bytes(self, tid: int) -> list[int]:
        if self.tokenizer is None:
            return list(f"token_id:{tid}".encode())
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            table = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self._decoded(tid).encode("utf-8"))

    def chat_entry(self, lp: Any) -> dict[str, Any]:
        """OpenAI's chat `logprobs.content` entry of one `TokenLogprob`."""
        return {"token": self.text(lp.token_id), "logprob": lp.logprob, "bytes": self.bytes(lp.token_id),
                "top_logprobs": [{"token": self.text(t), "logprob": v, "bytes": self.bytes(t)} for t, v in lp.top]}

    def completion_top(self, lp: Any) -> dict[str, float]:
        """OpenAI's completions `top_logprobs` dict of one `TokenLogprob`: the alternatives and the sampled token."""
        top = {self.text(t): v for t, v in lp.top}
        top.setdefault(self.text(lp.token_id), lp.logprob)
        return top


class TokenIds(TokenText):
    """vLLM's `return_tokens_as_token_ids`: every logprob token is ``"token_id:<id>"`` (its bytes that string's)."""

    def _text(self, tid: int) -> str:
        return f"token_id:{tid}"

    def _bytes(self, tid: int) -> list[int]:
        return list(f"token_id:{tid}".encode())


class KeptStopFilter(TextStopFilter):
    """`TextStopFilter` that keeps the stop string it found in the text (vLLM's ``include_stop_str_in_output``)."""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        seen = self.buf + text
        out = super().push(text)
        if self.stopped:  # the stop string that won starts where `out` ends; of those, the shortest ends first
            out += min((s for s in self.stops if seen.startswith(s, len(out))), key=len)
        return out


class PrimedHandle:
    """A `RequestHandle` whose first delta was already awaited (`prime`), so that its prompt's KV blocks are computed
    and in the prefix cache before sibling choices are submitted; iterating it yields that delta first. Everything
    else is the handle's."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._it = handle.__aiter__()
        self._first: Any = None

    async def prime(self) -> None:
        try:
            self._first = await self._it.__anext__()
        except StopAsyncIteration:
            self._first = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    async def __aiter__(self):
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
                if first.finished:
                    return
            async for d in self._it:
                yield d
        finally:
            await self._it.aclose()


class Choice:
    """One choice: consumes one engine request's deltas.

    Args:
        index: the choice's `index` in the response (prompt_i * n + j).
        handle: the engine's `RequestHandle`.
        g: the parsed request.
        closing: returns True while the server is stopping (explains a cancellation).
        on_tokens: called with the number of new tokens of each delta (for the slot's token count).
        is_special: whether a token id is a special token (an end token that is one gets no logprob entry).
    """

    def __init__(self, index: int, handle: Any, g: GenerationRequest, closing: Callable[[], bool],
                 on_tokens: Callable[[int], None], is_special: Callable[[int], bool] = lambda tid: False,
                 tokenizer: Any = None) -> None:
        self.index, self.handle, self.g, self.closing, self.on_tokens = index, handle, g, closing, on_tokens
        self.is_special = is_special
        self.matcher = (KeptStopFilter if g.include_stop_str else TextStopFilter)(g.stop) if g.stop else None
        # the server's own text (special tokens kept, or stop strings kept): see `pieces`
        self.detok = (IncrementalDetokenizer(tokenizer, skip_special_tokens=g.skip_special_tokens)
                      if g.own_detokenizer and tokenizer is not None else None)
        self.prompt_tokens = len(handle.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.text: list[str] = []
        self.logprobs: list[Any] = []  # TokenLogprob, in order
        self.offset = 0  # completions' text_offset of the next token: characters of the text so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # bytes so far -> whole characters
        self.discard = g.max_tokens == 0  # echo with max_tokens=0: the engine's one token is not part of the answer
        self.tools = g.tools if g.tools and g.tool_choice != "none" else None
        self.forced = self.tools is not None and g.tool_choice != "auto"  # "required" or a named function
        self.prompt_logprobs: list[Any] | None = None  # the engine's, for echo (None first)
        self._ended_on_eos = False
        self._outcome_read = False

    async def pieces(self) -> AsyncIterator[tuple[str, list[Any]]]:
        """(text, logprobs) to send, in order; sets finish_reason or error at the end."""
        it = self.handle.__aiter__()
        try:
            async for d in it:
                if self.discard:
                    if d.finished:
                        self._outcome()
                        if self.error is None:
                            self.finish_reason = "length"
                    continue
                self.completion_tokens += len(d.token_ids)
                self.on_tokens(len(d.token_ids))
                lps = list(d.logprobs or ()) if self.g.logprobs is not None else []
                if d.finished:
                    self._outcome()
                text = d.text if self.detok is None else self._own_text(d)
                if self.matcher is not None:
                    text = self.matcher.push(text)
                    if self.matcher.stopped:
                        self.finish_reason = "stop"
                        self.handle.cancel()  # the server found the stop string: end the engine request
                        yield text, lps
                        return
                    if d.finished:
                        text += self.matcher.flush()
                if d.finished:
                    if self._ended_on_eos and lps and self.g.kind == "chat" and self.is_special(lps[-1].token_id):
                        # chat: a special end token is not in the content, and OpenAI lists no logprob for it;
                        # completions keep it last (as vLLM does: lm-eval drops the generated token's entry)
                        lps = lps[:-1]
                if text or lps:
                    yield text, lps
        finally:
            await it.aclose()

    def _own_text(self, d: Any) -> str:
        """The delta's text from the server's own detokenizer. As vLLM: the token that ended the request (EOS or
        one of `stop_token_ids`) is left out of the text unless include_stop_str_in_output."""
        ids = list(d.token_ids)
        if d.finished and self._ended_on_eos and ids and not self.g.include_stop_str:
            ids = ids[:-1]
        text = self.detok.push(ids)
        return text + self.detok.finish() if d.finished else text

    def _outcome(self) -> None:
        if self._outcome_read:
            return
        self._outcome_read = True
        out = self.handle.result(timeout=0)
        self.prompt_logprobs = getattr(out, "prompt_logprobs", None)
        self._ended_on_eos = out.finish_reason == "eos"
        # An engine-side stop string drops the tokens that hold it from the output; they were generated all the same.
        more = getattr(out, "generated_tokens", 0) - self.completion_tokens
        if more > 0 and not self.discard:
            self.completion_tokens += more
            self.on_tokens(more)
        if out.state.name == "FINISHED":
            self.finish_reason = _FINISH.get(out.finish_reason or "", "stop")
        elif out.state.name == "CANCELLED":
            why = out.error or ("the server is stopping" if self.closing() else "the request was cancelled")
            self.error = ApiError(503, f"request cancelled: {why}", type="server_error", code="request_cancelled")
        else:
            self.error = ApiError(500, f"request failed: {out.error}", type="server_error", code="request_failed")

    async def collect(self) -> None:
        async for text, lps in self.pieces():
            self.text.append(text)
            self.logprobs.extend(lps)

    def _offsets(self, ids: list[int], tt: TokenText) -> list[int]:
        """Each token's character offset in the text: the characters its predecessors' bytes decode to, an
        unfinished character counting as one (so a token that finishes a character points just past it)."""
        out = []
        for i in ids:
            pending = bool(self._utf8.getstate()[0])
            out.append(self.offset + pending)
            self.offset += len(self._utf8.decode(bytes(tt.bytes(i))))
        return out

    def echo_logprobs(self, tt: TokenText) -> dict[str, list]:
        """Completions' logprob lists of the prompt's tokens (echo): the first token has none (null)."""
        ids = self.handle.prompt_token_ids
        lps = self.prompt_logprobs or [None] * len(ids)
        tokens = [tt.text(i) for i in ids]
        offsets = self._offsets(ids, tt)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else tt.completion_top(lp) for lp in lps],
                "text_offset": offsets}

    def logprobs_body(self, lps: list[Any], tt: TokenText) -> dict[str, Any] | None:
        """The OpenAI `logprobs` object of these tokens (None when the request did not ask for logprobs)."""
        if self.g.logprobs is None:
            return None
        if self.g.kind == "chat":
            return {"content": [tt.chat_entry(lp) for lp in lps], "refusal": None}
        tokens = [tt.text(lp.token_id) for lp in lps]
        offsets = self._offsets([lp.token_id for lp in lps], tt)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [tt.completion_top(lp) for lp in lps], "text_offset": offsets}


class Generation:
    """The choices of one HTTP request, for a streamed or a collected response.

    Args:
        handles: the engine's `RequestHandle`s, in choice-index order (prompt_i * n + j).
        g: the parsed request.
        slot: its concurrency `Slot` (released by `close`).
        model_name: the model id echoed in responses.
        live: the server's map of live handles (these requests are removed from it by `close`).
        closing: returns True while the server is stopping (explains a cancellation).
        tokens: a `TokenText` for logprob entries.
    """

    def __init__(self, handles: list[Any], g: GenerationRequest, slot: Slot, model_name: str,
                 live: dict[str, Any], closing: Callable[[], bool], tokens: TokenText) -> None:
        self.handles, self.g, self.slot, self.model_name, self.live, self.tokens = (
            handles, g, slot, model_name, live, tokens)
        if g.token_ids_as_text:
            self.tokens = tokens = TokenIds(tokens.tokenizer)
        self.choices = [Choice(i, h, g, closing, self._count, tokens.is_special, tokens.tokenizer)
                        for i, h in enumerate(handles)]
        self.id = ("cmpl-" if g.kind == "completion" else "chatcmpl-") + (g.request_id or handles[0].request_id)
        self.created = int(time.time())
        # usage: each prompt once (its n choices share it), every choice's generated tokens
        self.prompt_tokens = sum(c.prompt_tokens for c in self.choices[::g.n])
        self.error: ApiError | None = None

    def _count(self, k: int) -> None:
        self.slot.tokens += k

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    async def collect(self) -> None:
        await asyncio.gather(*(c.collect() for c in self.choices))
        self.error = next((c.error for c in self.choices if c.error is not None), None)

    def close(self) -> None:
        """Cancel the engine requests still running (client gone, error) and free the slot."""
        for h in self.handles:
            if not h.done():
                h.cancel()
            self.live.pop(h.request_id, None)
        self.slot.release()

    # -------------------------------------------------------------------------------- response bodies
    def usage(self) -> dict[str, int]:
        done = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name,
                "system_fingerprint": None}

    def response(self) -> dict[str, Any]:
        out = []
        for c in self.choices:
            head = c.echo_logprobs(self.tokens) if self.g.echo and self.g.logprobs is not None else None
            text, lp = "".join(c.text), c.logprobs_body(c.logprobs, self.tokens)
            calls: list[dict] = []
            if c.tools is not None and c.finish_reason is not None:
                content, calls = parse_calls(text, c.tools)
            if self.g.echo:
                text = self._prompt_text(c) + text
            if head is not None:
                lp = {k: head[k] + lp[k] for k in head}
            if self.g.kind == "completion":
                out.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
                if self.g.prompt_logprobs is not None:
                    out[-1]["prompt_logprobs"] = self._prompt_logprobs(c)
            else:
                msg: dict[str, Any] = {"role": "assistant", "content": self._echoed() + text}
                finish = c.finish_reason
                if calls:
                    msg = {"role": "assistant", "content": content,
                           "tool_calls": tool_calls_body(calls, [new_call_id() for _ in calls])}
                    finish = "tool_calls"
                elif c.forced and c.finish_reason is not None:  # a forced call cut short: never its text as content
                    cut = cut_forced_call(text)
                    msg = {"role": "assistant", "content": None, **({"tool_calls": [cut]} if cut else {})}
                out.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": finish})
        obj = "text_completion" if self.g.kind == "completion" else "chat.completion"
        body = {**self._head(obj), "choices": out, "usage": self.usage()}
        if self.g.kind == "chat" and self.g.prompt_logprobs is not None:  # vLLM: the chat's, once
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        return body

    def _echoed(self) -> str:
        """Chat echo (vLLM): the last message's content when it is the assistant's (the answer continues it)."""
        if not self.g.chat_echo:
            return ""
        last = self.g.prompts[0][-1]
        return (last.get("content") or "") if last.get("role") == "assistant" else ""

    def _prompt_logprobs(self, c: Choice) -> list[Any]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or ``{token id: {"logprob", "rank",
        "decoded_token"}}`` holding the token itself and the `prompt_logprobs` most likely tokens (rank: 1 for the
        most likely; null for the prompt's token when it is not among them, as the engine keeps only the top k)."""
        k = self.g.prompt_logprobs or 0
        out: list[Any] = []
        for lp in c.prompt_logprobs or [None] * len(c.handle.prompt_token_ids):
            if lp is None:
                out.append(None)
                continue
            top = list(lp.top)[:k]
            entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tokens.text(t)}
                     for r, (t, v) in enumerate(top)}
            if str(lp.token_id) not in entry:
                rank = next((r + 1 for r, (t, _) in enumerate(lp.top) if t == lp.token_id), None)
                entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": rank,
                                           "decoded_token": self.tokens.text(lp.token_id)}
            out.append(entry)
        return out

    def _prompt_text(self, c: Choice) -> str:
        prompt = self.g.prompts[c.index // self.g.n]
        if isinstance(prompt, str):
            return prompt
        tok = self.tokens.tokenizer
        return tok.decode(list(prompt)) if tok is not None else ""

    def _chunk(self, c: Choice, text: str | None, finish: str | None, lps: list[Any] | None = None,
               first: bool = False) -> dict[str, Any]:
        lp = c.logprobs_body(lps, self.tokens) if lps else None
        if self.g.kind == "completion":
            choice: dict[str, Any] = {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": finish}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        else:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.g.include_usage:
            chunk["usage"] = self.usage() if self.g.continuous_usage else None
        return chunk

    async def stream(self, emit: Callable[[bytes], Any]) -> None:
        """Send each choice's chunks as its deltas come (a role chunk first for chat, one chunk per text delta, a
        finish_reason chunk), the usage chunk if asked, [DONE]. The first failed choice ends the stream with its
        error (the other choices are cancelled by `close`)."""
        if self.g.kind == "chat":
            for c in self.choices:
                await emit(sse(self._chunk(c, "", None, first=True)))
        if len(self.choices) == 1:
            await self._stream_one(self.choices[0], emit)
        else:
            await self._stream_many(emit)
        if self.error is not None:
            await emit(sse(self.error.body()))
        elif self.g.include_usage:
            obj = "text_completion" if self.g.kind == "completion" else "chat.completion.chunk"
            await emit(sse({**self._head(obj), "choices": [], "usage": self.usage()}))
        await emit(DONE)

    def _final(self, c: Choice, finish: str | None = None) -> dict[str, Any]:
        return self._chunk(c, None if self.g.kind == "chat" else "", finish or c.finish_reason)

    def _call_chunk(self, c: Choice, delta: dict, lps: list[Any] | None = None) -> dict[str, Any]:
        chunk = self._chunk(c, None, None, lps)
        chunk["choices"][0]["delta"]["tool_calls"] = [delta]
        return chunk

    async def _forced_pieces(self, c: Choice) -> AsyncIterator[dict[str, Any]]:
        """A forced call's chunks (`CallStream`): its arguments stream as they are generated."""
        cs = CallStream()
        async for text, lps in c.pieces():
            deltas = cs.push(text)
            for k, d in enumerate(deltas):
                yield self._call_chunk(c, d, lps if k == len(deltas) - 1 else None)
            if lps and not deltas:
                yield self._chunk(c, None, None, lps)
        if c.error is not None:
            return
        for d in cs.finish(c.finish_reason == "stop"):
            yield self._call_chunk(c, d)
        # A call cut before its name was complete sends nothing: its text is the call's wrapper, not content.
        yield self._final(c, "tool_calls" if cs.started and c.finish_reason == "stop" else None)

    def chunks(self, c: Choice) -> AsyncIterator[dict[str, Any]]:
        """Choice `c`'s chat chunks (no role chunk, no usage, no [DONE]), its final one included; after them
        `c.error` says whether it failed (the Responses API's stream is written from these)."""
        return self._pieces(c)

    async def _pieces(self, c: Choice) -> AsyncIterator[dict[str, Any]]:
        """A choice's chunks, its final one included (tool calls parsed; see `cbnb.server.tools`)."""
        if c.forced:
            async for chunk in self._forced_pieces(c):
                yield chunk
            return
        ts = ToolStream(c.tools) if c.tools is not None else None
        if self.g.echo:  # streamed echo (without logprobs): the prompt's text is the choice's first chunk
            yield self._chunk(c, self._prompt_text(c), None)
        elif self._echoed():  # chat echo: the assistant message being continued comes first
            yield self._chunk(c, self._echoed(), None)
        async for text, lps in c.pieces():
            if ts is not None:
                text = ts.push(text)
                if not text and not lps:
                    continue
            yield self._chunk(c, text, None, lps)
        if c.error is not None:
            return
        finish = None
        if ts is not None:
            content, calls = ts.finish()
            if calls:
                if content:
                    yield self._chunk(c, content, None)
                for k, body in enumerate(tool_calls_body(calls, [new_call_id() for _ in calls])):
                    fn = body["function"]
                    yield self._call_chunk(c, {"index": k, "id": body["id"], "type": "function",
                                               "function": {"name": fn["name"], "arguments": ""}})
                    yield self._call_chunk(c, {"index": k, "function": {"arguments": fn["arguments"]}})
                finish = "tool_calls"
            elif content or ts.held:
                yield self._chunk(c, content if content is not None else ts.held, None)
        yield self._final(c, finish)

    async def _stream_one(self, c: Choice, emit: Callable[[bytes], Any]) -> None:
        async for chunk in self._pieces(c):  # no final chunk after an error
            await emit(sse(chunk))
        self.error = c.error

    async def _stream_many(self, emit: Callable[[bytes], Any]) -> None:
        events: asyncio.Queue = asyncio.Queue()

        failures: list[BaseException] = []

        async def pump(c: Choice) -> None:
            try:
                async for chunk in self._pieces(c):
                    await events.put((c, chunk))
            except Exception as e:  # raised in the stream's own task below
                failures.append(e)
            finally:
                await events.put((c, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            left = len(tasks)
            while left:
                c, chunk = await events.get()
                if chunk is not None:
                    await emit(sse(chunk))
                    continue
                left -= 1
                if failures:
                    raise failures[0]
                if c.error is not None:
                    self.error = c.error
                    return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
