"""A request's story from the event log: why it waited, and everything else that happened to it (torch-free).

`explain_request(events, request_id)` (behind `Engine.explain`) reads the typed records of `cbnb.telemetry.events` and
returns a `RequestStory`: its arrival, each step it was left out with the scheduler's reason and the numbers that
decided it (`SkippedRequests.detail`), its prompt chunks, prefix hits, offloads and restores, config changes while it
lived, and its end. For every reason the story names the config field(s) that would change it (`REASONS`).

Consecutive steps of the same kind are merged into one entry (e.g. "steps 5-12 waiting: token budget"); each entry
keeps the per-step numbers in `entry.steps`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

__all__ = ["REASONS", "ReasonInfo", "StoryEntry", "RequestStory", "StoryBuilder", "explain_request",
           "explain_engine_request", "reason_numbers", "request_id_of"]


@dataclass(frozen=True)
class ReasonInfo:
    """What a `cbnb.core.plan.SkipReason` means, and the config fields that would change it."""

    label: str
    meaning: str
    fields: tuple[str, ...]
    advice: str


#: One entry per `cbnb.core.plan.SkipReason` value (the UI shows `label` and `meaning`).
REASONS: dict[str, ReasonInfo] = {
    "token_budget": ReasonInfo(
        "token budget", "the step's max_batch_tokens query tokens were already taken by requests ahead",
        ("max_batch_tokens",), "a larger max_batch_tokens takes more tokens per step"),
    "cache_budget": ReasonInfo(
        "cache budget", "the step may read at most the cache's capacity of past tokens; requests ahead used it",
        ("num_blocks", "page_size"), "more num_blocks (or larger pages) raise the cache's capacity"),
    "request_cap": ReasonInfo(
        "request cap", "the step already holds max_requests_per_batch requests",
        ("max_requests_per_batch",), "a larger max_requests_per_batch lets more requests into one step"),
    "safety_margin": ReasonInfo(
        "safety margin", "the free share of the cache is below safety_margin, so no new prompt is admitted",
        ("safety_margin", "num_blocks"), "a smaller safety_margin (or more num_blocks) admits sooner"),
    "no_free_blocks": ReasonInfo(
        "no free blocks", "the KV cache has too few free blocks for its next chunk",
        ("num_blocks", "page_size", "cpu_offload_space"),
        "more num_blocks, a page_size that wastes less, or cpu_offload_space to swap others out"),
    "stalled_ahead": ReasonInfo(
        "stalled ahead", "an active request ahead is waiting for blocks; newcomers wait behind it",
        ("num_blocks", "cpu_offload_space"), "more num_blocks, or cpu_offload_space to swap instead of stalling"),
    "offload_backoff": ReasonInfo(
        "offload back-off", "a request was just offloaded; new ones wait until an active request ends",
        ("num_blocks", "cpu_offload_space"), "more num_blocks make offloads rarer"),
    "finishing": ReasonInfo(
        "finishing", "its last token is in flight (async batching); it ends when that step is applied",
        ("use_async_batching",), "nothing to change: it ends with the step in flight"),
}


def reason_numbers(reason: str, detail: dict[str, Any]) -> str:
    """The deciding numbers of one skip, in words, e.g. "budget 64 tokens, 0 left"."""
    d = detail or {}
    if reason == "token_budget":
        return f"budget {d.get('budget_tokens', '?')} tokens, {d.get('left_tokens', '?')} left"
    if reason == "cache_budget":
        return (f"needs to read {d.get('need_tokens', '?')} past tokens, {d.get('left_tokens', '?')} left of "
                f"{d.get('budget_tokens', '?')}")
    if reason == "request_cap":
        return f"cap {d.get('cap', '?')} requests per step"
    if reason == "safety_margin":
        free, margin = d.get("free_fraction"), d.get("safety_margin")
        if isinstance(free, (int, float)) and isinstance(margin, (int, float)):
            return f"free {100 * free:.1f} % of the cache < safety_margin {100 * margin:.0f} %"
        return "free share below the safety margin"
    if reason == "no_free_blocks":
        need, have = d.get("needed_blocks", ()), d.get("available_blocks", ())
        if len(need) == 1 and len(have) == 1:
            return f"needs {need[0]} more blocks, {have[0]} obtainable"
        return f"needs {list(need)} blocks per layer group, {list(have)} obtainable"
    if reason == "offload_backoff" and d.get("preempted"):
        n = d["preempted"]
        return f"{n} running request{'s' if n != 1 else ''} preempted this step (vLLM's policy then admits none)"
    if reason == "stalled_ahead":
        n = d.get("stalled", 1)
        return f"{n} active request{'s' if n != 1 else ''} ahead stalled"
    return ""


@dataclass
class StoryEntry:
    """One line of a story.

    Attributes:
        kind: "arrival", "waiting", "prefix_hit", "prefill", "decode", "offload", "restore", "warning",
            "reconfigure", "end".
        step, last_step: the steps it covers (equal for a single event; 0 = before the first step).
        text: the line in words.
        reason: the skip reason ("waiting" entries), or the offload path ("offload": "swap" / "soft_reset").
        numbers: the deciding numbers of the first step (a skip's detail, a chunk's tokens, ...).
        steps: per step: (step, numbers) for merged entries.
        fields: config fields that would change what happened (waiting and offloads).
        advice: how those fields would change it.
    """

    kind: str
    step: int
    last_step: int
    text: str = ""
    reason: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    advice: str = ""

    @property
    def count(self) -> int:
        return max(1, len(self.steps))

    def span(self) -> str:
        if self.kind == "arrival":  # it arrived between two steps; it can first run in the next one
            return f"after step {self.step}" if self.step else "before step 1"
        if self.step == self.last_step:
            return f"step {self.step}" if self.step else "before step 1"
        return f"steps {self.step}-{self.last_step}"


#: The states of a request that has not ended.
LIVE_STATES = ("PENDING", "PREFILLING", "DECODING")


@dataclass
class RequestStory:
    """What happened to one request (see the module docstring).

    Attributes:
        request_id: the request.
        state: its state now ("PENDING", ..., "FINISHED"), or "unknown" when only part of its events is left.
        prompt_tokens, max_new_tokens, output_tokens: its sizes (output tokens so far).
        prompt_text: the prompt as typed (None for token ids).
        entries: the story, oldest first.
        waited_steps: steps it was left out, per reason.
        partial: True when its first events were dropped from the bounded log.
        headline: one sentence: where it stands and, when it waits, why and what would change it.
    """

    request_id: str
    state: str = "unknown"
    prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    output_tokens: int = 0
    prompt_text: str | None = None
    entries: list[StoryEntry] = field(default_factory=list)
    waited_steps: dict[str, int] = field(default_factory=dict)
    partial: bool = False
    headline: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready): the fields, with each entry as a dict (its `span` included)."""
        d = asdict(self)
        for e, raw in zip(d["entries"], self.entries):
            e["span"] = raw.span()
            e["steps"] = [[s, n] for s, n in raw.steps]
        return d

    def text(self) -> str:
        """The story as lines of text (what `print(story)` shows)."""
        lines = [self.headline]
        if self.partial:
            lines.append("(the log no longer holds this request's first events)")
        elif not self.entries and self.state in LIVE_STATES:
            lines.append("(nothing logged for it yet: its events come as the step now running ends)")
        width = max([len(e.span()) for e in self.entries] + [8])
        for e in self.entries:
            line = f"{e.span():<{width}}  {e.text}"
            if e.fields:
                line += f"  -> {', '.join(e.fields)}: {e.advice}"
            lines.append(line)
        return "\n".join(lines)

    __str__ = text


# ---------------------------------------------------------------------------------------------- building
def request_id_of(request: Any) -> str:
    """The id of `request`: a request id (str), or anything with a ``request_id`` (a `RequestHandle`, a
    `RequestOutput`).

    Raises:
        TypeError: neither.
    """
    rid = getattr(request, "request_id", request)
    if not isinstance(rid, str):
        raise TypeError(f"request must be a request id (str) or a handle/output with .request_id; got "
                        f"{type(request).__name__}")
    return rid


def explain_request(events: Any, request_id: str, *, config: Any = None, now: Any = None) -> RequestStory:
    """Build the story of `request_id`.

    Args:
        events: an `EventLog`, or an iterable of events (oldest first).
        request_id: the request.
        config: the engine's resolved config now, optional: the advice quotes the values in force at each step
            (the step's own budgets, and the configs recorded by reconfigure markers), and says when they differ
            from these.
        now: the request's live `RequestOutput` (its current state and tokens), optional.

    Raises:
        KeyError: no event of `request_id` is in `events`.
    """
    b = StoryBuilder(request_id, config)
    b.feed(events.events() if hasattr(events, "events") else events)
    if not b.seen and now is None:
        raise KeyError(f"no event of request {request_id!r} in the log (unknown id, telemetry off, or dropped from "
                       "the log's bound)")
    return b.story(now)


_STEP_KINDS = ("waiting", "prefill", "decode")
_POINT_KINDS = ("prefix_hit", "offload", "restore", "warning")


def _planned_after(prev: StoryEntry, entry: StoryEntry) -> bool:
    """True when the step entry `prev` belongs after the one-event `entry`."""
    if prev.kind not in _STEP_KINDS:
        return False
    return prev.step > entry.step or (entry.kind == "prefix_hit" and prev.kind == "prefill" and prev.step == entry.step)


def _config_values(config: Any) -> dict[str, Any]:
    """A config's fields by name (a dataclass, or a dict of values as a `RunStarted` marker records them)."""
    if isinstance(config, dict):
        return config
    import dataclasses

    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v for k, v in vars(config).items() if not k.startswith("_")} if hasattr(config, "__dict__") else {}


def explain_engine_request(engine: Any, request: Any) -> RequestStory:
    """`explain_request` on an engine (`Engine` or `SimEngine`): its event log and resolved config, with the request's
    live output when it is still listed. `request`: an id, or a handle/output (`request_id_of`).

    Raises:
        KeyError: no event of the request is in the log; TypeError: `request` is neither an id nor a handle.
    """
    rid = request_id_of(request)
    live = next((o for o in engine.requests_snapshot() if o.request_id == rid), None)
    return explain_request(engine.events, rid, config=engine.config, now=live)


class StoryBuilder:
    """Builds one request's story incrementally: `feed()` events as they come (oldest first), `story()` whenever
    the current story is wanted (the "Why?" panel feeds each poll's new events instead of re-reading the log).

    Args:
        request_id: the request.
        config: the engine's resolved config now (optional; may be replaced as the engine reconfigures). The
            advice quotes the config in force at the entry's step, never today's values for an older step.
    """

    def __init__(self, request_id: str, config: Any = None) -> None:
        rid = request_id
        self.rid = rid
        self.config = config
        # Reconfigure markers seen: (the last step under the old config, its values, the new values).
        self._reconfigs: list[tuple[int, dict[str, Any], dict[str, Any]]] = []
        # Per entry that gives advice (by id): (fields to quote, advice text, values the step itself carried).
        self._advice_of: dict[int, tuple[tuple[str, ...], str, dict[str, Any]]] = {}
        self._now_cache: tuple[Any, dict[str, Any]] = (None, {})
        self._story = RequestStory(rid)
        self.seen = False
        self.live = False  # between arrival and end
        self.ended = False
        self.entries = self._story.entries
        self.recompute = False  # the next prefill recomputes after a soft reset or a reconfigure
        self.last_step = 0

    # --------------------------------------------------------------------------------------- helpers
    def _add(self, entry: StoryEntry) -> None:
        """Append `entry`, in step order: with async batching the next step is planned before the previous one's
        events (a prefix hit, an offload) reach the log, so a one-event entry goes before the step entries planned
        after it, and a prefix hit before its own step's prefill."""
        i = len(self.entries)
        if entry.kind in _POINT_KINDS:
            while i > 0 and _planned_after(self.entries[i - 1], entry):
                i -= 1
        self.entries.insert(i, entry)

    def _merge(self, kind: str, step: int, numbers: dict[str, Any], reason: str | None = None) -> StoryEntry | None:
        """Extend the last entry when it is the same kind (and reason) and ended at the previous step."""
        if self.entries:
            last = self.entries[-1]
            if last.kind == kind and last.reason == reason and last.last_step == step - 1 and last.steps:
                last.last_step = step
                last.steps.append((step, numbers))
                return last
        return None

    def _advise(self, entry: StoryEntry, fields: Iterable[str], text: str, carried: dict[str, Any] | None = None
                ) -> None:
        """Give `entry` its advice; the config values it quotes are filled in by `story()` (see `_advice`)."""
        self._advice_of[id(entry)] = (tuple(fields), text, dict(carried or {}))
        entry.advice = self._advice(entry)

    def _in_force(self, step: int) -> tuple[dict[str, Any] | None, bool]:
        """The config values in force at `step`, and whether they are today's (no reconfigure since).
        None: unknown (a reconfigure after `step` whose marker did not record the old values)."""
        for last, before, _after in self._reconfigs:
            if step <= last:  # this reconfigure came after the step
                return (before or None), False
        if self.config is not None:
            return self._now(), True
        return (self._reconfigs[-1][2] or None) if self._reconfigs else None, True

    def _now(self) -> dict[str, Any]:
        """Today's config values (cached per config object: `story()` quotes them for every entry)."""
        cfg = self.config
        if cfg is None:
            return {}
        if self._now_cache[0] is not cfg:
            self._now_cache = (cfg, _config_values(cfg))
        return self._now_cache[1]

    def _advice(self, entry: StoryEntry) -> str:
        fields, text, carried = self._advice_of.get(id(entry), ((), entry.advice, {}))
        then, current = self._in_force(entry.step)
        then = dict(then or {}, **carried)  # the step's own budgets are exact
        now = self._now()
        quoted = [f for f in fields if f in then]
        if not quoted:
            return text
        said = ", ".join(f"{f}={then[f]}" for f in quoted)
        changed = [f for f in quoted if f in now and now[f] != then[f]]
        if current and not changed:
            return f"{text} (now {said})"
        if not changed:
            return f"{text} (at step {entry.step}: {said})"
        return f"{text} (at step {entry.step}: {said}; now " + ", ".join(f"{f}={now[f]}" for f in changed) + ")"

    # --------------------------------------------------------------------------------------- events
    def feed(self, events: Iterable[Any]) -> None:
        """Fold events (oldest first) into the story."""
        for e in events:
            self._feed(e)

    def _feed(self, e: Any) -> None:
        kind = getattr(e, "kind", "")
        if kind == "step_planned":
            if self.live or not self.ended:  # before its arrival too: the log may have dropped that
                self._step(e)
            return
        if kind == "run_started":
            if e.cause == "reconfigure":
                self._reconfigs.append((e.step, dict(getattr(e, "config_before", None) or {}),
                                        dict(getattr(e, "config_after", None) or {})))
            if self.live and e.cause == "reconfigure":
                self.recompute = True
                self._add(StoryEntry("reconfigure", e.step, e.step, numbers={"label": e.label},
                                     text=f"config changed ({e.label}): it is kept, and its KV recomputed in the "
                                          "new cache"))
            return
        if getattr(e, "request_id", None) != self.rid:
            return
        self.seen = True
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(e)

    def _on_request_added(self, e: Any) -> None:
        self.live = True
        self._story.prompt_tokens = e.prompt_tokens
        self._story.max_new_tokens = e.max_new_tokens
        self._story.state = "PENDING"
        limit = "no max_new_tokens limit" if e.max_new_tokens is None else f"max_new_tokens {e.max_new_tokens}"
        self._add(StoryEntry("arrival", e.step, e.step, numbers={"prompt_tokens": e.prompt_tokens,
                                                                  "max_new_tokens": e.max_new_tokens},
                             text=f"arrived with {e.prompt_tokens} prompt tokens, {limit}"))

    def _step(self, e: Any) -> None:
        rid = self.rid
        for t in e.taken:
            if t[0] == rid:
                self.seen = self.live = True
                self._taken(e.step, t[1], t[2], t[3])
                return
        for reason, ids, detail in e.skipped:
            if rid in ids:
                self.seen = self.live = True
                self._waiting(e.step, reason, dict(detail), e)
                return

    def _taken(self, step: int, phase: str, n: int, start: int) -> None:
        numbers = {"tokens": n, "start": start}
        if phase == "decode":
            entry = self._merge("decode", step, numbers)
            if entry is None:
                entry = StoryEntry("decode", step, step, numbers=numbers, steps=[(step, numbers)])
                self._add(entry)
            k = entry.count
            entry.text = f"decoding: {k} token{'s' if k != 1 else ''}, one per step"
            return
        reason = "recompute" if self.recompute else None
        entry = self._merge("prefill", step, numbers, reason)
        if entry is None:
            entry = StoryEntry("prefill", step, step, numbers=numbers, steps=[(step, numbers)], reason=reason)
            self._add(entry)
        chunks = [s[1] for s in entry.steps]
        first, last = chunks[0]["start"], chunks[-1]["start"] + chunks[-1]["tokens"]
        what = "recomputing its KV" if entry.reason == "recompute" else "prompt"
        sizes = ", ".join(str(c["tokens"]) for c in chunks[:8]) + (", ..." if len(chunks) > 8 else "")
        entry.text = (f"{what}: {len(chunks)} chunk{'s' if len(chunks) != 1 else ''} of {sizes} tokens "
                      f"(positions {first}-{last - 1})")

    def _waiting(self, step: int, reason: str, detail: dict[str, Any], e: Any) -> None:
        self._story.waited_steps[reason] = self._story.waited_steps.get(reason, 0) + 1
        numbers = dict(detail)
        entry = self._merge("waiting", step, numbers, reason)
        info = REASONS.get(reason, ReasonInfo(reason, "", (), ""))
        if entry is None:
            entry = StoryEntry("waiting", step, step, reason=reason, numbers=numbers, steps=[(step, numbers)],
                               fields=list(info.fields))
            # The step's budgets are the config in force when it was planned (a reconfigure changes them).
            carried = {"max_batch_tokens": getattr(e, "token_budget", None),
                       "max_requests_per_batch": getattr(e, "request_cap", None)}
            self._advise(entry, info.fields, info.advice, {k: v for k, v in carried.items() if v})
            self._add(entry)
        k = entry.count
        said = reason_numbers(reason, entry.steps[-1][1])
        entry.text = (f"left out {k} step{'s' if k != 1 else ''}: {info.label}: {info.meaning}"
                      + (f" ({said})" if said else ""))

    def _on_prefix_hit(self, e: Any) -> None:
        self._add(StoryEntry("prefix_hit", e.step, e.step,
                             numbers={"tokens": e.tokens, "blocks": list(e.blocks), "prompt_tokens": e.prompt_tokens},
                             text=f"prefix hit: {e.tokens} of {e.prompt_tokens} prompt tokens served from the cache "
                                  f"({len(e.blocks)} shared block{'s' if len(e.blocks) != 1 else ''})"))

    def _on_offload(self, e: Any) -> None:
        if e.path == "swap":
            text = f"swapped out to the host pool ({e.blocks_freed} blocks freed): {e.reason}"
            fields = ["num_blocks"]
            advice = "more num_blocks make offloads rarer; a swap keeps its progress (restored by a copy)"
        else:
            self.recompute = True
            text = (f"soft reset ({e.blocks_freed} blocks freed, {e.tokens_to_recompute} tokens to recompute): "
                    f"{e.reason}")
            fields = ["num_blocks", "cpu_offload_space"]
            advice = "more num_blocks make offloads rarer; cpu_offload_space > 0 swaps instead of recomputing"
        entry = StoryEntry("offload", e.step, e.step, reason=e.path, text=text, fields=fields,
                           numbers={"blocks_freed": e.blocks_freed, "tokens_to_recompute": e.tokens_to_recompute,
                                    "why": e.reason})
        self._advise(entry, fields, advice)
        self._add(entry)

    def _on_restore(self, e: Any) -> None:
        self._add(StoryEntry("restore", e.step, e.step, numbers={"blocks": e.blocks},
                             text=f"restored from the host pool ({e.blocks} blocks copied back, nothing recomputed)"))

    def _on_request_warning(self, e: Any) -> None:
        entry = StoryEntry("warning", e.step, e.step, reason=e.code, numbers={"code": e.code},
                           text=f"warning: {e.message}", fields=["num_blocks", "page_size"])
        self._advise(entry, ["num_blocks"], "a larger cache holds the whole request")
        self._add(entry)

    def _on_state_change(self, e: Any) -> None:
        if e.new == "DECODING":  # its prompt (or recomputation) is done
            self.recompute = False
        self._story.state = e.new

    def _on_request_done(self, e: Any) -> None:
        self.live = False
        self.ended = True
        self._story.state = e.state
        self._story.output_tokens = e.output_tokens
        bits = [f"{e.output_tokens} tokens"]
        if e.finish_reason:
            bits.append(f"finish reason {e.finish_reason}")
        if e.ttft_s is not None:
            bits.append(f"TTFT {1000 * e.ttft_s:.0f} ms")
        if e.e2e_s is not None:
            bits.append(f"end to end {e.e2e_s:.2f} s")
        if e.error:
            bits.append(f"error: {e.error}")
        self._add(StoryEntry("end", e.step, e.step, reason=e.finish_reason, text=f"{e.state}: " + ", ".join(bits),
                             numbers={"state": e.state, "output_tokens": e.output_tokens,
                                      "finish_reason": e.finish_reason, "ttft_s": e.ttft_s, "e2e_s": e.e2e_s}))

    # --------------------------------------------------------------------------------------- the end
    def story(self, now: Any = None) -> RequestStory:
        """The story so far; `now` is the request's live `RequestOutput` when it has one."""
        st = self._story
        if now is not None:
            st.state = getattr(now.state, "name", str(now.state))
            st.output_tokens = len(now.token_ids)
            st.prompt_tokens = len(now.prompt_token_ids)
            st.max_new_tokens = now.max_new_tokens
            st.prompt_text = getattr(now, "prompt_text", None)
        # No entry at all for a live request: its first step has not ended yet (events are logged as steps end), not
        # a log that dropped them.
        st.partial = bool(self.entries) and not any(e.kind == "arrival" for e in self.entries)
        for entry in self.entries:  # the config may have changed since the entry was made
            if id(entry) in self._advice_of:
                entry.advice = self._advice(entry)
        st.headline = self._headline()
        return st

    def _headline(self) -> str:
        st = self._story
        size = f"{st.prompt_tokens} prompt tokens" if st.prompt_tokens is not None else "prompt size unknown"
        limit = f"/{st.max_new_tokens}" if st.max_new_tokens is not None else ""
        head = f"{st.request_id} ({size}): {st.state}, {st.output_tokens}{limit} tokens"
        last = self.entries[-1] if self.entries else None
        if st.state == "PENDING" and last is not None and last.kind == "waiting":
            info = REASONS.get(last.reason or "")
            why = f"; waiting since step {last.step} for {info.label if info else last.reason}"
            if last.fields:
                why += f" (change {', '.join(last.fields)})"
            return head + why
        if st.waited_steps:
            total = sum(st.waited_steps.values())
            top = max(st.waited_steps, key=st.waited_steps.get)
            label = REASONS[top].label if top in REASONS else top
            return head + f"; left out {total} step{'s' if total != 1 else ''} in all, most for {label}"
        return head
