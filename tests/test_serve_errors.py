"""Bad requests get OpenAI-shaped 4xx errors, and the server keeps serving after each one.

Every case checks the status, the error body's four fields, and that a normal request right
after it still succeeds. Broken connections (stalled bodies, idle keep-alives, garbage request
lines) and a failing engine are covered at the end.
"""
import http.client
import json
import socket
import time

import openai
import pytest

import poot
from poot.formats.gguf import GGUFFile, write_gguf
from poot.engine.engine import Engine
from tests.test_serve import call, start_server


@pytest.fixture(scope="module")
def server(tiny):
    server = start_server(tiny, num_blocks=64, max_context=128, max_body=64 * 1024,
                          idle_timeout=1.0)
    yield server
    server.close(grace=0)


def assert_error(status_body, status, param=None, code=None, words=None):
    got_status, _, body = status_body
    assert got_status == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if words is not None:
        assert words in error["message"], error["message"]


def still_serving(server):
    status, _, body = call(server, "POST", "/v1/completions",
                           {"prompt": "still here?", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


LONG_PROMPT = " ".join(["word"] * 400)

COMPLETION_CASES = [
    # (body, status, param, words)
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0 only with 'echo'"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens", "at least 1"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, 400, "max_tokens", "context"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ({"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt", "context"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature", "between 0 and 2"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "x", "top_k": -5}, 400, "top_k", None),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p", None),
    ({"prompt": "x", "seed": "abc"}, 400, "seed", "integer"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ({"prompt": "x", "stop": 5}, 400, "stop", None),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"prompt": "x", "n": 17}, 400, "n", "between 1 and 16"),
    ({"prompt": "x", "n": 0}, 400, "n", "between 1 and 16"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of", None),
    ({"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "only equal n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "20"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo", "boolean"),
    ({"prompt": ["one", 5]}, 400, "prompt", "prompt[1]"),
    ({"prompt": [[1, 2], []]}, 400, "prompt", "prompt[1]"),
    ({"prompt": ["one", LONG_PROMPT], "max_tokens": 1}, 400, "prompt", "prompt 1: "),
    ({"prompt": ["x"] * 65, "n": 16}, 400, "prompt", "at most 1024 choices"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "between -2 and 2"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "between -2 and 2"),
    ({"prompt": "x", "frequency_penalty": "lots"}, 400, "frequency_penalty", "number"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "positive"),
    ({"prompt": "x", "logit_bias": [5, 10]}, 400, "logit_bias", "object"),
    ({"prompt": "x", "logit_bias": {"five": 10}}, 400, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"-5": 10}}, 400, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, 400, "logit_bias", "numbers"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "between -100 and 100"),
    ({"prompt": "x", "logit_bias": {"1000000": 1}}, 400, "logit_bias", "vocabulary"),
    ({"prompt": "x", "logit_bias": {str(t): 1 for t in range(1025)}}, 400, "logit_bias",
     "at most 1024"),
    ({"prompt": "x", "min_tokens": -1}, 400, "min_tokens", None),
    ({"prompt": "x", "min_tokens": 1.5}, 400, "min_tokens", "integer"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens", "max_tokens"),
    ({"prompt": []}, 400, "prompt", None),
    ({"prompt": 42}, 400, "prompt", None),
    ({}, 400, "prompt", "required"),
    ({"prompt": [1, 2, 10 ** 7]}, 400, "prompt", "vocabulary"),
    ({"prompt": "\ud800 lone surrogate"}, 400, "prompt", "surrogate"),
    ({"prompt": "x", "temperature": 10 ** 400}, 400, "temperature", "finite number"),
    ({"prompt": "x", "stop": ["y" * 600]}, 400, "stop", "at most 512 characters"),
    ({"prompt": "x", "stop_token_ids": list(range(300))}, 400, "stop_token_ids", "at most"),
    ({"prompt": "x", "stop": [[[["deep"]]]]}, 400, "stop", None),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": "x", "model": 7}, 400, "model", "string"),
]


@pytest.mark.parametrize("body, status, param, words", COMPLETION_CASES,
                         ids=[str(i) for i in range(len(COMPLETION_CASES))])
def test_bad_completion_parameters(server, body, status, param, words):
    assert_error(call(server, "POST", "/v1/completions", body), status, param, words=words)
    still_serving(server)


CHAT_CASES = [
    ({"messages": []}, "messages", "at least one"),
    ({"messages": "hello"}, "messages", "array"),
    ({}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", None),
    ({"messages": ["hi"]}, "messages[0]", "object"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role", "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True},
     "top_logprobs", None),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     "max_completion_tokens", None),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools[0].function", "name"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format", "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
     "response_format", "'not'"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -2.1},
     "presence_penalty", None),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": -101}},
     "logit_bias", None),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 3,
      "response_format": {"type": "json_object"}}, "min_tokens", "constraint"),
]


@pytest.mark.parametrize("body, param, words", CHAT_CASES,
                         ids=[str(i) for i in range(len(CHAT_CASES))])
def test_bad_chat_requests(server, body, param, words):
    assert_error(call(server, "POST", "/v1/chat/completions", body), 400, param, words=words)
    still_serving(server)


def test_a_model_without_a_chat_template_refuses_chat(tiny, tmp_path):
    source = GGUFFile(tiny.path)              # the tiny model, less its template
    write_gguf(tmp_path / "plain.gguf",
               {k: v for k, v in source.metadata.items() if k != "tokenizer.chat_template"},
               [(name, "F32", source.array(name)) for name in source.tensors])
    plain = poot.load(tmp_path / "plain.gguf")
    assert plain.chat_template is None
    server = start_server(plain, num_blocks=16)
    try:
        assert_error(call(server, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}]}), 400, "messages",
                     code="no_chat_template", words="no chat template")
        still_serving(server)
    finally:
        server.close(grace=0)


@pytest.mark.parametrize("raw, words", [
    (b"{", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"\"text\"", "JSON object"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b"[" * 20000 + b"]" * 20000, "nested too deeply"),
    (b'{"prompt": "x", "n": ' + b"7" * 5000 + b"}", "not valid JSON"),
    (b'{"prompt": "x", "temperature": NaN}', "not valid JSON"),
    (b'{"prompt": "x", "top_p": -Infinity}', "not valid JSON"),
], ids=["truncated", "empty", "array", "string", "not-utf8", "deep", "huge-int", "nan", "inf"])
def test_bodies_that_are_not_json_objects(server, raw, words):
    assert_error(call(server, "POST", "/v1/completions", raw,
                      {"Content-Type": "application/json"}), 400, words=words)
    still_serving(server)


def test_unknown_routes_and_wrong_methods(server):
    assert_error(call(server, "GET", "/v2/everything"), 404, code="not_found")
    assert_error(call(server, "POST", "/v1/audio/speech", {"input": "x"}), 404)
    status, response, body = call(server, "GET", "/v1/completions")
    assert_error((status, response, body), 405, code="method_not_allowed")
    assert response.getheader("Allow") == "POST"
    assert_error(call(server, "DELETE", "/v1/models"), 405)
    assert_error(call(server, "PUT", "/health", {}), 405)
    still_serving(server)


def test_a_connection_is_reused_only_when_its_framing_is_intact(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for _ in range(2):                       # keep-alive: two requests on one connection
        conn.request("POST", "/tokenize", body=json.dumps({"prompt": "again"}))
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Connection") is None
        response.read()
    conn.request("POST", "/v1/audio/speech", body=json.dumps({"input": "x" * 1000}))
    response = conn.getresponse()           # the body is never read, so the connection ends
    assert response.status == 404 and response.getheader("Connection") == "close"
    response.read()
    conn.close()
    still_serving(server)


def test_sampling_integers_past_the_device_s_types_are_served(server):
    """A top_k past int32 (and past the vocabulary) is no cut at all: the request is served, as
    is the next one (it once overflowed the step's int32 array and stopped the engine)."""
    for top_k in (2 ** 31, 10 ** 30):
        status, _, body = call(server, "POST", "/v1/completions",
                               {"prompt": "x", "max_tokens": 3, "top_k": top_k, "seed": -1})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    still_serving(server)


def raw_request(server, head, body=b""):
    """Sends `head` (request line and headers, CRLF-separated, without the blank line) and
    `body` on a connection of its own; the reply, read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        return read_until_closed(sock)


@pytest.mark.parametrize("headers", [
    b"Content-Length: 25\r\nContent-Length: 26",
    b"Content-Length: 25, 26",
    b"Content-Length: +25",
    b"Content-Length: 0x19",
    b"Content-Length: 25\r\nTransfer-Encoding: chunked",
    b"Content-Length: \xd9\xa2\xd9\xa5",                # Arabic-Indic digits: not 1*DIGIT
], ids=["two", "list", "plus", "hex", "with-chunked", "unicode-digits"])
def test_ambiguous_framing_is_refused_and_the_connection_ends(server, headers):
    body = b'{"prompt": "framing", "x": 1}'[:25]
    reply = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers,
                        body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, rest = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400 ") and "Connection: close" in head, reply
    assert '"ambiguous_framing"' in rest and "HTTP/1.1" not in rest     # nothing more read
    still_serving(server)


def test_repeated_equal_content_lengths_frame_one_body(server):
    body = json.dumps({"prompt": "twice", "max_tokens": 1}).encode()
    n = str(len(body)).encode()
    reply = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: "
                        b"close\r\nContent-Length: " + n + b"\r\nContent-Length: " + n, body)
    assert reply.startswith("HTTP/1.1 200 "), reply


def test_tokenize_and_detokenize_refuse_bad_input(server):
    assert_error(call(server, "POST", "/tokenize", {"prompt": 5}), 400, "prompt")
    assert_error(call(server, "POST", "/tokenize", {"messages": [{"role": ["user"],
                                                                  "content": "hi"}]}),
                 400, "messages[0].role")
    assert_error(call(server, "POST", "/detokenize", {"tokens": "abc"}), 400, "tokens")
    assert_error(call(server, "POST", "/detokenize", {"tokens": [-1]}), 400, "tokens",
                 words="vocabulary")
    still_serving(server)


def test_a_body_over_the_limit_is_refused_unread(server):
    big = json.dumps({"prompt": "x" * (100 * 1024)}).encode()
    assert_error(call(server, "POST", "/v1/completions", big), 413, code="request_too_large")
    still_serving(server)


def read_until_closed(sock):
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data.decode()


def test_a_chunked_request_body_is_refused(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                     b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith("HTTP/1.1 411 ") and '"length_required"' in reply
    still_serving(server)


def test_a_garbage_request_line_gets_a_json_error(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        reply = read_until_closed(sock)
    head, _, body = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400 ") and set(json.loads(body)["error"]) == {
        "message", "type", "param", "code"}
    still_serving(server)


def test_idle_and_stalled_connections_are_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as idle:
        started = time.monotonic()
        assert idle.recv(1) == b""                   # the server hung up (idle_timeout 1 s)
        assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                        b"\r\n{\"prompt\"")
        assert stalled.recv(65536) == b""
    still_serving(server)


def test_the_openai_client_sees_these_as_its_own_errors(server, tiny):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=tiny.name, prompt="x", max_tokens=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=tiny.name, messages=[], max_tokens=1)
    still_serving(server)


def stream_events(server, body):
    """A streamed completion's events, in order ([DONE] as the string)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)))
    response = conn.getresponse()
    assert response.status == 200
    events = [line[len(b"data: "):].decode() for line in response.read().split(b"\n")
              if line.startswith(b"data: ")]
    conn.close()
    return [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.fixture
def faulty(tiny):
    """A server whose runner fails the steps its Faults say (engine/faults.py)."""
    from poot.engine.faults import Faults
    from poot.serve import Server
    runner = tiny.runner(num_blocks=32, block_size=4)
    runner.faults = Faults()
    server = Server(port=0)
    server.load(tiny, runner, max_context=128)
    yield server, runner.faults
    server.close(grace=0)


def test_a_failing_step_fails_its_requests_and_the_server_serves_on(faulty):
    server, faults = faulty
    request = {"prompt": "doomed", "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    faults.every = faults.steps + 3             # the request's third step
    assert_error(call(server, "POST", "/v1/completions", request), 500, code="engine_failed",
                 words="injected fault")
    faults.every = faults.steps + 2
    events = stream_events(server, request)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed"
    assert set(events[-2]["error"]) == {"message", "type", "param", "code"}
    assert all("choices" in e for e in events[:-2]) and len(events) <= 3   # step 1's token
    faults.every = None
    assert call(server, "GET", "/health")[0] == 200
    still_serving(server)
    status, _, text = call(server, "GET", "/metrics")
    assert "poot_engine_step_failures_total 2" in text and "poot_kv_blocks_used 0" in text


def test_a_lost_device_turns_health_503_device_lost(faulty):
    server, faults = faulty
    faults.lost_at = faults.steps + 2
    assert_error(call(server, "POST", "/v1/completions", {"prompt": "doomed", "max_tokens": 10,
                                                          "ignore_eos": True}),
                 500, code="engine_failed", words="device lost")
    status, _, health = call(server, "GET", "/health")
    assert status == 503 and health["status"] == "device lost"
    assert "InjectedFault" in health["error"]
    assert_error(call(server, "POST", "/v1/completions", {"prompt": "again"}), 503,
                 code="device_lost")
