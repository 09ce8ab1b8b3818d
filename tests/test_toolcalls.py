"""Tool calls in the model families' own formats (poot.text.toolcalls): which format each real
chat template speaks, replies written as the families' documentation shows them read into
calls (whole and as a stream, cut anywhere), forced calls' grammars that always read back, and
conversations with tools and earlier calls rendered by the real templates."""
import json
import pathlib
import random

import numpy as np
import pytest

import poot
from poot.grammar import Automaton, TokenGrammar, Vocabulary
from poot.grammar.tokens import unpack
from poot.text.chat import ChatTemplate
from poot.text.tokenizer import CONTROL
from poot.text.toolcalls import (IN_TEXT, CallReader, Hermes, Llama3, Mistral, in_text,
                                 read_all, recognise)
from tests.models import tiny_model

jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = pathlib.Path(__file__).parent / "data/chat_templates"
# bos and eos, as test_chat.py has them
SPECIAL = {"qwen2.5-7b-instruct": ("", "<|im_end|>"), "qwen3-8b-gguf": ("", "<|im_end|>"),
           "llama-3.1-8b-instruct": ("<|begin_of_text|>", "<|eot_id|>"),
           "mistral-7b-instruct-v0.3": ("<s>", "</s>"),
           "mistral-nemo-instruct-2407": ("<s>", "</s>"),
           "smollm2-135m-instruct": ("<|im_start|>", "<|im_end|>")}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}


def template(name):
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"),
                        *SPECIAL.get(name, ("<s>", "</s>")))


@pytest.mark.parametrize("name, renders, fmt", [
    ("qwen2.5-7b-instruct", True, "hermes"), ("qwen3-0.6b", True, "hermes"),
    ("qwen3-8b-gguf", True, "hermes"), ("llama-3.1-8b-instruct", True, "llama3"),
    ("llama-3.2-3b-instruct", True, "llama3"), ("mistral-7b-instruct-v0.3", True, "mistral"),
    ("mistral-nemo-instruct-2407", True, "mistral"),
    ("c4ai-command-r-plus-tool-use", True, None),
    ("smollm2-135m-instruct", False, None), ("chatml", False, None),
    ("llama-3-instruct", False, None), ("gemma-3-it", False, None)])
def test_a_template_s_format_is_recognised_from_its_source(name, renders, fmt):
    t = template(name)
    assert t.renders_tools() == renders
    got = recognise(t.source)
    assert (got and got.name) == fmt


# ---- replies as the families write them --------------------------------------------------------

CALL_A = ("get_current_temperature", {"location": "San Francisco, CA, USA"})
CALL_B = ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})


def hermes_call(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


TRANSCRIPTS = [
    # (format, reply, content, [(name, arguments)])
    (Hermes(), hermes_call(*CALL_A), None, [CALL_A]),
    (Hermes(), hermes_call(*CALL_A) + "\n" + hermes_call(*CALL_B), None, [CALL_A, CALL_B]),
    (Hermes(), "<think>\nThe user wants the weather.\n</think>\n\n" + hermes_call(*CALL_A),
     "<think>\nThe user wants the weather.\n</think>", [CALL_A]),
    (Hermes(), "Let me check.\n" + hermes_call(*CALL_B), "Let me check.", [CALL_B]),
    (Hermes(), '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', None,
     [("f", {"x": 1})]),
    (Hermes(), '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),
    (Hermes(), "It is sunny in Paris.", "It is sunny in Paris.", []),
    (Hermes(), '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>', []),
    (Hermes(), '<tool_call>\n{"name": "f", "argum', '<tool_call>\n{"name": "f", "argum', []),
    (Mistral('"[TOOL_CALLS] ["'), '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": '
     '{"location": "Paris, France", "format": "celsius"}}]', None,
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    (Mistral(), '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
     '{"n": 2}}]', None, [("a", {}), ("b", {"n": 2})]),
    (Mistral("[ARGS]"), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[ARGS]{}', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (Mistral(), "Bonjour !", "Bonjour !", []),
    (Mistral(), '[TOOL_CALLS] [{"name": "a"', '[TOOL_CALLS] [{"name": "a"', []),
    (Llama3(), '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, '
     'CA", "unit": "Fahrenheit"}}', None,
     [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    (Llama3(), '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}', None, [("f", {"q": "x"})]),
    (Llama3(), '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 1}}', None,
     [("f", {}), ("g", {"a": 1})]),
    (Llama3(), "The answer is 4.", "The answer is 4.", []),
    (Llama3(), '{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("fmt, reply, content, calls", TRANSCRIPTS,
                         ids=[f"{t[0].name}-{i}" for i, t in enumerate(TRANSCRIPTS)])
def test_replies_are_read_into_content_and_calls(fmt, reply, content, calls):
    got_content, got = read_all(fmt, reply)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("fmt, reply, content, calls", TRANSCRIPTS,
                         ids=[f"{t[0].name}-{i}" for i, t in enumerate(TRANSCRIPTS)])
def test_a_stream_cut_anywhere_reads_as_the_whole_reply(fmt, reply, content, calls):
    """Pieces of every length: the content given out adds up to the whole reply's (space
    before the calls aside), the calls are the same, and no call comes before it is complete."""
    rng = random.Random(reply)
    for _ in range(20):
        reader, text, got, at = CallReader(fmt), "", [], 0
        while at < len(reply):
            n = rng.randint(1, 6)
            piece_content, piece_calls = reader.push(reply[at:at + n])
            at += n
            text += piece_content
            got += piece_calls
        rest, last = reader.finish()
        text += rest
        got += last
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
        assert (text.strip() or None) == content


def test_hermes_calls_come_out_of_a_stream_as_each_closes():
    reader = CallReader(Hermes())
    assert reader.push("Checking.\n" + hermes_call(*CALL_A)[:-3]) == ("Checking.", [])
    content, calls = reader.push(hermes_call(*CALL_A)[-3:] + "\n")
    assert content == "" and [c.name for c in calls] == [CALL_A[0]]


# ---- forced calls: their grammar always reads back ---------------------------------------------

class WithControls:
    """The tiny byte-level vocabulary with the markers of tool formats as control tokens."""
    CONTROLS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]

    def __init__(self, tokenizer):
        self.base = tokenizer
        self.tokens = list(tokenizer.tokens) + self.CONTROLS
        self.token_types = list(tokenizer.token_types) + [CONTROL] * len(self.CONTROLS)
        self.vocab_size = len(self.tokens)
        self.eos_ids = tokenizer.eos_ids
        self.special_ids = {i for i, t in enumerate(self.token_types) if t == CONTROL}

    def token_bytes(self, i):
        return self.tokens[i].encode() if i >= self.base.vocab_size else \
            self.base.token_bytes(i)

    def token_to_id(self, text):
        return self.tokens.index(text) if text in self.CONTROLS else self.base.token_to_id(text)

    def decode(self, ids):
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return WithControls(poot.load(tiny_model(tmp_path_factory.mktemp("tiny"))).tokenizer)


@pytest.mark.parametrize("fmt", [Hermes(), Mistral('"[TOOL_CALLS] ["'), Mistral("[ARGS]"),
                                 Llama3()], ids=["hermes", "mistral", "mistral-args", "llama3"])
@pytest.mark.parametrize("forced, parallel", [(None, True), ("get_weather", False)])
def test_forced_calls_always_read_back_as_valid_calls(vocab, fmt, forced, parallel):
    grammar = TokenGrammar(Automaton(fmt.grammar([WEATHER, TIME], forced, parallel, vocab)),
                           Vocabulary.of(vocab))
    validators = {t["function"]["name"]: jsonschema.Draft202012Validator(
        t["function"].get("parameters", {"type": "object"})) for t in (WEATHER, TIME)}
    rng = np.random.default_rng(3)
    structure = np.array([4.0 * bool(set(b'"}]') & set(vocab.token_bytes(t)))
                          * (t not in vocab.special_ids) for t in range(vocab.vocab_size)])
    counts = set()
    for _ in range(25):
        matcher, out = grammar.start(), []
        for _ in range(300):
            allowed = unpack(matcher.allowed(), vocab.vocab_size)
            logits = rng.standard_normal(vocab.vocab_size) * 2 + structure
            logits[list(vocab.eos_ids)] += 3
            logits[~allowed] = -np.inf
            token = int(np.argmax(logits))
            matcher.advance(token)
            if token in vocab.eos_ids:
                break
            out.append(token)
        assert matcher.ended
        content, calls = read_all(fmt, vocab.decode(out))
        assert content is None and calls, vocab.decode(out)
        for call in calls:
            assert forced in (None, call.name)
            validators[call.name].validate(json.loads(call.arguments))
        counts.add(len(calls))
    assert (max(counts) > 1) == (parallel and fmt.parallel), counts


def test_a_control_token_marker_is_the_token_not_its_text(vocab):
    grammar = TokenGrammar(Automaton(Mistral().grammar([WEATHER], None, True, vocab)),
                           Vocabulary.of(vocab))
    allowed = np.flatnonzero(unpack(grammar.start().allowed(), vocab.vocab_size))
    assert allowed.tolist() == [vocab.token_to_id("[TOOL_CALLS]")]


# ---- conversations with tools, rendered -------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "minus four"},
]


@pytest.mark.parametrize("name", ["qwen2.5-7b-instruct", "llama-3.1-8b-instruct",
                                  "mistral-7b-instruct-v0.3", "smollm2-135m-instruct"])
def test_tools_and_earlier_calls_reach_the_prompt(name):
    t = template(name)
    if t.renders_tools():
        prompt = t.render(HISTORY, tools=[WEATHER])
        fmt = recognise(t.source)
    else:
        prompt = t.render(in_text(HISTORY, [WEATHER]))
        fmt = IN_TEXT
    for word in ("get_weather", "The weather in a city.", '"Oslo"', "minus four"):
        assert word in prompt, (name, word)
    assert fmt.marker in prompt or name.startswith("llama")


def test_in_text_writes_calls_and_results_as_hermes_text():
    messages = in_text(HISTORY + [{"role": "tool", "tool_call_id": "x", "content": "sunny"}],
                       [WEATHER])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in messages[2]["content"]
    assert messages[3]["content"] == ("<tool_response>\nminus four\n</tool_response>\n"
                                      "<tool_response>\nsunny\n</tool_response>")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert read_all(IN_TEXT, messages[2]["content"])[1][0].name == "get_weather"
