"""Tools and structured output of a request: checked, put in the prompt, constrained, read back.

`ToolUse.of(body, model)` reads `tools`, `tool_choice` and `parallel_tool_calls` and decides how
the model's chat template gets them (itself, or as text: poot.text.toolcalls) and in which
format the reply's calls are read. `constraint(body, model, tool_use)` is the TokenGrammar the
request's output must follow, if any: `response_format` json_object or json_schema, or the calls
`tool_choice` "required" or a named function forces (so they always parse), or vLLM's
`guided_regex` (the whole output matches it). Compiled grammars
are cached by their request's JSON (poot.grammar.compiled). `CallShaper` turns generated text
into OpenAI's `tool_calls`, whole or as stream deltas. Errors are openai.APIError (400s).
"""
import json
import re

from poot import grammar
from poot.serve.errors import invalid as _invalid
from poot.text import toolcalls

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def read_tools(body):
    """The request's function tools (OpenAI's shape, checked), or None."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _invalid("'functions' and 'function_call' are deprecated and not supported; "
                       "use 'tools' and 'tool_choice'", "functions")
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _invalid("'tools' must be an array of tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(f"{where} must be an object with \"type\": \"function\" (the only "
                           "tool type supported)", where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not TOOL_NAME.fullmatch(function["name"]):
            raise _invalid(f"{where}.function must be an object whose 'name' is 1 to 64 "
                           "letters, digits, '_' or '-'", f"{where}.function")
        if function["name"] in names:
            raise _invalid(f"{where}: two tools are named {function['name']!r}", where)
        names.add(function["name"])
        if function.get("description") is not None and not isinstance(
                function["description"], str):
            raise _invalid(f"{where}.function.description must be a string",
                           f"{where}.function.description")
        if function.get("parameters") is not None and not isinstance(
                function["parameters"], dict):
            raise _invalid(f"{where}.function.parameters must be a JSON Schema object",
                           f"{where}.function.parameters")
    return tools or None


def read_tool_choice(body, tools):
    """"none", "auto", "required" or the name of the function the reply must call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise _invalid(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise _invalid("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                       "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t["function"]["name"] for t in tools or []}:
        raise _invalid(f"'tool_choice' names the function {name!r}, which 'tools' lacks",
                       "tool_choice")
    return name


class ToolUse:
    """How a chat request's tools reach the model and its calls come back.

    `format` is None where the reply is not read for calls (no tools, or tool_choice "none");
    `in_text` says that the template renders no tools and poot writes them (and earlier calls
    and results) into the messages itself."""

    def __init__(self, tools, choice, parallel, fmt, in_text):
        self.tools, self.choice, self.parallel = tools, choice, parallel
        self.format, self.in_text = fmt, in_text

    @classmethod
    def of(cls, body, model):
        tools = read_tools(body)
        choice = read_tool_choice(body, tools)
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise _invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        template = model.chat_template
        if template is None:                # chat is refused for want of one (openai.py)
            return cls(None, "none", parallel, None, False)
        in_text = not template.renders_tools()
        fmt = None
        if choice != "none":
            fmt = toolcalls.IN_TEXT if in_text else toolcalls.recognise(template.source)
            if fmt is None:
                raise _invalid(
                    f"the chat template of '{model.name}' renders tools in a format poot does "
                    "not read (it reads Hermes <tool_call>, Mistral [TOOL_CALLS] and Llama 3 "
                    "JSON calls)", "tools")
        return cls(tools if choice != "none" else None, choice, parallel, fmt, in_text)

    @property
    def forced(self):
        return self.choice not in ("none", "auto")

    def messages(self, messages):
        """(messages, tools) as the template is given them."""
        if self.in_text:
            return toolcalls.in_text(messages, self.tools), None
        return messages, self.tools

    def keeps_special_tokens(self, tokenizer):
        """Whether the reply's text must keep control tokens (the format's markers are some)."""
        if self.format is None:
            return False
        for marker in (self.format.marker, "[ARGS]"):
            token = tokenizer.token_to_id(marker)
            if token is not None and token in tokenizer.special_ids:
                return True
        return False

    def grammar(self, tokenizer):
        """The TokenGrammar of the forced calls."""
        forced = None if self.choice == "required" else self.choice
        fmt = self.format
        key = ("tools", fmt.name, getattr(fmt, "by_name", None), getattr(fmt, "space", None),
               json.dumps(self.tools, sort_keys=True), forced, self.parallel)
        try:
            return grammar.compiled(key, lambda: fmt.grammar(self.tools, forced, self.parallel,
                                                             tokenizer), tokenizer)
        except grammar.GrammarError as exc:
            raise _invalid(f"tools: {exc}", "tools") from None


def constraint(body, model, tool_use=None):
    """The TokenGrammar a request's output follows (response_format, vLLM's guided_regex, or
    forced tool calls), or None."""
    regex = body.get("guided_regex")
    if regex is not None:
        if not isinstance(regex, str):
            raise _invalid("'guided_regex' must be a string", "guided_regex")
        if body.get("response_format") is not None or (tool_use and tool_use.format):
            raise _invalid("'guided_regex' together with 'response_format' or 'tools' is not "
                           "supported", "guided_regex")
        try:
            return grammar.compiled(("regex", regex), lambda: grammar.regex_grammar(regex),
                                    model.tokenizer)
        except (grammar.GrammarError, grammar.RegexUnsupported) as exc:
            raise _invalid(f"guided_regex: {exc}", "guided_regex") from None
    response_format = body.get("response_format")
    kind = None
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
                "text", "json_object", "json_schema"):
            raise _invalid("'response_format' must be {\"type\": \"text\"}, {\"type\": "
                           "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                           "{...}}", "response_format")
        kind = response_format["type"]
    forced = tool_use is not None and tool_use.forced
    if kind in ("json_object", "json_schema") and tool_use is not None \
            and tool_use.format is not None:
        raise _invalid("'response_format' together with 'tools' is not supported; send "
                       "tool_choice \"none\" or no response_format", "response_format")
    if forced:
        return tool_use.grammar(model.tokenizer)
    if kind == "json_object":
        return grammar.compiled(("json_object",), grammar.json_object_grammar, model.tokenizer)
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise _invalid("'response_format.json_schema' must be an object with a 'schema'",
                       "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid("'response_format.json_schema.strict' must be a boolean",
                       "response_format")
    schema = spec["schema"]
    key = ("json_schema", json.dumps(schema, sort_keys=True))
    try:
        return grammar.compiled(key, lambda: grammar.schema_grammar(schema), model.tokenizer)
    except grammar.GrammarError as exc:
        raise _invalid(f"response_format.json_schema.schema: {exc}", "response_format") \
            from None


class CallShaper:
    """A reply's text as OpenAI's message or stream deltas, its tool calls read out."""

    def __init__(self, tool_use):
        self.format, self.parallel = tool_use.format, tool_use.parallel
        self.reader = toolcalls.CallReader(self.format)
        self.count = 0          # calls given out

    def _shaped(self, calls):
        if not self.parallel:
            calls = calls[:max(0, 1 - self.count)]
        out = []
        for call in calls:
            out.append({"index": self.count, "id": self.format.new_id(), "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
            self.count += 1
        return out

    def message(self, generated):
        """(the assistant message, whether it calls tools) of a whole reply."""
        content, calls = toolcalls.read_all(self.format, generated)
        shaped = self._shaped(calls)
        for call in shaped:
            del call["index"]
        if not shaped:
            return {"role": "assistant", "content": generated}, False
        return {"role": "assistant", "content": content, "tool_calls": shaped}, True

    def push(self, piece, final):
        """(content, tool call deltas) of a stream's next text."""
        content, calls = self.reader.push(piece)
        if final:
            rest, more = self.reader.finish()
            content, calls = content + rest, calls + more
        return content, self._shaped(calls)
