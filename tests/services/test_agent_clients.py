"""Real client libraries against one real three-process server (the embedded SmolLM2-135M,
float32 on the CPU): the `openai` SDK's tool calling, streaming and `parse`; the OpenAI
Agents SDK through both its chat-completions and its Responses model; `instructor` in its
tools and JSON-schema modes; and `lm-eval`'s loglikelihood protocol (echo + logprobs, the
remote tokenizer), whose numbers are checked against the offline Engine and transformers.
Every tool call the server returns is read with strict `json.loads` and checked with
`jsonschema`. The module ends with the worker's KV all free."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import instructor
import jsonschema
import openai
import pytest
import torch
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field

from engine.api import Engine
from testing.grammar_schemas import SCHEMAS
from testing.models import embedded_hf_model
from testing.net import all_kv_free, wait_until

MODEL = "embedded"
CITY = {"type": "string", "maxLength": 20}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "utc": {"type": "boolean"}},
            "required": ["city", "utc"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA_EXTRAS: dict[str, dict[str, Any]] = {
    # Greedy, the 135M model nests children forever (`{"value": 1, "children": [{"value":
    # 2, "children": [...`, past 400 tokens); a frequency penalty lets it close its nodes.
    "recursive $ref": {"frequency_penalty": 1.0},
}
"""Sampling fields one schema needs on top of greedy decoding."""
SCHEMA_MAX_TOKENS = 96
"""Enough for every schema's arguments (the longest take about 45 tokens)."""
REQUIRED_SCHEMAS = ("nested object", "top-level array", "$defs and $ref", "recursive $ref")
"""The schemas also asked for under tool_choice "required": plain, wrapped, and two whose
parameters refer to their own `$defs`."""


def tool_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as a function's parameters, which must be an object: a schema of another
    type (or a bare `$ref`) becomes the property `value`, its `$defs` kept at the root so
    that its references still resolve."""
    if schema.get("type") == "object":
        return schema
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    wrapped: dict[str, Any] = {
        "type": "object",
        "properties": {"value": inner},
        "required": ["value"],
    }
    if "$defs" in schema:
        wrapped["$defs"] = schema["$defs"]
    return wrapped


def answer_tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Record the answer.",
            "parameters": tool_parameters(schema),
        },
    }


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def tool_by_name(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t for t in tools if t["function"]["name"] == name)


def checked_calls(message: Any, tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each of the message's tool calls, the arguments parsed with
    strict `json.loads` and validated against the called tool's parameters."""
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id, call
        arguments = json.loads(call.function.arguments)
        tool = tool_by_name(tools, call.function.name)
        jsonschema.validate(arguments, tool["function"]["parameters"])
        calls.append((call.function.name, arguments))
    return calls


@pytest.fixture(scope="module")
def base_url(embedded_server: str) -> str:
    # The embedded SmolLM2-135M-Instruct; the default `hermes` tool-call parser.
    return embedded_server


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=base_url, timeout=60, trust_env=False) as http:
        yield http


# ----- the openai SDK -------------------------------------------------------------------


def test_required_and_named_tool_choice_give_calls_that_validate(client: openai.OpenAI):
    """Forced tool choice on one tool: a call (or several, for "required") whose arguments
    are strict JSON that satisfies the tool's parameters; "required" ends with finish_reason
    "tool_calls", a named function with "stop" (OpenAI's convention)."""
    tools = [WEATHER_TOOL]
    for tool_choice, finish_reason in (("required", "tool_calls"), (named("get_weather"), "stop")):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=WEATHER_QUESTION,
            tools=tools,
            tool_choice=tool_choice,
            temperature=0,
            max_tokens=64,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == finish_reason, (tool_choice, choice)
        calls = checked_calls(choice.message, tools)
        assert {name for name, _ in calls} == {"get_weather"}
        if tool_choice != "required":
            assert len(calls) == 1


def _schema_call(
    client: openai.OpenAI, name: str, tool_choice: str, **fields: Any
) -> tuple[str, Any]:
    prompt, schema = SCHEMAS[name]
    return name, client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        tools=[answer_tool(schema)],
        tool_choice=named("answer") if tool_choice == "named" else tool_choice,
        temperature=0,
        max_tokens=SCHEMA_MAX_TOKENS,
        **SCHEMA_EXTRAS.get(name, {}),
        **fields,
    )


def test_twenty_tool_schemas_named_give_arguments_that_validate(client: openai.OpenAI):
    """Each of the 20 grammar schemas as a function's parameters, the function forced by
    name: one call whose arguments validate, none cut off by max_tokens."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda name: _schema_call(client, name, "named"), SCHEMAS))
    assert len(answers) == 20
    for name, answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        tool = answer_tool(SCHEMAS[name][1])
        assert [n for n, _ in checked_calls(choice.message, [tool])] == ["answer"], name


def test_required_tool_choice_on_schemas_with_defs_and_wrapping(client: openai.OpenAI):
    """tool_choice "required" (one call: parallel_tool_calls off) on a few of the schemas,
    two of whose parameters refer to their own `$defs`: each answer is one call whose
    arguments validate, finish_reason "tool_calls"."""

    def ask(name: str) -> tuple[str, Any]:
        try:
            return _schema_call(client, name, "required", parallel_tool_calls=False)
        except openai.APIStatusError as err:
            return name, err

    with ThreadPoolExecutor(len(REQUIRED_SCHEMAS)) as pool:
        answers = list(pool.map(ask, REQUIRED_SCHEMAS))
    refused = {name: a.body for name, a in answers if isinstance(a, openai.APIStatusError)}
    assert not refused, f"the server refused valid tools: {refused}"
    for name, answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", (name, choice)
        tool = answer_tool(SCHEMAS[name][1])
        assert [n for n, _ in checked_calls(choice.message, [tool])] == ["answer"], name


def reassembled(chunks: list[Any]) -> tuple[list[tuple[str, str, str]], str | None]:
    """The (id, name, arguments) of each streamed call, by index — id and name from its
    first delta, the arguments concatenated — and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index == 0
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.function and delta.function.name, delta
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
                else:
                    assert delta.id is None or delta.id == calls[delta.index]["id"], delta
                calls[delta.index]["args"] += (delta.function and delta.function.arguments) or ""
    assert sorted(calls) == list(range(len(calls))), "indexes count from 0"
    return [(c["id"], c["name"], c["args"]) for _, c in sorted(calls.items())], finish_reason


@pytest.mark.parametrize("tool_choice", ["required", named("get_time")], ids=["required", "named"])
def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_calls(
    client: openai.OpenAI, tool_choice: Any
):
    """Greedy, with two tools: the streamed deltas, joined by index, give the same calls
    (names, arguments) and finish reason as the same request unstreamed."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}
        ],
        tools=tools,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=96,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    checked_calls(whole.message, tools)
    streamed, finish_reason = reassembled(
        list(client.chat.completions.create(**kwargs, stream=True))
    )
    assert [(name, args) for _, name, args in streamed] == expected
    assert len({call_id for call_id, _, _ in streamed}) == len(streamed), "ids are distinct"
    assert finish_reason == whole.finish_reason


def test_the_sdk_stream_helper_assembles_the_same_calls(client: openai.OpenAI):
    """The openai SDK's own stream accumulator (`chat.completions.stream`) builds, from the
    server's chunks, the calls the unstreamed request returns."""
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    streamed = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    # The SDK merges a call's deltas by index across chunks, not within one: two deltas of
    # one call in the same chunk become two calls.
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


class CapitalAnswer(BaseModel):
    city: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


def test_parse_with_a_pydantic_response_format_returns_an_instance(client: openai.OpenAI):
    """`chat.completions.parse` sends the model's strict JSON schema; the answer parses
    back into the pydantic model."""
    answer = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "The capital of France and its population."}],
        response_format=CapitalAnswer,
        temperature=0,
        max_tokens=64,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, CapitalAnswer)


def test_auto_tool_choice_answers_in_a_valid_shape(client: openai.OpenAI):
    """Under "auto" the model chooses (a 135M model rarely calls): either calls that name
    an offered tool, or content; the finish reason is one of OpenAI's."""
    tools = [WEATHER_TOOL, TIME_TOOL]
    answer = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=tools, temperature=0, max_tokens=32
    )
    choice = answer.choices[0]
    assert choice.finish_reason in {"stop", "tool_calls", "length"}
    if choice.message.tool_calls:
        for call in choice.message.tool_calls:
            assert call.function.name in {"get_weather", "get_time"}
            assert isinstance(json.loads(call.function.arguments), dict)
        if choice.finish_reason != "length":
            assert choice.finish_reason == "tool_calls"
    else:
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason != "tool_calls"


def test_a_tool_result_conversation_round_trips(client: openai.OpenAI, http: httpx2.Client):
    """An assistant turn with tool_calls and the `tool` message answering it: the server
    renders both (as hermes blocks, the embedded template having no tool support) and
    answers."""
    messages: list[dict[str, Any]] = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=32
    )
    choice = answer.choices[0]
    assert choice.message.content or choice.message.tool_calls, choice
    assert choice.finish_reason in {"stop", "tool_calls", "length"}

    tokens = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]})
    assert tokens.status_code == 200, tokens.text
    prompt = http.post("/detokenize", json={"tokens": tokens.json()["tokens"]})
    assert prompt.status_code == 200, prompt.text
    text = prompt.json()["prompt"]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in text
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in text
    assert answer.usage.prompt_tokens == len(tokens.json()["tokens"])


# ----- the OpenAI Agents SDK ------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_agent_calls_its_function_tool(base_url: str, api: str):
    """An `agents` Agent with one function tool, tool_choice "required" and
    stop_on_first_tool, through the chat-completions model and the Responses model: the
    tool runs with a string city and its return value is the final output."""
    set_tracing_disabled(True)
    calls: list[Any] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> Any:
        async_client = openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300
        )
        model: OpenAIChatCompletionsModel | OpenAIResponsesModel = (
            OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client)
            if api == "chat_completions"
            else OpenAIResponsesModel(model=MODEL, openai_client=async_client)
        )
        agent = Agent(
            name="weather",
            instructions="Answer questions about the weather with the tool.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        finally:
            await async_client.close()

    result = asyncio.run(run())
    assert calls and all(isinstance(city, str) for city in calls), calls
    assert result.final_output in {f"sunny in {city}" for city in calls}


# ----- instructor -----------------------------------------------------------------------


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_returns_a_validated_model(base_url: str, mode: instructor.Mode):
    """instructor in TOOLS mode (a forced function) and JSON_SCHEMA mode (response_format),
    without retries: the first answer validates as the pydantic model."""
    patched = instructor.from_openai(
        openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300),
        mode=mode,
    )
    city = patched.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_retries=0,
        temperature=0,
        max_tokens=64,
    )
    assert isinstance(city, City)
    assert 0 < len(city.name) <= 20 and 0 < len(city.country) <= 20


# ----- lm-eval --------------------------------------------------------------------------

FACTS: list[tuple[str, list[str], int]] = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("The capital of Japan is", [" Beijing", " Tokyo", " Seoul", " Bangkok"], 1),
    ("The capital of Italy is", [" Vienna", " Athens", " Rome", " Lisbon"], 2),
    ("The capital of Germany is", [" Warsaw", " Prague", " Oslo", " Berlin"], 3),
    ("The capital of Spain is", [" Madrid", " Paris", " Dublin", " Brussels"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Venus", " Earth"], 1),
    ("Water freezes at zero degrees", [" Fahrenheit", " Kelvin", " Celsius", " Rankine"], 2),
    ("The opposite of hot is", [" warm", " big", " loud", " cold"], 3),
    ("A week has seven", [" days", " months", " years", " hours"], 0),
    ("The sun rises in the", [" west", " east", " north", " south"], 1),
    ("Two plus two equals", [" five", " three", " four", " six"], 2),
    ("The color of the sky on a clear day is", [" green", " red", " yellow", " blue"], 3),
    ("Cows give us", [" milk", " wool", " silk", " honey"], 0),
    ("The chemical symbol for water is", [" CO2", " H2O", " NaCl", " O2"], 1),
    ("Bees make", [" milk", " bread", " honey", " cheese"], 2),
    ("The first month of the year is", [" March", " June", " December", " January"], 3),
    ("A triangle has three", [" sides", " wheels", " legs", " eyes"], 0),
    ("The Eiffel Tower is in", [" London", " Paris", " Rome", " Berlin"], 1),
    ("Ice is frozen", [" fire", " sand", " water", " air"], 2),
    ("Fish live in", [" trees", " deserts", " clouds", " water"], 3),
]
"""20 simple facts: context, the four choices (each with its leading space), the answer."""
TASK = "radixserve_simple_facts"


def write_task(folder: Path) -> Path:
    """A multiple-choice task over FACTS from a local jsonl, as lm-eval's YAML defines
    one; the choices carry their own leading space, so the delimiter is empty."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "facts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": choices, "answer": a}) + "\n"
            for q, choices, a in FACTS
        )
    )
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n"
    )
    return folder


def remote_encode(http: httpx2.Client, text: str) -> list[int]:
    """What lm-eval's RemoteTokenizer.encode asks the server for."""
    response = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def encode_pair(http: httpx2.Client, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's `_encode_pair` for a causal model on the remote tokenizer: trailing spaces
    of the context move to the continuation, the whole text and the context are encoded,
    and the continuation is what the whole has past the context's length. Returns the
    whole ids and the continuation's length."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = remote_encode(http, context + continuation)
    context_ids = remote_encode(http, context)
    return whole, len(whole) - len(context_ids)


def offline_loglikelihoods(sequences: list[tuple[list[int], int]]) -> list[float]:
    """The sum of each sequence's last `n` token logprobs from the offline Engine's prefill
    (max_new_tokens 0, every prompt logprob)."""
    # No grammar backend: it is not needed here, and it takes seconds to build.
    with Engine(
        model=MODEL, dtype="float32", device="cpu", max_total_tokens=8192, grammar_backend="none"
    ) as engine:
        results = engine.generate(
            [ids for ids, _ in sequences], {"max_new_tokens": 0, "logprob_start_len": 0}
        )
    sums = []
    for (ids, n), result in zip(sequences, results):
        logprobs = result.meta.input_token_logprobs
        assert logprobs is not None and [t for _, t in logprobs] == ids
        values = [lp for lp, _ in logprobs[len(ids) - n :]]
        assert all(v is not None for v in values)
        sums.append(float(sum(v for v in values if v is not None)))
    return sums


def transformers_loglikelihoods(
    model: torch.nn.Module, sequences: list[tuple[list[int], int]]
) -> list[float]:
    """The same sums from transformers' float32 model of the GGUF, log-softmax in float64:
    one forward pass of the right-padded batch (causal: padding after a sequence does not
    reach its positions)."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in sequences])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in sequences])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits.to(torch.float64)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [
        sum(logprobs[row, p - 1, ids[p]].item() for p in range(len(ids) - n, len(ids)))
        for row, (ids, n) in enumerate(sequences)
    ]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def test_lm_eval_loglikelihoods_match_the_engine_and_transformers(
    base_url: str,
    http: httpx2.Client,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """lm-eval's `local-completions` model with the remote tokenizer on a 20-question
    multiple-choice task read offline from local files: every choice's loglikelihood equals
    the offline Engine's prefill of the same ids (1e-4) and transformers' (1e-3), and the
    reported accuracy is the one those loglikelihoods give."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    import datasets.config
    import huggingface_hub.constants
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Read at import: set here too in case another test imported them first.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")

    task_dir = write_task(tmp_path / "tasks")
    # transformers' reading of the GGUF is half a minute of mostly single-threaded parsing:
    # it overlaps lm-eval's run, whose work is the server's.
    loader = ThreadPoolExecutor(1)
    hf_model = loader.submit(embedded_hf_model)
    loader.shutdown(wait=False)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={base_url}/v1/completions,model={MODEL},tokenizer_backend=remote,"
            "num_concurrent=4,max_retries=1"
        ),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(FACTS)

    reported: list[list[float]] = []
    pairs: list[tuple[str, str]] = []
    for sample in samples:
        context, choices, answer = FACTS[sample["doc_id"]]
        assert [list(a) for a in sample["arguments"]] == [[context, c] for c in choices]
        assert sample["target"] == answer
        per_choice = [ll for ll, _ in sample["filtered_resps"]]
        assert per_choice == [resp[0][0] for resp in sample["resps"]]
        reported.append(per_choice)
        pairs += [(context, c) for c in choices]
    with ThreadPoolExecutor(8) as pool:
        sequences = list(pool.map(lambda pair: encode_pair(http, *pair), pairs))

    offline = offline_loglikelihoods(sequences)
    gc.collect()
    reference = transformers_loglikelihoods(hf_model.result(), sequences)
    del hf_model  # the future holds the model
    gc.collect()
    flat = [ll for per_choice in reported for ll in per_choice]
    assert flat == pytest.approx(offline, abs=1e-4)
    assert flat == pytest.approx(reference, abs=1e-3)

    n = len(FACTS[0][1])
    correct = [
        argmax(offline[d * n : (d + 1) * n]) == FACTS[sample["doc_id"]][2]
        for d, sample in enumerate(samples)
    ]
    assert results["results"][TASK]["acc,none"] == pytest.approx(sum(correct) / len(correct))


# ----- the end --------------------------------------------------------------------------


def test_every_kv_slot_is_free_after_all_the_clients(http: httpx2.Client):
    """Nothing running or waiting and every KV slot free or evictable once the clients
    above are done: no request leaked its slot (streams, aborts and tool calls included)."""
    wait_until(lambda: all_kv_free(http), 30, "the worker's KV to be all free")
