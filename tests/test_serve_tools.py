"""Tool calls and structured output over HTTP with the real `openai` client (and LangChain where
it is installed), on the reference backend.

Tiny random models with a long context serve most cases: their replies are noise, so whatever
comes back through a constraint is checked against its schema with `jsonschema`, and calls are
read back in each family's format (the tiny model's GGUF rewritten with a real template, the
formats' markers made control tokens). The default model shows real conversations.
"""
import json
import pathlib
import re
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

import poot
from poot.formats.gguf import GGUFFile, write_gguf
from poot.models.random_weights import SHAPES, Shape, write_random_llama
from tests.models import default_model
from tests.test_serve import call, start_server

jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = pathlib.Path(__file__).parent / "data/chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                             "maximum": 14}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def long_tiny(folder, template=None, controls=()):
    """The tiny random Llama with a 4096-token context (prompts that list tools are long in a
    vocabulary of bytes); `template`: a real chat template from tests/data instead of ChatML;
    `controls`: texts that become control tokens (in place of reserved ones)."""
    base = folder / "tiny-long.gguf"
    if not base.exists():
        tiny = SHAPES["tiny"]
        write_random_llama(base, Shape(tiny.n_layers, tiny.d_model, tiny.n_heads,
                                       tiny.n_kv_heads, tiny.d_ff, tiny.vocab_size, 4096))
    if template is None:
        return poot.load(base)
    source = GGUFFile(base)
    meta = dict(source.metadata)
    meta["tokenizer.chat_template"] = (TEMPLATES / f"{template}.jinja").read_text("utf-8")
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for i, text in enumerate(controls):
        at = tokens.index(f"<|reserved_{i}|>")
        tokens[at], types[at] = text, 3
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    path = folder / f"tiny-long-{template}.gguf"
    write_gguf(path, meta, [(name, "F32", source.array(name)) for name in source.tensors])
    return poot.load(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tools")


@pytest.fixture(scope="module")
def tiny(folder):
    return long_tiny(folder)


@pytest.fixture(scope="module")
def server(tiny):
    server = start_server(tiny, num_blocks=2048, block_size=4, step_tokens=512,
                          served_names=["tiny", "gpt-4o-mini"])
    yield server
    server.close(grace=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def create(client, **kw):
    kw = {"model": "tiny", "messages": ASK, "max_tokens": 300, "seed": 1, **kw}
    return client.chat.completions.create(**kw)


def streamed(client, **kw):
    """(content, [(name, arguments)], finish_reason) of a streamed reply, its deltas joined as
    the OpenAI docs join them (by each call's index)."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            got = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            got["name"] += part.function.name or ""
            got["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [(c["name"], c["arguments"]) for c in calls.values()], finish


def check_calls(calls, names=SCHEMAS):
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), names[name])


# ---- tools ------------------------------------------------------------------------------------

def test_a_required_call_is_a_valid_call_whole_and_streamed(client):
    reply = create(client, tools=TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    check_calls([(c.function.name, c.function.arguments) for c in calls])
    content, streamed_calls, finish = streamed(client, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and content == ""
    assert streamed_calls == [(c.function.name, c.function.arguments) for c in calls]


def test_n_replies_each_call_on_their_own_whole_and_streamed(client):
    """n = 3 required calls: each choice is a call of its own draw (choice j is the request
    with seed 1 + j alone), finishing "tool_calls"; streamed, each choice's deltas (by the
    choice's index, then the call's) join to its whole reply."""
    def calls_of(message):
        return [(c.function.name, c.function.arguments) for c in message.tool_calls]

    reply = create(client, tools=TOOLS, tool_choice="required", n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "tool_calls" for c in reply.choices)
    whole = [calls_of(c.message) for c in reply.choices]
    for j, calls in enumerate(whole):
        check_calls(calls)
        assert calls == calls_of(create(client, tools=TOOLS, tool_choice="required",
                                        seed=1 + j).choices[0].message)
    joined, finishes = {}, {}
    for chunk in create(client, tools=TOOLS, tool_choice="required", n=3, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or []:
                got = joined.setdefault((choice.index, part.index), ["", ""])
                got[0] += part.function.name or ""
                got[1] += part.function.arguments or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert [[tuple(joined[j, k]) for k in range(len(whole[j]))] for j in range(3)] == whole


def test_a_named_function_is_the_one_called(client):
    for seed in range(3):
        reply = create(client, tools=TOOLS, seed=seed,
                       tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = reply.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        check_calls([(c.function.name, c.function.arguments) for c in calls])


def test_parallel_calls_come_only_where_allowed(client):
    counts = [len(create(client, tools=TOOLS, tool_choice="required", seed=seed,
                         temperature=1.5).choices[0].message.tool_calls) for seed in range(8)]
    assert max(counts) > 1, counts
    for seed in range(3):
        reply = create(client, tools=TOOLS, tool_choice="required", seed=seed, temperature=1.5,
                       parallel_tool_calls=False)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_tool_choice_none_leaves_the_tools_out(client, server):
    reply = create(client, tools=TOOLS, tool_choice="none", max_tokens=20)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content
    plain = call(server, "POST", "/tokenize", {"messages": ASK})[2]["count"]
    none = call(server, "POST", "/tokenize", {"messages": ASK, "tools": TOOLS,
                                              "tool_choice": "none"})[2]["count"]
    listed = call(server, "POST", "/tokenize", {"messages": ASK, "tools": TOOLS})[2]["count"]
    assert plain == none < listed


def test_auto_streams_the_same_reply_it_gives_whole(client):
    """Unconstrained: the reply is the model's text, held back only while it may begin a
    call; streamed and whole agree."""
    whole = create(client, tools=TOOLS, max_tokens=60)
    content, calls, finish = streamed(client, tools=TOOLS, max_tokens=60)
    assert (content or None, calls) == (whole.choices[0].message.content, [])
    assert finish == whole.choices[0].finish_reason


def test_earlier_calls_and_results_reach_the_prompt_without_tools(server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "minus four"}]
    ids = call(server, "POST", "/tokenize", {"messages": history})[2]["tokens"]
    prompt = call(server, "POST", "/detokenize", {"tokens": ids})[2]["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nminus four\n</tool_response>" in prompt
    status, _, body = call(server, "POST", "/v1/chat/completions",
                           {"messages": history, "max_tokens": 3})
    assert status == 200, body


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": [WEATHER, WEATHER]}, "tools[1]", "two tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "format": "duration"}}}}}],
      "tool_choice": "required"}, "tools", "format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0]", None)])
def test_bad_tool_requests_are_400s(server, body, param, words):
    status, _, got = call(server, "POST", "/v1/chat/completions",
                          {"messages": ASK, "max_tokens": 2, **body})
    assert status == 400 and got["error"]["param"] == param, got
    assert words is None or words in got["error"]["message"], got


@pytest.mark.parametrize("template, controls, fmt", [
    ("qwen2.5-7b-instruct", (), "hermes"),
    ("mistral-7b-instruct-v0.3", ("[TOOL_CALLS]",), "mistral"),
    ("llama-3.1-8b-instruct", ("<|python_tag|>",), "llama3")])
def test_each_family_s_format_round_trips(folder, template, controls, fmt):
    """The model's own template renders the tools; forced calls come back in its format and
    are read into OpenAI's tool_calls, whole and streamed (Mistral's marker a control token)."""
    model = long_tiny(folder, template, controls)
    server = start_server(model, num_blocks=2048, block_size=4, step_tokens=512)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        prompt = call(server, "POST", "/detokenize", {"tokens": call(
            server, "POST", "/tokenize", {"messages": ASK, "tools": TOOLS})[2]["tokens"]})
        assert "The weather in a city." in prompt[2]["prompt"]
        for seed in range(3):
            reply = create(client, model=model.name, tools=TOOLS, tool_choice="required",
                           seed=seed, temperature=1.5)
            calls = [(c.function.name, c.function.arguments)
                     for c in reply.choices[0].message.tool_calls]
            check_calls(calls)
            if fmt == "mistral":
                assert all(len(c.id) == 9 and c.id.isalnum()
                           for c in reply.choices[0].message.tool_calls)
            if fmt == "llama3":
                assert len(calls) == 1
            _, again, finish = streamed(client, model=model.name, tools=TOOLS,
                                        tool_choice="required", seed=seed, temperature=1.5)
            assert again == calls and finish == "tool_calls"
    finally:
        server.close(grace=0)


def test_chat_template_kwargs_reach_the_template(folder):
    """vLLM's chat_template_kwargs: Qwen3's template told enable_thinking false closes an
    empty think block in the prompt, in /tokenize and in a completion alike; a field that is
    no object, or that would set what the server sets, is a 400 naming it."""
    model = long_tiny(folder, "qwen3-0.6b")
    server = start_server(model, num_blocks=2048, block_size=4, step_tokens=512)
    try:
        def prompt(**extra):
            ids = call(server, "POST", "/tokenize", {"messages": ASK, **extra})[2]["tokens"]
            return ids, call(server, "POST", "/detokenize", {"tokens": ids})[2]["prompt"]
        thinking, text = prompt()
        quiet, quiet_text = prompt(chat_template_kwargs={"enable_thinking": False})
        assert quiet_text == text + "<think>\n\n</think>\n\n"
        assert prompt(chat_template_kwargs={"enable_thinking": True})[0] == thinking
        status, _, got = call(server, "POST", "/v1/chat/completions", {
            "messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and got["usage"]["prompt_tokens"] == len(quiet), got
        for bad in ([1], {"messages": []}, {"add_generation_prompt": False}, {"not a name": 1}):
            status, _, got = call(server, "POST", "/v1/chat/completions", {
                "messages": ASK, "max_tokens": 2, "chat_template_kwargs": bad})
            assert status == 400 and got["error"]["param"] == "chat_template_kwargs", got
    finally:
        server.close(grace=0)


def test_a_template_in_an_unread_format_refuses_tools(folder):
    model = long_tiny(folder, "c4ai-command-r-plus-tool-use")
    server = start_server(model, num_blocks=64)
    try:
        status, _, body = call(server, "POST", "/v1/chat/completions",
                               {"messages": ASK, "tools": TOOLS})
        assert status == 400 and body["error"]["param"] == "tools"
        assert "format poot does not read" in body["error"]["message"]
    finally:
        server.close(grace=0)


# ---- structured output ------------------------------------------------------------------------

class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=40_000_000)
    coastal: bool
    districts: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


def test_json_object_whole_and_streamed(client):
    for stream in (False, True):
        if stream:
            content = streamed(client, response_format={"type": "json_object"})[0]
        else:
            content = create(client, response_format={"type": "json_object"},
                             max_tokens=400).choices[0].message.content
        assert isinstance(json.loads(content), dict)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        reply = client.chat.completions.parse(model="tiny", messages=ASK, response_format=City,
                                              max_tokens=400, seed=seed)
        assert isinstance(reply.choices[0].message.parsed, City)


def test_a_json_schema_completion_validates(client):
    schema = {"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 2,
              "maxItems": 3}
    reply = client.completions.create(model="tiny", prompt="Dates:", max_tokens=300, seed=4,
                                      extra_body={"response_format": {
                                          "type": "json_schema",
                                          "json_schema": {"name": "dates", "schema": schema}}})
    jsonschema.validate(json.loads(reply.choices[0].text), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1},
     "minProperties"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "multipleOf": 5}, "multipleOf")])
def test_an_unsupported_keyword_is_a_400_naming_it(client, schema, keyword):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, response_format={"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": schema}})
    error = info.value.body
    assert error["param"] == "response_format" and f"'{keyword}'" in error["message"]


def test_a_constrained_request_beside_others_leaves_them_as_they_are(client):
    """Masks belong to their rows: a plain request's seeded reply is the same alone and beside
    constrained ones."""
    import threading
    alone = create(client, max_tokens=40, seed=9, temperature=1.0).choices[0].message.content
    got = {}

    short = {"type": "json_schema", "json_schema": {"name": "flag", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}         # a reply that ends within its tokens

    def constrained(i):
        got[i] = create(client, response_format=short, seed=i).choices[0]
    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    beside = create(client, max_tokens=40, seed=9, temperature=1.0).choices[0].message.content
    for t in threads:
        t.join()
    assert beside == alone
    assert all(isinstance(json.loads(c.message.content)["ok"], bool) for c in got.values())


def test_a_guided_regex_is_the_whole_output(client, server):
    pattern = r"[A-Z]{2}-[0-9]{3,4}( ok| no)?"
    for seed in range(3):
        text = client.completions.create(model="tiny", prompt="Code:", max_tokens=40, seed=seed,
                                         extra_body={"guided_regex": pattern}).choices[0].text
        assert re.fullmatch(pattern, text), text
    reply = create(client, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, reply.choices[0].message.content)
    status, _, body = call(server, "POST", "/v1/completions",
                           {"prompt": "x", "guided_regex": "(a)\\1"})
    assert status == 400 and body["error"]["param"] == "guided_regex"
    assert "backreference" in body["error"]["message"]


# ---- names ------------------------------------------------------------------------------------

def test_served_names_are_listed_and_each_may_be_asked_for(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny", "gpt-4o-mini"]
    reply = create(client, model="gpt-4o-mini", max_tokens=2)
    assert reply.model == "gpt-4o-mini"
    assert call(server, "GET", "/v1/models/gpt-4o-mini")[0] == 200
    with pytest.raises(openai.NotFoundError):
        create(client, model="tiny-long", max_tokens=2)


# ---- the default model, and LangChain ----------------------------------------------------------

@pytest.fixture(scope="module")
def smol_client():
    model = poot.load(default_model())
    server = start_server(model, num_blocks=512, block_size=16, step_tokens=512,
                          served_names=["smol"])
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.close(grace=0)


class Person(BaseModel):
    name: str
    age: int


def test_the_default_model_fills_a_schema_and_calls_a_tool(smol_client):
    reply = smol_client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}],
        response_format=Person, max_tokens=60, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Person)
    reply = smol_client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0)
    (got,) = reply.choices[0].message.tool_calls
    assert got.function.name == "get_weather"
    assert json.loads(got.function.arguments)["city"] == "Oslo"


def test_langchain_binds_tools_and_asks_for_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny",
                                      max_tokens=300, temperature=1.0, seed=4, max_retries=0)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"
    message = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("A city, please.")
        assert isinstance(city, City), method
