"""A model's chat template: messages in, the prompt text out, as Hugging Face's apply_chat_template.

The template is the model's own Jinja source (GGUF `tokenizer.chat_template`, `chat_template` in
tokenizer_config.json, or chat_template.jinja), compiled once by poot's sandboxed interpreter
(poot.text.jinja) and rendered with the variables Hugging Face passes: `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, `tools`, `documents` and any extra keyword
(`enable_thinking`, `date_string`, ...). Messages are checked first, so a malformed request fails
with a message a user can act on rather than somewhere inside the template. Tokenizing the text is
not done here.
"""
from poot.errors import TemplateError
from poot.text.jinja import Template


class ChatTemplate:
    """A compiled chat template; `render` may be called from several threads at once."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.template = Template(source, trim_blocks=True, lstrip_blocks=True)
        self._renders_tools = None

    def renders_tools(self):
        """Whether the template writes tools, an assistant's tool calls and tool results into
        the prompt (found once, by rendering a conversation that holds one of each)."""
        if self._renders_tools is None:
            probe = {"type": "function", "function": {
                "name": "probe_tool_name", "description": "probe tool description",
                "parameters": {"type": "object", "properties": {}}}}
            call = {"id": "probe0001", "type": "function",
                    "function": {"name": "probe_call_name", "arguments": {}}}
            messages = [{"role": "user", "content": "probe question"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "probe0001", "content": "probe result"}]
            try:
                prompt = self.render(messages, tools=[probe])
            except TemplateError:
                prompt = ""
            self._renders_tools = all(word in prompt for word in (
                "probe_tool_name", "probe_call_name", "probe result"))
        return self._renders_tools

    def render(self, messages, add_generation_prompt=True, tools=None, **extra) -> str:
        check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise TemplateError("tools must be a list of objects")
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, "documents": None}
        context.update(extra)
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.template.render(**context)


def check_messages(messages):
    """Raise TemplateError naming the first message (and field) of a shape templates cannot take."""
    if not isinstance(messages, list):
        raise TemplateError(f"messages must be a list of objects, not {_kind(messages)}")
    if not messages:
        raise TemplateError("messages must not be empty")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise TemplateError(f"{where} must be an object with 'role' and 'content', not {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise TemplateError(f"{where}.role must be a string, not {_kind(role)}"
                                if "role" in message else f"{where} has no 'role'")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue  # an assistant turn that only calls tools
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise TemplateError(f"{where}.content must be a string or a list of content parts, not "
                                f"{_kind(content)}" if "content" in message else f"{where} has no 'content'")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise TemplateError(f"{where}.content[{j}] must be an object with a string 'type'")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise TemplateError(f"{where}.content[{j}] is a text part without a string 'text'")


def _kind(value):
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
