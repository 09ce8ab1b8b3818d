"""Tool calls in the formats models are trained on: which one a chat template speaks, the
grammar a forced call follows, and the calls read back out of generated text.

A template that renders tools (a probe conversation with a tool, a call and a result shows all
three in the prompt: ChatTemplate.renders_tools) speaks the first format its source names:
- `mistral`, where it writes "[TOOL_CALLS]" (Mistral 7B v0.3, Nemo, Small): the control token
  [TOOL_CALLS], then a JSON array of {"name", "arguments"} objects; where it also writes
  "[ARGS]", [TOOL_CALLS]name[ARGS]{arguments} for each call instead.
- `hermes`, where it writes "<tool_call>" (Qwen2.5, Qwen3, Hermes): for each call
  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>.
- `llama3`, where it writes "<|start_header_id|>" and '"parameters"' (Llama 3.1 to 3.3): the
  reply is {"name": ..., "parameters": {...}}, after <|python_tag|> or not; one call a turn,
  as those templates render no more.
A template that renders tools in another format (functionary, firefunction, Command R) is not
supported. A template that renders no tools at all gets them from poot, in the hermes format:
`in_text` writes the tools into the system message and earlier calls and results as hermes
text, so the conversation reaches the model whatever its template.

Reading is incremental (`CallReader`): text before the format's start is content, text after it
becomes calls as each completes; where it does not parse, it is content after all.
"""
import json
import secrets
import string
from dataclasses import dataclass

from poot.grammar.expr import Grammar, Repeat, Token, alt, seq, text
from poot.grammar.schema import SchemaCompiler
from poot.text.tokenizer import CONTROL

_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    name: str
    arguments: str      # JSON text, as OpenAI's tool_calls carry it


def _call_of(obj, arguments_keys=("arguments",)):
    """A ToolCall from a parsed {"name": ..., "arguments": {...}} (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            break
    else:
        args = {}
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_at(s, at):
    """(value, end) of the JSON value starting at s[at] (leading whitespace skipped), or None."""
    try:
        return json.JSONDecoder().raw_decode(s, _skip_space(s, at))
    except ValueError:
        return None


def _skip_space(s, at):
    while at < len(s) and s[at] in " \t\r\n":
        at += 1
    return at


def _marker(name, tokenizer):
    """The special token `name` where the vocabulary has it as a control token, else its
    text."""
    token = tokenizer.token_to_id(name) if tokenizer is not None else None
    if token is not None and tokenizer.token_types[token] == CONTROL:
        return Token(name)
    return text(name)


class ToolFormat:
    """A model family's way of writing tool calls."""
    name = ""
    marker = ""             # the text the calls begin with
    parallel = True         # more than one call a turn

    def start(self, s, sent):
        """Where the calls begin in s (looking from `sent` on): (index or None, how many of the
        last characters to hold back as maybe its beginning, whether s can hold none)."""
        at = s.find(self.marker, sent)
        if at >= 0:
            return at, 0, False
        hold = 0
        for k in range(min(len(self.marker) - 1, len(s) - sent), 0, -1):
            if self.marker.startswith(s[len(s) - k:]):
                hold = k
                break
        tail = s[sent:len(s) - hold]
        return None, hold + len(tail) - len(tail.rstrip()), False

    def read(self, s, final):
        """(calls read from the beginning of s, how much of s they took); incomplete ones only
        where `final` (each format's own reader: the subclasses)."""
        raise NotImplementedError

    def new_id(self):
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))

    def grammar(self, tools, forced, parallel, tokenizer):
        """The Grammar of replies that call `forced` (a tool name) or, if None, any of `tools`
        (OpenAI function tools), each with arguments valid under its parameters' schema."""
        rules, called, calls = {}, set(), []
        for tool in tools:
            function = tool["function"]
            if forced is not None and function["name"] != forced:
                continue
            compiler = SchemaCompiler(function.get("parameters") or {"type": "object"},
                                      prefix=f"tool {function['name']} ")
            rules.update(compiler.rules)
            called |= compiler.called
            calls.append(self.call(function["name"], compiler.expr, tokenizer))
        root = self.calls(alt(*calls), parallel and self.parallel, tokenizer)
        return Grammar(dict(rules, **{"tool calls": root}), "tool calls", frozenset(called))

    def call(self, name, arguments, tokenizer):
        """The Expr of one call of tool `name` whose arguments are `arguments` (each format
        spells it its own way: the subclasses)."""
        raise NotImplementedError

    def calls(self, call, parallel, tokenizer):
        """The Expr of a reply of one `call`, or of several where `parallel` (each format's
        own: the subclasses)."""
        raise NotImplementedError


class Hermes(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def read(self, s, final):
        calls, used = [], 0
        while True:
            at = _skip_space(s, used)
            if not s.startswith(self.marker, at):
                break
            close = s.find(self.end, at)
            body = s[at + len(self.marker):close if close >= 0 else len(s)]
            if close < 0 and not final:
                break
            got = _json_at(body, 0)
            call = got and _call_of(got[0])
            if call is None or body[got[1]:].strip():
                break
            calls.append(call)
            used = len(s) if close < 0 else close + len(self.end)
        return calls, used

    def call(self, name, arguments, tokenizer):
        return seq(_marker(self.marker, tokenizer),
                   text('\n{"name": ' + json.dumps(name, ensure_ascii=False)
                        + ', "arguments": '), arguments, text("}\n"),
                   _marker(self.end, tokenizer))

    def calls(self, call, parallel, tokenizer):
        return seq(call, Repeat(seq(text("\n"), call), 0, None)) if parallel else call


class Mistral(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def __init__(self, source=""):
        self.by_name = "[ARGS]" in source           # [TOOL_CALLS]name[ARGS]{...}
        self.space = "[TOOL_CALLS] [" in source     # v0.3 puts a space before the array

    def read(self, s, final):
        if not final or not s.startswith(self.marker):
            return [], 0
        calls, at = [], len(self.marker)
        if not s[at:].lstrip().startswith("["):
            return self._read_by_name(s)
        got = _json_at(s, at)
        if got is None or not isinstance(got[0], list):
            return [], 0
        for obj in got[0]:
            call = _call_of(obj)
            if call is None:
                return [], 0
            calls.append(call)
        return calls, got[1]

    def _read_by_name(self, s):
        calls, used = [], 0
        while s.startswith(self.marker, used):
            args = s.find("[ARGS]", used)
            name = s[used + len(self.marker):args].strip() if args >= 0 else ""
            got = _json_at(s, args + len("[ARGS]")) if name else None
            if got is None or not isinstance(got[0], dict):
                break
            calls.append(ToolCall(name, json.dumps(got[0], ensure_ascii=False)))
            used = _skip_space(s, got[1])
        return calls, used

    def new_id(self):
        # Mistral's templates refuse ids that are not 9 letters and digits
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def call(self, name, arguments, tokenizer):
        if self.by_name:
            return seq(_marker(self.marker, tokenizer), text(name),
                       _marker("[ARGS]", tokenizer), arguments)
        return seq(text('{"name": ' + json.dumps(name, ensure_ascii=False)
                        + ', "arguments": '), arguments, text("}"))

    def calls(self, call, parallel, tokenizer):
        if self.by_name:
            return Repeat(call, 1, None if parallel else 1)
        more = Repeat(seq(text(", "), call), 0, None if parallel else 0)
        return seq(_marker(self.marker, tokenizer), text(" [" if self.space else "["), call,
                   more, text("]"))


class Llama3(ToolFormat):
    name = "llama3"
    marker = "<|python_tag|>"
    parallel = False

    def start(self, s, sent):
        """The calls are the whole reply: it begins (after space) with "{" or the python tag."""
        head = s.lstrip()
        if not head:
            return None, len(s) - sent, False
        if head.startswith(("{", self.marker)):
            return len(s) - len(head), 0, False
        if self.marker.startswith(head):
            return None, len(s) - sent, False
        return None, 0, True

    def read(self, s, final):
        if not final:
            return [], 0
        at = _skip_space(s, 0)
        if s.startswith(self.marker, at):
            at += len(self.marker)
        calls = []
        while True:
            got = _json_at(s, at)
            call = got and _call_of(got[0], ("parameters", "arguments"))
            if call is None:
                return calls, at
            calls.append(call)
            at = _skip_space(s, got[1])
            if not s.startswith(";", at):
                return calls, at
            at += 1

    def call(self, name, arguments, tokenizer):
        return seq(text('{"name": ' + json.dumps(name, ensure_ascii=False)
                        + ', "parameters": '), arguments, text("}"))

    def calls(self, call, parallel, tokenizer):
        return call


def recognise(source):
    """The ToolFormat a chat template's source writes, or None."""
    if "[TOOL_CALLS]" in source:
        return Mistral(source)
    if "<tool_call>" in source:
        return Hermes()
    if "<|start_header_id|>" in source and '"parameters"' in source:
        return Llama3()
    return None


class CallReader:
    """Generated text in, content and calls out, as the text comes."""

    def __init__(self, fmt):
        self.format = fmt
        self.text = ""
        self.sent = 0           # characters given out as content
        self.begin = None       # where the calls begin
        self.read = 0           # characters the calls read took
        self.plain = False      # no calls can come: everything is content
        self.calls = 0          # calls given out

    def push(self, piece):
        """(content now final, calls now complete)."""
        self.text += piece
        if self.plain:
            return self._content(len(self.text)), []
        if self.begin is None:
            at, hold, plain = self.format.start(self.text, self.sent)
            if plain:
                self.plain = True
                return self._content(len(self.text)), []
            if at is None:
                return self._content(len(self.text) - hold), []
            content = self.text[self.sent:at].rstrip()     # space before the calls waits
            self.sent += len(content)
            self.begin = self.read = at
            return content, self._calls(final=False)
        return "", self._calls(final=False)

    def finish(self):
        """What is left at the end: (content, calls)."""
        if self.begin is None or self.plain:
            return self._content(len(self.text)), []
        calls = self._calls(final=True)
        if not self.calls:              # nothing parsed: the would-be calls are content
            return self._content(len(self.text)), []
        rest = self.text[self.read:]
        return (rest if rest.strip() else ""), calls

    def _content(self, upto):
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def _calls(self, final):
        calls, used = self.format.read(self.text[self.read:], final)
        self.read += used
        self.calls += len(calls)
        return calls


def read_all(fmt, generated):
    """(content or None, [ToolCall]) of a whole reply."""
    reader = CallReader(fmt)
    content, calls = reader.push(generated)
    rest, more = reader.finish()
    content = (content + rest).strip() if calls or more else content + rest
    return content or None, calls + more


# ---- a template that renders no tools ----------------------------------------------------------

IN_TEXT = Hermes()


def in_text(messages, tools):
    """The conversation with the tools written into its system message and earlier calls and
    results as hermes text (IN_TEXT), for a template that renders none of them."""
    out = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            written = [f"<tool_call>\n{json.dumps(_written_call(c), ensure_ascii=False)}\n"
                       "</tool_call>" for c in message["tool_calls"]]
            content = "\n".join(([message["content"]] if message.get("content") else [])
                                + written)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("from_tools"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "from_tools": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls",
                                                                      "tool_call_id")})
    for message in out:
        message.pop("from_tools", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = ("You can call functions. Their signatures are given in JSON within "
                  f"<tools></tools>:\n<tools>\n{listing}\n</tools>\n\nTo call a function, "
                  "reply with a JSON object holding its name and arguments within "
                  "<tool_call></tool_call>, one block per call:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _written_call(call):
    function = call.get("function", call)
    return {"name": function.get("name"), "arguments": function.get("arguments")}
