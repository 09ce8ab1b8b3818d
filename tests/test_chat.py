"""Real chat templates (tests/data/chat_templates, from the models' own files) rendered by poot and
by Jinja2 set up as Hugging Face's apply_chat_template sets it up: for every template, many
conversations (with and without system, multi-turn, assistant last, tools, tool calls, thinking,
odd text) must give byte-identical prompts, and where a template refuses a conversation with
raise_exception both must refuse it with the template's message."""

import itertools
import pathlib
import time

import pytest

from poot.errors import TemplateError
from poot.text.chat import ChatTemplate

jinja2 = pytest.importorskip("jinja2")
pytestmark = pytest.mark.usefixtures("fixed_clock")
TEMPLATES = pathlib.Path(__file__).parent / "data/chat_templates"

# bos and eos as each model's tokenizer has them
SPECIAL = {
    "c4ai-command-r-plus-tool-use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "chatml": ("<s>", "</s>"),
    "deepseek-r1-distill-qwen-32b": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "functionary-medium-v3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma-2-it": ("<bos>", "<eos>"),
    "gemma-3-it": ("<bos>", "<eos>"),
    "llama-2-chat": ("<s>", "</s>"),
    "llama-3-firefunction-v2": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.1-8b-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2-3b-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral-7b-instruct-v0.1": ("<s>", "</s>"),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>"),
    "mistral-nemo-instruct-2407": ("<s>", "</s>"),
    "mixtral-8x7b-instruct-v0.1": ("<s>", "</s>"),
    "phi-3-mini-4k-instruct": ("<s>", "<|endoftext|>"),
    "phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "qwen2.5-7b-instruct": ("", "<|im_end|>"),
    "qwen3-0.6b": ("", "<|im_end|>"),
    "qwen3-4b-thinking-2507": ("", "<|im_end|>"),
    "qwen3-8b-gguf": ("", "<|im_end|>"),
    "smollm2-135m-instruct": ("<|im_start|>", "<|im_end|>"),
    "zephyr-7b-beta": ("<s>", "</s>"),
}

ODD = ("  Line one\n\nline two\twith tab  \n {{ not a template }} {% if %} {# #} "
       "'single' \"double\" \\back\\slash \u00e9\u00e8 \u4e2d\u6587 \U0001F600 <|im_end|> [INST]  ")


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def sys(text):
    return {"role": "system", "content": text}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, «now».",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
        "days": {"type": ["integer", "string"], "description": "Forecast days"},
        "hours": {"type": "array", "items": {"type": "integer"}, "description": "Hours"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time & date, <local>",
                                         "parameters": {"type": "object", "properties": {}}}}


def tool_call(arguments, call_id="call12345"):
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


CONVERSATIONS = {
    "one user turn": [u("Hello!")],
    "system and user": [sys("You are terse."), u("Hi")],
    "multi-turn": [u("Hi"), a("Hello! How can I help?"), u("What's 2+2?")],
    "system multi-turn": [sys("Be kind."), u("Hi"), a("Hey."), u("Who are you?"), a("   I am an assistant   "),
                          u("Another question")],
    "assistant last": [sys("S"), u("Q"), a("A")],
    "assistant last, no system": [u("Q"), a("A")],
    "odd text": [sys(ODD), u(ODD), a(ODD), u(ODD.strip())],
    "empty strings": [sys(""), u(""), a(""), u("")],
    "thinking": [u("Think first."), a("<think>\nStep 1, step 2.\n</think>\n\nThe answer is 4."), u("And 3+3?")],
    "thinking, assistant last": [u("Q"), a("<think>reasoning</think>answer")],
    "reasoning field": [u("Q"), {"role": "assistant", "content": "answer", "reasoning_content": "because"},
                        u("Q2")],
    "roles do not alternate": [u("one"), u("two")],
    "assistant first": [a("I speak first"), u("ok")],
    "system in the middle": [u("Hi"), sys("New instructions"), u("Again")],
    "content parts": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe it. "}]}],
    "tool call and result": [
        sys("Use tools."), u("Weather in Paris?"),
        {"role": "assistant", "content": "", "tool_calls": [tool_call({"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temperature": 21}'},
        a("It is 21 °C in Paris.")],
    "tool call with string arguments, null content": [
        u("Weather in Rome?"),
        {"role": "assistant", "content": None, "tool_calls": [tool_call('{"city": "Rome"}', "abcDEF123")]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}],
    "two tool results": [
        u("Both?"),
        {"role": "assistant", "content": "Checking.", "tool_calls": [tool_call({"city": "A"}, "aaaaaaaaa"),
                                                                      tool_call({"city": "B"}, "bbbbbbbbb")]},
        {"role": "tool", "tool_call_id": "aaaaaaaaa", "content": "rain"},
        {"role": "tool", "tool_call_id": "bbbbbbbbb", "content": "snow"}],
    "twenty messages": [sys("You are a helpful assistant.")] + [
        (u if i % 2 == 0 else a)(f"Message {i}: {'some words ' * (i % 5)}with a {{brace}} and \"quotes\".")
        for i in range(19)],
}

# Variables a template needs beyond Hugging Face's own (firefunction's caller passes these)
NEEDS = {"llama-3-firefunction-v2": {"functions": '[{"name": "get_weather"}]', "datetime": "2024-07-26"}}

EXTRAS = [{}, {"enable_thinking": False}, {"enable_thinking": True},
          {"date_string": "01 Jan 2025", "tools_in_user_message": False},
          {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}]


def hf_render(compiled, messages, add_generation_prompt, tools, bos, eos, extra):
    """transformers' apply_chat_template(tokenize=False) on Jinja2 (the oracle): the text, or the exception."""
    try:
        return compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos, **extra)
    except Exception as e:  # noqa: BLE001 (any failure of the oracle is a result to compare)
        return e


def template_names():
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def test_fixtures_are_the_templates_listed():
    assert template_names() == sorted(SPECIAL)
    assert len(SPECIAL) >= 10


@pytest.mark.parametrize("name", template_names())
def test_real_template_renders_byte_identical(hf_jinja, name):
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    compiled = hf_jinja.from_string(source)
    bos, eos = SPECIAL[name]
    template = ChatTemplate(source, bos_token=bos, eos_token=eos)
    compared = refused = 0
    for (title, messages), agp, tools, extra in itertools.product(
            CONVERSATIONS.items(), (True, False), (None, [WEATHER, TIME]), EXTRAS):
        extra = {**NEEDS.get(name, {}), **extra}
        expected = hf_render(compiled, messages, agp, tools, bos, eos, extra)
        case = f"{name}: {title}, add_generation_prompt={agp}, tools={bool(tools)}, {extra}"
        if type(expected) is jinja2.TemplateError:
            with pytest.raises(TemplateError) as info:  # raise_exception: the template's own message
                template.render(messages, add_generation_prompt=agp, tools=tools, **extra)
            assert str(info.value) == str(expected), case
            refused += 1
        elif isinstance(expected, Exception):
            with pytest.raises(TemplateError):
                template.render(messages, add_generation_prompt=agp, tools=tools, **extra)
        else:
            assert template.render(messages, add_generation_prompt=agp, tools=tools, **extra) == expected, case
            compared += 1
    print(f"{name}: {compared} renders byte-identical, {refused} refused alike")
    assert compared >= 100


def test_known_prompts():
    """A few prompts written out, so that a bug shared with the oracle would still show."""
    def render(name, messages, **kw):
        bos, eos = SPECIAL[name]
        return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), bos, eos).render(messages, **kw)

    assert render("smollm2-135m-instruct", [u("Hi")]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render("llama-3.1-8b-instruct", [sys("S"), u("Hi")]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render("llama-2-chat", [sys("S"), u("Hi"), a("Yo"), u("Q")]) == (
        "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST] Yo </s><s>[INST] Q [/INST]")
    assert render("qwen3-0.6b", [u("Hi")], enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render("gemma-3-it", [sys("S"), u("Hi")]) == (
        "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n")


def test_raise_exception_becomes_a_template_error_with_its_message():
    source = (TEMPLATES / "mistral-7b-instruct-v0.1.jinja").read_text(encoding="utf-8")
    with pytest.raises(TemplateError, match="^Conversation roles must alternate user/assistant/user/assistant/...$"):
        ChatTemplate(source, "<s>", "</s>").render([u("one"), u("two")])


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be a list of objects, not a string"),
    ([], "messages must not be empty"),
    (["hi"], r"messages\[0\] must be an object with 'role' and 'content', not a string"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([u("hi"), {"role": 7, "content": "x"}], r"messages\[1\].role must be a string, not a number"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": None}], r"messages\[0\].content must be a string or a list of content parts, not null"),
    ([{"role": "user", "content": {"text": "x"}}], r"messages\[0\].content must be .* not an object"),
    ([{"role": "user", "content": ["x"]}], r"messages\[0\].content\[0\] must be an object with a string 'type'"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"messages\[0\].content\[0\] is a text part"),
])
def test_malformed_messages_are_refused_before_rendering(messages, message):
    template = ChatTemplate("{{ messages }}")
    with pytest.raises(TemplateError, match=message):
        template.render(messages)


def test_parse_errors_name_line_and_column():
    with pytest.raises(TemplateError, match="line 2, column 13"):
        ChatTemplate("{% for m in messages %}\n{{ m.role + }}{% endfor %}")


def test_variables_as_hugging_face_passes_them():
    t = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ tools is defined }}{{ tools is none }}|"
                     "{{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}", "<s>", "</s>")
    assert t.render([u("x")]) == "<s>|</s>|TrueTrue|True|True|"
    assert t.render([u("x")], add_generation_prompt=False, tools=[WEATHER], enable_thinking=False) == \
        "<s>|</s>|TrueFalse|True|False|False"


def test_rendering_a_twenty_message_conversation_with_llama_3_1_is_fast():
    source = (TEMPLATES / "llama-3.1-8b-instruct.jinja").read_text(encoding="utf-8")
    template = ChatTemplate(source, *SPECIAL["llama-3.1-8b-instruct"])
    messages = CONVERSATIONS["twenty messages"]
    assert len(messages) == 20
    best = min(_timed(template.render, messages) for _ in range(20))
    assert best < 0.005, f"{best * 1e3:.2f} ms"


def _timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start
