"""Prompt forms and request arguments (`cbnb.engine.prompts`): what people pass is accepted (text, chat messages, ids as
lists, tuples, 1-D tensors and arrays, tokenizer outputs with their attention mask), what cannot be meant is refused
with an error that names the argument, and every sampling / stop argument error names its field. Engine-level tests
check the tokens against ``model.generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

import cbnb
from cbnb.engine.prompts import prompt_ids, split_batch
from cbnb.core.requests import RequestState

from helpers_engine import STD_PROMPTS, TIMEOUT, config, oracle_for, tiny_model

LLAMA = "tiny:llama"
IDS = [11, 12, 13, 14]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine():
    with cbnb.Engine(tiny_model(LLAMA), config=config(page_size=16)) as eng:
        yield eng


# ----------------------------------------------------------------------------------------------- accepted forms
@pytest.mark.parametrize("form", [
    IDS, tuple(IDS), range(11, 15), [np.int64(i) for i in IDS], torch.tensor(IDS), torch.tensor([IDS]),
    torch.tensor(IDS, dtype=torch.int32), np.array(IDS), np.array([IDS], dtype=np.int32), [torch.tensor(IDS)],
    {"input_ids": IDS}, {"input_ids": [IDS], "attention_mask": [[1, 1, 1, 1]]},
    BatchEncoding({"input_ids": torch.tensor([IDS]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}),
    BatchEncoding({"input_ids": np.array([[0, 0] + IDS]), "attention_mask": np.array([[0, 0, 1, 1, 1, 1]])}),
    {"input_ids": torch.tensor([IDS + [0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]])},
], ids=lambda f: type(f).__name__)
def test_id_forms_accepted(form):
    assert prompt_ids(form, vocab_size=512) == IDS


@pytest.mark.parametrize("form, error, words", [
    (b"hello", TypeError, ["bytes", "decode"]),
    (bytearray(b"hi"), TypeError, ["bytearray", "decode"]),
    ({5, 6, 7}, TypeError, ["set", "no order"]),
    (frozenset({5}), TypeError, ["frozenset", "no order"]),
    (torch.tensor([[1, 2], [3, 4]]), ValueError, ["2 rows", "generate"]),
    (np.array([[1, 2], [3, 4]]), ValueError, ["2 rows", "generate"]),
    ([[1, 2], [3, 4]], ValueError, ["2 rows", "generate"]),
    ({"input_ids": [[1, 2], [3, 4]]}, ValueError, ["input_ids", "2 rows", "generate"]),
    (torch.tensor([True, False]), TypeError, ["bool"]),
    ([True, 4], TypeError, ["bool"]),
    (torch.tensor([1.0, 2.0]), TypeError, ["1.0", "integers"]),
    (torch.tensor(5), TypeError, ["0-d"]),
    (torch.zeros(1, 1, 3, dtype=torch.long), ValueError, ["3 dimensions"]),
    ({"ids": [1, 2]}, TypeError, ["input_ids", "ids"]),
    ({"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}, ValueError, ["attention_mask", "inside"]),
    ({"input_ids": [1, 2, 3], "attention_mask": [1, 1]}, ValueError, ["attention_mask", "one per input id"]),
    (3.5, TypeError, ["prompt must be"]),
    (object(), TypeError, ["prompt must be", "token ids"]),
    ([], ValueError, ["empty"]),
    ({"input_ids": [0, 0], "attention_mask": [0, 0]}, ValueError, ["empty"]),
    ([3, 512], ValueError, ["512", "vocabulary [0, 512)"]),
    ([-1], ValueError, ["-1", "vocabulary"]),
], ids=lambda f: type(f).__name__ if not isinstance(f, list) else None)
def test_refused_forms_name_the_argument(form, error, words):
    with pytest.raises(error) as info:
        prompt_ids(form, vocab_size=512)
    msg = str(info.value)
    assert "prompt" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_text_and_chat_need_a_tokenizer():
    with pytest.raises(ValueError, match="prompt is text but the engine has no tokenizer"):
        prompt_ids("hi")
    with pytest.raises(ValueError, match="prompt is chat messages but the engine has no tokenizer"):
        prompt_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="chat must be True, False or None"):
        prompt_ids(IDS, chat="yes")


class _Tok:
    """Stands in for a tokenizer: ids are character codes; a chat template wraps the text."""

    chat_template = "yes"

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return BatchEncoding({"input_ids": [1] + [ord(c) for m in messages for c in m["content"]] + [2]})


def test_text_and_chat_forms():
    tok = _Tok()
    assert prompt_ids("hi", tokenizer=tok) == [1, 104, 105, 2]  # the chat template by default
    assert prompt_ids("hi", tokenizer=tok, chat=False) == [104, 105]
    assert prompt_ids([{"role": "user", "content": "hi"}], tokenizer=tok) == [1, 104, 105, 2]
    with pytest.raises(TypeError, match=r"prompt\[1\] must be a chat message dict"):
        prompt_ids([{"role": "user", "content": "hi"}, "oops"], tokenizer=tok)
    with pytest.raises(ValueError, match="empty"):
        prompt_ids("", tokenizer=tok)


def test_split_batch_for_generate():
    assert split_batch([IDS, "x"]) == [IDS, "x"]
    rows = split_batch(torch.tensor([IDS, IDS[::-1]]))
    assert [r.tolist() for r in rows] == [IDS, IDS[::-1]]
    enc = BatchEncoding({"input_ids": torch.tensor([[0, 0] + IDS, [5, 6, 7, 8, 9, 10]]),
                         "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])})
    assert [prompt_ids(p) for p in split_batch(enc)] == [IDS, [5, 6, 7, 8, 9, 10]]
    for single, words in ((IDS, "one list of token ids"), ("text", "not one string"),
                          (torch.tensor(IDS), "1-D"), ({1, 2}, "set")):
        with pytest.raises(TypeError, match=words):
            split_batch(single)


# ----------------------------------------------------------------------------------------------- through the engine
def test_engine_accepts_tensors_arrays_and_tokenizer_outputs(engine):
    oracle = oracle_for(LLAMA)
    p, q = STD_PROMPTS[2], STD_PROMPTS[1]  # 17 and 13 tokens
    left = BatchEncoding({"input_ids": torch.tensor([p, [0] * 4 + q]),
                          "attention_mask": torch.tensor([[1] * 17, [0] * 4 + [1] * 13])})
    outs = engine.generate(left, max_new_tokens=6, eos_token_id=-1, timeout=TIMEOUT)  # one request per row
    assert [o.prompt_token_ids for o in outs] == [p, q]
    assert [o.token_ids for o in outs] == [oracle(p, 6), oracle(q, 6)]
    one = BatchEncoding({"input_ids": torch.tensor([[0, 0] + q]), "attention_mask": torch.tensor([[0, 0] + [1] * 13])})
    for form in (torch.tensor(p), np.array(p), torch.tensor([p]), {"input_ids": p}):
        assert engine.submit(form, max_new_tokens=4, eos_token_id=-1).result(TIMEOUT).token_ids == oracle(p, 4)
    assert engine.submit(one, max_new_tokens=4, eos_token_id=-1).result(TIMEOUT).token_ids == oracle(q, 4)
    rows = engine.generate(np.array([p[:13], q]), max_new_tokens=3, eos_token_id=-1, timeout=TIMEOUT)
    assert [o.token_ids for o in rows] == [oracle(p[:13], 3), oracle(q, 3)]


@pytest.mark.parametrize("form", [b"hello", {1, 2, 3}, torch.tensor([[1, 2], [3, 4]]), torch.tensor([True])],
                         ids=["bytes", "set", "2rows", "bool"])
def test_engine_refuses_and_goes_on(engine, form):
    with pytest.raises((TypeError, ValueError), match="prompt"):
        engine.submit(form, max_new_tokens=2)
    assert engine.running and not engine.core.requests


@pytest.mark.parametrize("field, value", [
    ("eos_token_id", "x"), ("eos_token_id", [2, "x"]), ("eos_token_id", 2.5), ("eos_token_id", True),
    ("max_new_tokens", 0), ("max_new_tokens", "5"), ("max_new_tokens", True), ("temperature", -0.5),
    ("temperature", "hot"), ("top_k", -1), ("top_p", 1.5), ("top_p", "x"), ("seed", 1.5), ("do_sample", "yes"),
    ("ignore_eos", "no"), ("chat", 1), ("request_id", ""), ("request_id", 7),
])
def test_every_argument_error_names_its_field(engine, field, value):
    with pytest.raises(ValueError, match=field):
        engine.submit([5, 6, 7], **{"max_new_tokens": 2, field: value})
    assert not engine.core.requests


@pytest.mark.parametrize("timeout", [-1, "soon", True])
def test_timeouts_are_checked(engine, timeout):
    with pytest.raises(ValueError, match="timeout"):
        engine.generate([[5, 6]], max_new_tokens=2, timeout=timeout)
    h = engine.submit([5, 6], max_new_tokens=2, eos_token_id=-1)
    with pytest.raises(ValueError, match="timeout"):
        h.result(timeout=timeout)
    assert h.result(TIMEOUT).state == RequestState.FINISHED
