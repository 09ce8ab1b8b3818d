"""Malformed (and some well-formed) HTTP requests for poot-serve, drawn from a seed, and the
rules their answers must keep: no 5xx but where an injected fault failed the step
(engine/faults.py), every error an OpenAI-shaped body, every 200 a completion of the asked-for
shape. tests/test_serve_fuzz.py runs a few thousand in CI; scripts/serve-check --fuzz runs as
many as asked against a server on any backend.

A case is raw bytes sent on a connection of its own, so framing faults (Content-Lengths that
disagree, a body shorter than announced, a bad request line) are as easy to send as bad JSON.
"""
import json
import random
import socket
from dataclasses import dataclass

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
OTHER_PATHS = ("/", "/v1", "/v1/models/x%00y", "/v1/embeddings", "/health?x=1", "/metrics",
               "/v1/models", "/v1/completions/../health", "//v1/completions", "/%ff%fe")
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW", "post")

# values put in place of a field: types, edges of the device's integers, floats past range
VALUES = [None, True, False, 0, 1, -1, 2, 3, 20, 21, 255, 256, 2 ** 15, 2 ** 31 - 1, 2 ** 31,
          -2 ** 31 - 1, 2 ** 32, 2 ** 63, 2 ** 64, -2 ** 63, 10 ** 30, 0.0, 0.5, -0.5, 1.5, 2.5,
          1e-300, 1e300, -1e300, "", "x", "1", "null", "\u00e9\u4e2d\U0001f600", "a" * 5000,
          [], {}, [1, 2, 3], ["a", "b"], [[1]], {"a": 1}, {"type": "text"}, [None], [True],
          list(range(300)), ["s"] * 10, [{"role": "user", "content": "hi"}]]
# JSON text that Python's json would turn into something odd, spliced in raw
RAW_VALUES = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"7" * 5000,
              b'"\\ud800"', b'"\\udfff\\ud800"', b"[" * 900 + b"]" * 900,
              b'{"a":' * 400 + b"1" + b"}" * 400, b"00", b"01", b"-0", b"1.0e", b"0x10",
              b'"\\u0000"', b"true false"]
COMPLETION_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                     "stop", "stop_token_ids", "ignore_eos", "logprobs", "n", "best_of",
                     "echo", "stream", "stream_options", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "suffix", "model", "user")
CHAT_FIELDS = COMPLETION_FIELDS[1:] + ("messages", "max_completion_tokens", "top_logprobs",
                                       "tools", "tool_choice", "response_format")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass
class Case:
    """One request: its raw bytes, and whether it asks for a stream (read to its end)."""
    kind: str                   # what was done to it, for the report
    data: bytes
    stream: bool = False
    valid: bool = False         # a well-formed request: it must be answered 200
    hang_up: bool = False       # the client closes once it has sent it (a body cut short)


@dataclass
class Answer:
    status: int                 # 0: the server closed the connection without a status; -1:
                                # it had not answered when the client stopped waiting
    head: str
    body: bytes


def request_bytes(method, path, body=b"", headers=None, length=None):
    """A request's bytes; `length` overrides the Content-Length (None: the body's)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if body or length is not None:
        lines.append(f"Content-Length: {len(body) if length is None else length}")
        lines.append("Content-Type: application/json")
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Requests:
    """An endless, seeded stream of Cases for a server of `model_name` whose vocabulary is
    `vocab` tokens: mostly malformed bodies and framing, some well-formed small requests."""

    def __init__(self, seed, model_name, vocab, valid_share=0.15):
        self.rng = random.Random(seed)
        self.model_name, self.vocab, self.valid_share = model_name, vocab, valid_share

    def __iter__(self):
        return self

    def __next__(self):
        r = self.rng.random()
        if r < self.valid_share:
            return self.valid()
        if r < 0.75:
            return self.mutated()
        if r < 0.9:
            return self.framing()
        return self.odd_request()

    # -- well-formed ----------------------------------------------------------------------------
    def valid_body(self, chat):
        rng = self.rng
        body = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7, 1.0]),
                "seed": rng.randint(0, 2 ** 64)}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(["hi", "tell me", "ok"])}]
        else:
            body["prompt"] = rng.choice(["Hello", "The capital of", [5, 6, 7]])
        if rng.random() < 0.3:
            body["stream"] = True
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([0, 1, 5, 2 ** 40])
        if rng.random() < 0.2:
            body["response_format"] = rng.choice([
                {"type": "json_object"}, {"type": "text"},
                {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                    "type": "object", "properties": {"n": {"type": "integer"}}}}}])
        return body

    def valid(self):
        chat = self.rng.random() < 0.5
        body = self.valid_body(chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return Case("valid", request_bytes("POST", path, json.dumps(body).encode()),
                    stream=bool(body.get("stream")), valid=True)

    # -- malformed bodies -----------------------------------------------------------------------
    def value(self):
        return self.rng.choice(VALUES)

    def mutated(self):
        rng = self.rng
        route = rng.choice(ROUTES)
        chat = route == "/v1/chat/completions" or (route == "/tokenize" and rng.random() < 0.5)
        body = self.valid_body(chat)
        if route == "/detokenize":
            body = {"tokens": [rng.randrange(self.vocab) for _ in range(3)]}
        fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
        raw = None
        for _ in range(rng.randint(1, 3)):
            how = rng.random()
            if how < 0.5:
                body[rng.choice(fields)] = self.value()
            elif how < 0.6 and body:
                body.pop(rng.choice(sorted(body)))
            elif how < 0.75 and chat:
                message = dict(body.get("messages", [{}])[0]) if isinstance(
                    body.get("messages"), list) and body["messages"] and isinstance(
                    body["messages"][0], dict) else {}
                message[rng.choice(MESSAGE_FIELDS)] = self.value()
                body["messages"] = [message] * rng.choice([1, 1, 2, 50])
            elif how < 0.85:
                raw = (rng.choice(fields), rng.choice(RAW_VALUES))
            else:
                body["prompt"] = rng.choice([[rng.randrange(-5, self.vocab + 5)
                                              for _ in range(rng.randint(1, 40))],
                                             [[1, 2], [3]], ["a", 5], "x" * rng.randint(0, 3000)])
        text = json.dumps(body).encode()
        if raw is not None:        # splice a value JSON has not (or Python reads oddly) in
            name, value = raw
            text = text[:-1] + (b", " if body else b"") + json.dumps(name).encode() + b": " \
                + value + b"}"
        cut = rng.random()
        if cut < 0.05:
            text = text[:rng.randrange(len(text) + 1)]                  # truncated JSON
        elif cut < 0.08:
            text = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif cut < 0.1:
            text = rng.choice([b"[]", b"null", b"1", b'"s"', b"", b"{}"])
        stream = b'"stream": true' in text
        return Case("body", request_bytes("POST", route, text), stream=stream)

    # -- framing --------------------------------------------------------------------------------
    def framing(self):
        rng = self.rng
        body = json.dumps(self.valid_body(False)).encode()
        n = len(body)
        head = ["POST /v1/completions HTTP/1.1", "Host: x", "Connection: close"]
        choice = rng.randrange(10)
        if choice == 0:
            head += [f"Content-Length: {n}", f"Content-Length: {n + 1}"]
        elif choice == 1:
            head += [f"Content-Length: {n}, {n - 1}"]
        elif choice == 2:
            head += [f"Content-Length: +{n}"]
        elif choice == 3:
            head += [f"Content-Length: {n}", "Transfer-Encoding: chunked"]
        elif choice == 4:
            head += ["Transfer-Encoding: chunked"]
            body = b"%x\r\n%s\r\n0\r\n\r\n" % (n, body)
        elif choice == 5:
            head += [f"Content-Length: {rng.choice(['-1', '1e3', 'abc', ' ', '9' * 40])}"]
        elif choice == 6:
            head += [f"Content-Length: {n - rng.randint(1, n - 1)}"]    # body longer than said
        elif choice == 7:
            head += [f"Content-Length: {n + rng.randint(1, 50)}"]      # shorter: the client
            return Case("framing", ("\r\n".join(head) + "\r\n\r\n").encode() + body,
                        hang_up=True)                                  # hangs up
        elif choice == 8:
            head += [f"Content-Length: {n}"] + [f"X-{i}: {i}" for i in range(rng.choice(
                [10, 99, 101, 200]))]
        else:
            head += [f"Content-Length: {n}", "X-Long: " + "y" * rng.choice([100, 70000])]
        return Case("framing", ("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def odd_request(self):
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:
            data = request_bytes(rng.choice(METHODS), rng.choice(ROUTES + OTHER_PATHS))
        elif choice == 1:
            data = rng.choice([b"GARBAGE\r\n\r\n", b"\r\n\r\n", b"GET\r\n\r\n",
                               b"GET / HTTP/9.9\r\n\r\n", b"GET /health\r\n\r\n",
                               b"POST /v1/completions HTTP/1.1\r\n" + b"x" * 70000 + b"\r\n\r\n",
                               bytes(rng.randrange(256) for _ in range(200))])
        elif choice == 2:
            data = request_bytes("POST", rng.choice(ROUTES),
                                 json.dumps({"prompt": "x"}).encode(),
                                 {"Authorization": rng.choice(["Bearer", "Basic abc", "x" * 500,
                                                               "Bearer \u00e9"])})
        elif choice == 3:
            data = request_bytes("GET", "/v1/models/" + rng.choice(
                [self.model_name, "x" * 3000, "%zz", "a/b", "\u00e9"]))
        elif choice == 4:
            data = request_bytes("POST", rng.choice(ROUTES), json.dumps(
                {"prompt": "x", "max_tokens": 1}).encode(),
                {"Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded",
                                             "multipart/form-data; boundary=x"])})
        else:
            data = request_bytes("POST", "/v1/completions", b"{" * rng.randint(1, 5000))
        return Case("request", data)


def send(port, case, timeout=600.0):
    """Sends a case on a connection of its own and reads the answer until the server closes
    (a stream to its end; every case asks for Connection: close or breaks its framing). The
    client never half-closes: the server takes a peer that closed its side as gone."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(case.data)
        except OSError:             # the server refused before reading it all
            pass
        if case.hang_up:
            return Answer(0, "", b"")
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        except TimeoutError:
            return Answer(-1, "", b"".join(chunks))
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].split(b" ")
    status = int(first[1]) if len(first) > 1 and first[1].isdigit() else 0
    return Answer(status, head.decode("latin-1"), body)


def _dechunk(body):
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        try:
            n = int(size, 16)
        except ValueError:
            return None
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]
    return None


def problems(case, answer, injected="injected fault"):
    """What is wrong with an answer (empty: nothing). A 5xx is a problem unless its error
    names `injected` (the faults the server was told to inject)."""
    status = answer.status
    if status == -1:
        return ["no answer in time"]
    if status == 0:
        return [] if not case.valid else ["a well-formed request got no answer"]
    if case.valid and status != 200 and not (status == 500 and injected.encode() in answer.body):
        return [f"a well-formed request got {status}: {answer.body[:200]!r}"]
    chunked = "transfer-encoding: chunked" in answer.head.lower()
    body = _dechunk(answer.body) if chunked else answer.body
    if body is None:
        return ["a chunked answer is cut short"]
    if status >= 500:
        if injected.encode() not in body:
            return [f"{status}: {body[:300]!r}"]
        return []
    if case.data.startswith(b"HEAD "):
        return []                   # no body comes with an answer to HEAD
    if status == 200 and chunked:
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]":
            return ["a stream does not end with [DONE]"]
        for event in events[:-1]:
            parsed = json.loads(event)
            if "error" in parsed and injected not in parsed["error"].get("message", ""):
                return [f"a stream's error event: {event[:300]!r}"]
        return []
    if b"application/json" not in answer.head.lower().encode() and status != 200:
        return [f"{status} without a JSON body: {answer.head[:200]!r}"]
    if status == 200:
        if case.valid and b'"choices"' not in body:
            return [f"a completion without choices: {body[:200]!r}"]
        return []
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return [f"{status} whose body is no OpenAI error: {body[:200]!r}"]
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return [f"{status} whose error has the wrong fields: {error!r:.200}"]
    return []
