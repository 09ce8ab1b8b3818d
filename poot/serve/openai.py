"""The OpenAI API's shapes: validating request bodies and shaping engine outputs into responses.

A request body (already parsed JSON) becomes a `Completion`: the token ids of its prompts (one,
or completions' several), SamplingParams, n and how to shape what comes back (chat or text,
streamed or whole, logprobs, echo, tool calls). Every
refusal is an `APIError` carrying the OpenAI error body's fields. Tools and response_format are
structured.py's. This module knows the model's tokenizer and chat template but neither sockets
(http.py) nor the engine's internals. `names` are the names the model is served under
(--served-model-name; the first is the one responses carry where a request names none).
"""
import json
import math
import time
import uuid

from poot.engine.request import (MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, InvalidRequest,
                                 SamplingParams, TokenLogprob)
from poot.errors import TemplateError
from poot.serve.structured import CallShaper, ToolUse
from poot.serve.structured import constraint as constraint_of
from poot.serve.errors import APIError, invalid

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# OpenAI's default for /v1/completions without max_tokens (chat's is the rest of the context)
COMPLETION_MAX_TOKENS = 16
LOGPROB_FLOOR = -9999.0
TEXT_MARK = "\0text\0"     # where a text chunk's text goes: no name nor id holds a NUL


def from_invalid_request(exc):
    return invalid(str(exc), exc.param)


# ---- reading fields -------------------------------------------------------------------------

def _get(body, name, kind, default=None):
    """body[name] checked to be of `kind` ("int", "number", "bool", "str", "list", "dict");
    absent or null gives default."""
    value = body.get(name)
    if value is None:
        return default
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)
                             and _finite(v)),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "list": lambda v: isinstance(v, list),
        "dict": lambda v: isinstance(v, dict),
    }[kind](value)
    if not ok:
        article = {"int": "an integer", "number": "a finite number", "bool": "a boolean",
                   "str": "a string", "list": "an array", "dict": "an object"}[kind]
        raise invalid(f"'{name}' must be {article}, got {type(value).__name__} {value!r:.60}",
                      name)
    return value


def _finite(value):
    """Whether a JSON number is a finite float (an integer past float's range is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_text(text, param):
    """JSON may carry lone surrogates (\\ud800), which are not text: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{param}' is not valid Unicode (it holds a lone surrogate)", param)
    return text


def check_model(body, names):
    """The served name the request asks for (the first where it names none)."""
    name = _get(body, "model", "str")
    if name is None:
        return names[0]
    if name not in names:
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                       f"{', '.join(repr(n) for n in names)}", "invalid_request_error", "model",
                       "model_not_found")
    return name


def _choices(body):
    """n, the choices of each prompt (1..MAX_N); best_of may only say the same."""
    n = _get(body, "n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise invalid(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
    best_of = _get(body, "best_of", "int", n)
    if best_of != n:
        raise invalid(f"'best_of' (choosing the best of more draws than n) is not supported; "
                      f"it may only equal n ({n}), got {best_of}", "best_of")
    return n


def _sampling(body, max_tokens_names, logprobs, max_tokens=None, constraint=None,
              skip_special_tokens=True, echo=False):
    """SamplingParams of a request; `max_tokens` where the request names none (None: up to
    the context). With completions' `echo`, max_tokens may be 0 (the prompt alone, scored where
    logprobs asks), and logprobs scores the prompt's tokens too."""
    for name in max_tokens_names:
        given = _get(body, name, "int")
        if given is not None:
            if given < 1 and not (echo and given == 0):
                raise invalid(f"'{name}' must be at least 1 (0 only with 'echo'), got {given}",
                              name)
            max_tokens = given
            break
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    stop = [_check_text(s, "stop") for s in stop if s]
    stop_token_ids = _get(body, "stop_token_ids", "list", [])
    if any(not isinstance(t, int) or isinstance(t, bool) for t in stop_token_ids):
        raise invalid("'stop_token_ids' must be an array of integers", "stop_token_ids")
    top_k = _get(body, "top_k", "int", 0)
    seed = _get(body, "seed", "int")
    logit_bias = {}
    for key, value in _get(body, "logit_bias", "dict", {}).items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid(f"'logit_bias' keys must be token ids (integers, as strings), got "
                          f"{key!r:.40}", "logit_bias")
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and _finite(value)):
            raise invalid(f"'logit_bias' values must be numbers, got {value!r:.40} for "
                          f"token {key}", "logit_bias")
        logit_bias[int(key)] = float(value)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(_get(body, "temperature", "number", 1.0)),
            top_p=float(_get(body, "top_p", "number", 1.0)),
            top_k=0 if top_k == -1 else top_k,
            min_p=float(_get(body, "min_p", "number", 0.0)),
            seed=None if seed is None else seed % 2 ** 64,
            stop=tuple(stop), stop_token_ids=tuple(stop_token_ids),
            ignore_eos=_get(body, "ignore_eos", "bool", False), logprobs=logprobs,
            constraint=constraint, skip_special_tokens=skip_special_tokens,
            prompt_logprobs=logprobs if echo else None,
            presence_penalty=float(_get(body, "presence_penalty", "number", 0.0)),
            frequency_penalty=float(_get(body, "frequency_penalty", "number", 0.0)),
            repetition_penalty=float(_get(body, "repetition_penalty", "number", 1.0)),
            logit_bias=logit_bias or None, min_tokens=_get(body, "min_tokens", "int", 0))
    except InvalidRequest as exc:
        raise from_invalid_request(exc) from None


def _stream_flags(body):
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "dict", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, stream and include_usage


def _floored(logprob):
    """A log probability as responses carry it: a banned token's (logit_bias -100, min_tokens, a
    constraint's mask: about -3.4e38) as -9999, vLLM's floor."""
    return max(logprob, LOGPROB_FLOOR)


# ---- prompts --------------------------------------------------------------------------------

def _token_ids(value):
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body, tokenizer, skip_special_tokens=True):
    """/v1/completions' prompts, each as (token ids, text): `prompt` is a string, a list of
    token ids, or a list of several of those. A prompt of ids has the text they decode to."""
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required", "prompt")
    several = isinstance(prompt, list) and bool(prompt) and not _token_ids(prompt)
    out = []
    for i, p in enumerate(prompt if several else [prompt]):
        where = f"prompt[{i}]" if several else "prompt"
        if isinstance(p, str):
            out.append((tokenizer.encode(_check_text(p, where), add_special=True,
                                         parse_special=True), p))
        elif _token_ids(p):
            out.append((list(p), tokenizer.decode(p, skip_special=skip_special_tokens)))
        else:
            raise invalid(f"'{where}' must be a string or a non-empty array of token ids"
                          + ("" if several else ", or an array of those"), "prompt")
    return out


def chat_messages(body):
    """The messages of a chat request, checked, as Hugging Face's templates take them: content
    a string; an assistant's tool_calls with their arguments as objects (where they are JSON
    objects), a tool result's tool_call_id."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("'messages' must be an array of messages", "messages")
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    flat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise invalid(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r:.40}",
                          f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise invalid(f"{where}.content: only text parts are supported",
                                  f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""        # templates take a string (an assistant that only calls tools)
        elif not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or an array of text parts",
                          f"{where}.content")
        entry = {"role": "system" if role == "developer" else role,
                 "content": _check_text(content, f"{where}.content")}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id must be the string id of the call it "
                              "answers", f"{where}.tool_call_id")
            entry["tool_call_id"] = call_id
        flat.append(entry)
    return flat


def _tool_calls(calls, where):
    if not isinstance(calls, list):
        raise invalid(f"{where} must be an array", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str) \
                or not isinstance(call.get("id", ""), str):
            raise invalid(f"{where}[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                          "\"function\": {\"name\": ..., \"arguments\": a JSON string}}",
                          f"{where}[{j}]")
        arguments = function["arguments"]
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        # Hugging Face's templates take the arguments as an object; text that is no JSON
        # object stays text (templates that test for a string write it as it is)
        out.append({"id": call.get("id", ""), "type": "function", "function": {
            "name": function["name"], "arguments": parsed if isinstance(parsed, dict)
            else _check_text(arguments, f"{where}[{j}].function.arguments")}})
    return out


TEMPLATE_SETS = ("messages", "tools", "add_generation_prompt")    # what render_chat gives


def template_kwargs(body):
    """`chat_template_kwargs` (vLLM's and llama.cpp's field): more variables for the model's
    chat template, such as Qwen3's and SmolLM3's enable_thinking; {} where absent."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in extra:
        if not key.isidentifier() or key in TEMPLATE_SETS:
            raise invalid(f"'chat_template_kwargs' cannot set {key!r}: it must name a template "
                          f"variable other than {', '.join(TEMPLATE_SETS)}",
                          "chat_template_kwargs")
    return extra


def render_chat(model, messages, tool_use=None, extra=None):
    """The prompt text of `messages` by the model's template; `extra`: more variables for it
    (template_kwargs)."""
    if model.chat_template is None:
        raise invalid(f"model '{model.name}' has no chat template; use /v1/completions with a "
                      "prompt you format yourself", "messages", "no_chat_template")
    messages, tools = tool_use.messages(messages) if tool_use else (messages, None)
    try:
        return model.chat_template.render(messages, add_generation_prompt=True, tools=tools,
                                          **(extra or {}))
    except TemplateError as exc:
        raise invalid(f"the model's chat template rejected the messages: {exc}",
                      "messages") from None


def chat_prompt_ids(model, messages, tool_use=None, extra=None):
    # The rendered template carries its own special tokens (BOS included where the model wants).
    return model.tokenizer.encode(render_chat(model, messages, tool_use, extra),
                                  add_special=False, parse_special=True)


# ---- requests -------------------------------------------------------------------------------

class Completion:
    """One validated /v1/completions or /v1/chat/completions request, and its response shapes.

    Its choices are n for each prompt, prompt i's choice j having index i * n + j (OpenAI's
    order); an engine Output says by its index whose it is. With `echo` (completions) each
    choice's text starts with its prompt's text, and its logprobs with the prompt's tokens."""

    def __init__(self, kind, model, name, prompts, params, stream, include_usage,
                 ids_as_tokens=False, tool_use=None, n=1, echo=None):
        self.kind = kind                      # "chat" or "text"
        self.name = name                      # the served name responses carry
        self.prompts = prompts                # each prompt's token ids
        self.n = n
        self.echo = echo                      # each prompt's text, where echoed
        choices = len(prompts) * n
        # each choice's reply is read for tool calls where tool_use has a format
        self.calls = [CallShaper(tool_use) for _ in range(choices)] \
            if tool_use and tool_use.format else None
        # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", which tells
        # apart tokens whose bytes are no whole characters
        self.ids_as_tokens = ids_as_tokens
        self.model = model
        self.tokenizer = model.tokenizer
        self.params = params
        self.stream = stream
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_offsets = [0] * choices
        self.started = [False] * choices      # a choice's first Output has been shaped
        self._text_parts = {}                 # choice -> its text chunk's JSON, cut at the text

    @classmethod
    def chat(cls, body, model, names):
        name = check_model(body, names)
        n = _choices(body)
        logprobs = None
        if _get(body, "logprobs", "bool", False):
            logprobs = _get(body, "top_logprobs", "int", 0)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise invalid(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}",
                              "top_logprobs")
        elif _get(body, "top_logprobs", "int"):
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        messages = chat_messages(body)
        tool_use = ToolUse.of(body, model)
        prompt_ids = chat_prompt_ids(model, messages, tool_use, template_kwargs(body))
        params = _sampling(body, ("max_completion_tokens", "max_tokens"), logprobs,
                           constraint=constraint_of(body, model, tool_use),
                           skip_special_tokens=not tool_use.keeps_special_tokens(
                               model.tokenizer))
        return cls("chat", model, name, [prompt_ids], params, *_stream_flags(body),
                   _get(body, "return_tokens_as_token_ids", "bool", False), tool_use, n)

    @classmethod
    def text(cls, body, model, names):
        name = check_model(body, names)
        n = _choices(body)
        echo = _get(body, "echo", "bool", False)
        if _get(body, "suffix", "str"):
            raise invalid("'suffix' is not supported", "suffix")
        logprobs = _get(body, "logprobs", "int")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise invalid(f"'logprobs' must be between 0 and {MAX_LOGPROBS}", "logprobs")
        params = _sampling(body, ("max_tokens",), logprobs, COMPLETION_MAX_TOKENS,
                           constraint=constraint_of(body, model), echo=echo)
        prompts = _prompts(body, model.tokenizer)
        return cls("text", model, name, [ids for ids, _ in prompts], params,
                   *_stream_flags(body), _get(body, "return_tokens_as_token_ids", "bool", False),
                   n=n, echo=[text for _, text in prompts] if echo else None)

    # ---- shaping ----

    def _text(self, token_id):
        return self.tokenizer.token_bytes(token_id).decode("utf-8", "replace")

    def _token(self, token_id):
        """A token as logprobs name it: its text, or "token_id:N"."""
        return f"token_id:{token_id}" if self.ids_as_tokens else self._text(token_id)

    def _logprobs(self, index, entries):
        """Choice `index`'s logprobs of TokenLogprob entries in the route's shape (completions:
        text offsets continue the choice's; a prompt's first token has neither logprob nor
        top, which come as null)."""
        if entries is None:
            return None
        if self.kind == "chat":
            def one(token_id, logprob):
                raw = self.tokenizer.token_bytes(token_id)
                return {"token": self._token(token_id), "logprob": _floored(logprob),
                        "bytes": list(raw)}
            return {"content": [dict(one(e.token_id, e.logprob),
                                     top_logprobs=[one(i, lp) for i, lp in e.top])
                                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(self._text(e.token_id))
        return {"tokens": [self._token(e.token_id) for e in entries],
                "token_logprobs": [None if e.logprob is None else _floored(e.logprob)
                                   for e in entries],
                "top_logprobs": [None if e.top is None else {self._token(i): _floored(lp)
                                                             for i, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _parts(self, output):
        """(text, logprob entries or None) of an Output; with echo, a choice's first is led by
        its prompt's text and, where scored, its prompt's tokens (the first scored by nothing)."""
        text, entries = output.text, output.logprobs
        first, self.started[output.index] = not self.started[output.index], True
        if first and self.echo is not None:
            i = output.index // self.n
            text = self.echo[i] + text
            if output.prompt_logprobs is not None:
                entries = ([TokenLogprob(self.prompts[i][0], None, None)]
                           + output.prompt_logprobs + (entries or []))
        return text, entries

    @staticmethod
    def usage(usage):
        return {"prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}

    def _envelope(self, object_, choices):
        return {"id": self.id, "object": object_, "created": self.created,
                "model": self.name, "choices": choices}

    def response(self, outputs, usage):
        """The whole (non-streamed) response from every Output of the request and its usage
        (RequestHandle.usage: the prompts counted once, every choice's tokens)."""
        by_choice = [[] for _ in self.started]
        for output in outputs:
            by_choice[output.index].append(output)
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion",
                              [self._choice(index, outs) for index, outs in enumerate(by_choice)])
        body["usage"] = self.usage(usage)
        return body

    def _choice(self, index, outputs):
        parts = [self._parts(o) for o in outputs]
        text = "".join(t for t, _ in parts)
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = self._logprobs(index, [e for _, entries in parts for e in entries or []])
        reason = outputs[-1].finish_reason
        if self.kind == "chat":
            message, called = ({"role": "assistant", "content": text}, False) \
                if self.calls is None else self.calls[index].message(text)
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": self._finish(reason, called)}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, choices):
        chunk = self._envelope("chat.completion.chunk" if self.kind == "chat"
                               else "text_completion", choices)
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self):
        """Chunks sent before any token: chat's first chunk of each choice carries the role."""
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for index in range(len(self.started))]

    @staticmethod
    def _finish(reason, called):
        """OpenAI's finish_reason "tool_calls" for a reply that stopped after calling tools."""
        return "tool_calls" if called and reason == "stop" else reason

    def chunks(self, output):
        """The stream chunks for one Output (none while its text is held back)."""
        index = output.index
        content, entries = self._parts(output)
        has_logprobs = bool(entries)
        calls = []
        if self.calls is not None:
            content, calls = self.calls[index].push(content, output.finish_reason is not None)
        if not content and not calls and not has_logprobs and output.finish_reason is None:
            return []
        if not calls and not has_logprobs and output.finish_reason is None:
            return [self._text_chunk(index, content)]
        logprobs = self._logprobs(index, entries) if has_logprobs else None
        if self.kind == "chat":
            delta = {"content": content} if content or has_logprobs else {}
            if calls:
                delta["tool_calls"] = calls
            finish = output.finish_reason
            if finish is not None and self.calls is not None:
                finish = self._finish(finish, self.calls[index].count > 0)
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs,
                      "finish_reason": output.finish_reason}
        return [self._chunk([choice])]

    def _text_chunk(self, index, content):
        """The encoded chunk of choice `index` that carries text alone: the request's encoding
        of such a chunk, cut where its text goes, around the text's encoding. The same bytes as
        json.dumps of the whole chunk, for a fraction of its cost (a stream sends one a token)."""
        parts = self._text_parts.get(index)
        if parts is None:
            if self.kind == "chat":
                choice = {"index": index, "delta": {"content": TEXT_MARK}, "logprobs": None,
                          "finish_reason": None}
            else:
                choice = {"index": index, "text": TEXT_MARK, "logprobs": None,
                          "finish_reason": None}
            parts = json.dumps(self._chunk([choice])).encode().split(
                json.dumps(TEXT_MARK).encode())
            self._text_parts[index] = parts
        return json.dumps(content).encode().join(parts)

    def usage_chunk(self, usage):
        """The stream's last chunk where stream_options.include_usage asks: no choices, the
        request's usage."""
        final = self._envelope("chat.completion.chunk" if self.kind == "chat"
                               else "text_completion", [])
        final["usage"] = self.usage(usage)
        return final


# ---- the small routes -----------------------------------------------------------------------

def models_list(names, context):
    return {"object": "list", "data": [model_card(name, context) for name in names]}


def model_card(name, context):
    return {"id": name, "object": "model", "created": 0, "owned_by": "poot",
            "max_model_len": context}


def tokenize(body, model, names, context):
    if "messages" in body:
        check_model(body, names)
        tool_use = ToolUse.of(body, model)
        text = render_chat(model, chat_messages(body), tool_use, template_kwargs(body))
        ids = model.tokenizer.encode(text, add_special=False, parse_special=True)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("'/tokenize' needs 'prompt' (a string) or 'messages'", "prompt")
        add_special = _get(body, "add_special_tokens", "bool", True)
        ids = model.tokenizer.encode(_check_text(prompt, "prompt"), add_special=add_special,
                                     parse_special=True)
    return {"tokens": list(ids), "count": len(ids), "max_model_len": context}


def detokenize(body, model):
    tokens = body.get("tokens")
    vocab = model.tokenizer.vocab_size
    if not isinstance(tokens, list) or any(
            not isinstance(t, int) or isinstance(t, bool) for t in tokens):
        raise invalid("'tokens' must be an array of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": model.tokenizer.decode(tokens)}
