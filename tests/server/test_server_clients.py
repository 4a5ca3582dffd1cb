"""Real clients against `engine.serve()` on the bundled SmolLM2-135M-Instruct: LangChain's `ChatOpenAI`
(`with_structured_output` of a pydantic model, `bind_tools`), and lm-eval's `local-completions` running a small
local multiple-choice task whose accuracies must equal lm-eval's own `hf` model on the same weights."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from helpers_engine import TIMEOUT, torch_threads
from helpers_structured import MAX_JSON_TOKENS, served_smollm2


class Person(BaseModel):
    """A person."""

    name: str = Field(description="first name", max_length=12)
    age: int = Field(description="age in years", ge=0, le=120)


class City(BaseModel):
    """A city and its country."""

    city: str = Field(max_length=20)
    country: str = Field(max_length=20)
    capital: bool


@pytest.fixture(scope="module")
def served():
    with served_smollm2() as pair:
        yield pair


def _chat(server, **kw):
    from langchain_openai import ChatOpenAI

    kw.setdefault("max_tokens", MAX_JSON_TOKENS)
    return ChatOpenAI(model="smollm2-135m", base_url=server.url, api_key="x", timeout=TIMEOUT, max_retries=0, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_langchain_with_structured_output_validates_every_time(served, temperature):
    _, server = served
    for model, question in ((Person, "Invent a person."), (City, "Tell me about Paris."),
                            (Person, "Who wrote Hamlet?")):
        llm = _chat(server, temperature=temperature, seed=7).with_structured_output(model)
        out = llm.invoke(question)
        assert isinstance(out, model)
        model.model_validate(out.model_dump())


def test_langchain_bind_tools(served):
    _, server = served

    def get_weather(city: str, unit: str) -> str:
        """Get the weather in a city; unit is celsius or fahrenheit."""
        return "sunny"

    forced = _chat(server, temperature=0).bind_tools([get_weather, Person], tool_choice="required")
    first = None
    for q in ("What is the weather in Paris?", "Describe a person called Ada, 36."):
        msg = forced.invoke(q)
        first = first or msg
        assert msg.tool_calls, msg
        call = msg.tool_calls[0]
        assert call["name"] in ("get_weather", "Person") and call["id"]
        if call["name"] == "Person":
            Person.model_validate(call["args"])
        else:
            assert set(call["args"]) == {"city", "unit"} and all(isinstance(v, str) for v in call["args"].values())
    named = _chat(server, temperature=1.0, seed=3).bind_tools([get_weather, Person], tool_choice="Person")
    call = named.invoke("Describe someone.").tool_calls[0]
    assert call["name"] == "Person"
    Person.model_validate(call["args"])
    auto = _chat(server, temperature=0, max_tokens=16).bind_tools([get_weather])
    msg = auto.invoke("What is the weather in Rome?")
    assert msg.tool_calls or msg.content  # the model chose; either is a well-formed message
    for c in msg.tool_calls:
        assert c["name"] == "get_weather" and isinstance(c["args"], dict)
    streamed = list(forced.stream("What is the weather in Paris?"))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged = merged + chunk
    assert merged.tool_calls and merged.tool_calls[0]["name"] == first.tool_calls[0]["name"]
    assert merged.tool_calls[0]["args"] == first.tool_calls[0]["args"]  # the streamed deltas make the same call


# ------------------------------------------------------------------------------------------------ lm-eval
DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "How many legs does a cat have?", "choices": ["two", "four", "eight"], "answer": 1},
    {"question": "Which colour is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "What is 2 + 2?", "choices": ["four", "five", "twenty-two"], "answer": 0},
    {"question": "Which animal barks?", "choices": ["a fish", "a dog", "a snake"], "answer": 1},
]
TASK = """task: cbnb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_local_completions_equals_its_hf_model(served, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from helpers_engine import converted_smollm2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "cbnb_mc.yaml").write_text(TASK.format(docs=docs))
    path = str(converted_smollm2())
    _, server = served

    def run(model, args):
        res = simple_evaluate(model=model, model_args=args, tasks=["cbnb_mc"], batch_size=1,
                              task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
                              bootstrap_iters=0)
        lls = [[r[0] for r in s["filtered_resps"]] for s in sorted(res["samples"]["cbnb_mc"],
                                                                   key=lambda s: s["doc_id"])]
        return res["results"]["cbnb_mc"], lls

    served_res, served_ll = run("local-completions", f"model=smollm2-135m,base_url={server.url}/completions,"
                                f"tokenizer_backend=huggingface,tokenizer={path},num_concurrent=1,max_retries=1")
    with torch_threads(1):
        hf_res, hf_ll = run("hf", f"pretrained={path},dtype=float32,device=cpu")
    assert len(served_ll) == len(DOCS)
    for a, b in zip(served_ll, hf_ll):
        assert a == pytest.approx(b, abs=1e-4)  # each choice's log-likelihood: float32 noise only (~1e-5)
    for metric in ("acc,none", "acc_norm,none"):
        assert served_res[metric] == hf_res[metric], (metric, served_res, hf_res)
