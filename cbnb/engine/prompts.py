"""Prompt forms and request arguments: what `Engine.submit` / `generate` accept, as token ids and `SamplingParams`
(torch-free: tensors and arrays are read through their ``tolist()``, so neither torch nor numpy is imported here).

A prompt is one of

- text (``str``): tokenised; the chat template is applied when `chat` is True, or when None and the tokenizer has one;
- chat messages: a list of ``{"role": ..., "content": ...}`` dicts (the chat template with a generation prompt);
- token ids: a list/tuple/range of ints (numpy and torch integer scalars too), a 1-D torch tensor or numpy array
  of an integer dtype, or a 2-D one with a single row;
- a tokenizer's output (``BatchEncoding``, or any mapping with ``"input_ids"``) of one row; its
  ``"attention_mask"`` is honoured: padded positions (left or right) are dropped.

Refused, with `TypeError` naming the argument and what is accepted: ``bytes`` (decode them first), sets (no order),
bool or float ids, other objects. Refused with `ValueError`: empty prompts, ids outside ``[0, vocab_size)``, and
several rows (a batch: pass it to ``generate([...])``, which takes a list of prompts, a 2-D tensor/array or a
batched tokenizer output and submits one request per row).

`sampling_params` builds a request's `SamplingParams`; every bad value raises `ValueError` naming its field.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.requests import SamplingParams

__all__ = ["ACCEPTED", "prompt_ids", "prompt_preview", "split_batch", "sampling_params"]

ACCEPTED = ("text (str), chat messages (a list of {'role', 'content'} dicts), token ids (a list/tuple of ints, a "
            "1-D torch tensor or numpy array), or a tokenizer output with 'input_ids' (one row)")


def _is_array(x: Any) -> bool:
    """A torch tensor or numpy array (anything with `ndim` and `tolist`)."""
    return hasattr(x, "ndim") and hasattr(x, "tolist") and not isinstance(x, (str, bytes))


def _rows(x: Any, name: str) -> list[list[Any]]:
    """`x` (ids, a 1-D or 2-D tensor/array, or a list of id lists) as a list of rows."""
    if _is_array(x):
        if x.ndim == 0:
            raise TypeError(f"{name} is a 0-d {type(x).__name__} (one scalar); pass token ids as a 1-D tensor or list")
        if x.ndim > 2:
            raise ValueError(f"{name} has {x.ndim} dimensions; token ids must be 1-D (or 2-D with one row)")
        data = x.tolist()
        return [data] if x.ndim == 1 else data
    if isinstance(x, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} is {type(x).__name__}: decode it to text first (e.g. {name}.decode('utf-8')) or "
                        f"pass token ids; accepted: {ACCEPTED}")
    if isinstance(x, (set, frozenset)):
        raise TypeError(f"{name} is a {type(x).__name__}, which has no order: pass token ids as a list or tuple")
    if isinstance(x, (str, Mapping)) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be {ACCEPTED}; got {type(x).__name__}")
    if len(x) and all(_is_row(r) for r in x):
        return [r.tolist() if _is_array(r) else list(r) for r in x]
    return [list(x)]


def _is_row(r: Any) -> bool:
    if _is_array(r):
        return r.ndim >= 1
    return isinstance(r, Sequence) and not isinstance(r, (str, bytes))


def _int_ids(row: list[Any], name: str) -> list[int]:
    ids = []
    for i in row:
        if isinstance(i, bool) or type(i).__name__ in ("bool_", "bool"):
            raise TypeError(f"{name} holds a bool ({i!r}); token ids must be integers (is this an attention mask?)")
        try:
            ids.append(operator.index(i))
        except TypeError:
            raise TypeError(f"{name} holds {i!r} ({type(i).__name__}); token ids must be integers") from None
    return ids


def _from_encoding(enc: Mapping, name: str) -> list[int]:
    if "input_ids" not in enc:
        raise TypeError(f"{name} is a mapping without 'input_ids' (keys: {sorted(map(str, enc))}); "
                        f"accepted: {ACCEPTED}")
    rows = _rows(enc["input_ids"], f"{name}['input_ids']")
    if len(rows) != 1:
        raise ValueError(f"{name}['input_ids'] has {len(rows)} rows, but one request takes one prompt: pass the "
                         "batch to generate(...) (one request per row), or one row")
    ids = _int_ids(rows[0], f"{name}['input_ids']")
    mask = enc.get("attention_mask")
    if mask is None:
        return ids
    m = [int(v) for v in _rows(mask, f"{name}['attention_mask']")[0]]
    if len(m) != len(ids) or any(v not in (0, 1) for v in m):
        raise ValueError(f"{name}['attention_mask'] must be 0/1 flags, one per input id ({len(ids)}); got {m!r}")
    kept = [k for k, v in enumerate(m) if v]
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        raise ValueError(f"{name}['attention_mask'] has padding inside the prompt ({m!r}); only left or right "
                         "padding can be dropped")
    return [ids[k] for k in kept]


def prompt_ids(prompt: Any, *, tokenizer: Any = None, vocab_size: int | None = None, chat: bool | None = None,
               name: str = "prompt") -> list[int]:
    """Token ids of one prompt (forms in the module docstring).

    Args:
        prompt: the prompt.
        tokenizer: a transformers tokenizer (needed for text and chat messages).
        vocab_size: ids must lie in [0, vocab_size) (None: only >= 0 is checked).
        chat: apply the chat template to text (None: when the tokenizer has one).
        name: the argument's name in error messages.

    Raises:
        TypeError: a form that is not accepted (the message lists those that are).
        ValueError: an empty prompt, ids out of range, several rows, text without a tokenizer.
    """
    if chat is not None and not isinstance(chat, bool):
        raise ValueError(f"chat must be True, False or None; got {chat!r}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{name} is text but the engine has no tokenizer: pass token ids")
        if not prompt:
            raise ValueError(f"{name} must not be empty")
        use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
        if use_chat:
            return prompt_ids([{"role": "user", "content": prompt}], tokenizer=tokenizer, vocab_size=vocab_size,
                              name=name)
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, Mapping):
        ids = _from_encoding(prompt, name)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Mapping):
        if tokenizer is None:
            raise ValueError(f"{name} is chat messages but the engine has no tokenizer: pass token ids")
        for k, m in enumerate(prompt):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise TypeError(f"{name}[{k}] must be a chat message dict with 'role' and 'content'; got {m!r}")
        out = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out)
    else:
        rows = _rows(prompt, name)
        if len(rows) != 1:
            raise ValueError(f"{name} has {len(rows)} rows, but one request takes one prompt: pass the rows to "
                             "generate([...]) (one request per row), or one row")
        ids = _int_ids(rows[0], name)
    if not ids:
        raise ValueError(f"{name} must contain at least one token; got an empty prompt")
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        span = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary {span}")
    return ids


def split_batch(prompts: Any) -> list[Any]:
    """The prompts of a `generate()` call, one per request: a list/tuple/iterable of prompts, a 2-D tensor or array
    (one prompt per row), or a batched tokenizer output (one prompt per row, each with its attention-mask row).

    Raises:
        TypeError: a single prompt (text, or one list of ids), naming how to pass it.
    """
    if isinstance(prompts, (str, bytes)):
        raise TypeError("generate() takes a list of prompts, not one string: use generate([prompt]) or "
                        "submit(prompt)")
    if isinstance(prompts, Mapping) and "input_ids" in prompts:
        ids = _rows(prompts["input_ids"], "prompts['input_ids']")
        mask = prompts.get("attention_mask")
        masks = _rows(mask, "prompts['attention_mask']") if mask is not None else [None] * len(ids)
        if len(masks) != len(ids):
            raise ValueError(f"prompts['attention_mask'] has {len(masks)} rows for {len(ids)} rows of input_ids")
        return [{"input_ids": r} if m is None else {"input_ids": r, "attention_mask": m} for r, m in zip(ids, masks)]
    if _is_array(prompts):
        if prompts.ndim != 2:
            raise TypeError(f"generate() takes a list of prompts or a 2-D batch; got a {prompts.ndim}-D "
                            f"{type(prompts).__name__}: use generate([ids]) or submit(ids)")
        return list(prompts)
    if isinstance(prompts, (set, frozenset, Mapping)):
        raise TypeError(f"generate() takes a list of prompts; got a {type(prompts).__name__}")
    try:
        items = list(prompts)
    except TypeError:
        raise TypeError(f"generate() takes a list of prompts; got {type(prompts).__name__}") from None
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        raise TypeError("generate() takes a list of prompts; got one list of token ids: use generate([ids]) or "
                        "submit(ids)")
    return items


def sampling_params(prompt_len: int, args: Mapping[str, Any], *, eos_token_id: Any = None,
                    default_eos: frozenset[int] = frozenset(), vocab_size: int | None = None,
                    max_positions: int | None = None) -> tuple[SamplingParams, int | None]:
    """A request's `SamplingParams` and its token cap (max positions minus the prompt; None: no cap).

    Args:
        prompt_len: the prompt's length in tokens.
        args: SamplingParams keyword arguments (the request's, over the engine's defaults: `GenerationDefaults`).
        eos_token_id: the request's EOS id(s); None means `default_eos` (the generation config's, or the model's).
        vocab_size: token ids in the arguments must lie in [0, vocab_size) (None: unchecked).
        max_positions: a `max_new_tokens` above the cap is lowered to it.

    Raises:
        ValueError: naming the field, for any bad value, or a prompt that leaves no room to generate.
    """
    eos = default_eos if eos_token_id is None else SamplingParams.normalize_eos(eos_token_id, "eos_token_id")
    sp = SamplingParams(**dict(args), eos_token_ids=eos)
    if vocab_size is not None:
        sp.check_vocab(vocab_size)
    cap = None
    if max_positions:
        cap = max_positions - prompt_len
        if cap < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate: the model's max positions "
                             f"are {max_positions}")
        if sp.max_new_tokens is not None and sp.max_new_tokens > cap:
            sp = dataclasses.replace(sp, max_new_tokens=cap)
    return sp, cap


def prompt_preview(prompt: Any, max_chars: int = 200) -> str | None:
    """The words a person typed, for display: a text prompt itself, or the last user message of chat messages
    (without the chat template around it), cut to `max_chars`; None for token ids and tokenizer outputs."""
    text = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
        content = users[-1].get("content")
        text = content if isinstance(content, str) else None
    if text is None:
        return None
    text = " ".join(text.split())
    return text[:max_chars]
