"""poot-serve over real sockets, with the real `openai` client, on a server started in-process.

The tiny random model keeps these fast; the default model (when present in the cache) checks
the chat template and a real conversation. Every response is compared with what the engine gives
for the same request run alone, so batching, streaming and disconnects must change nothing.
"""
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest

import poot
from poot.models import random_weights
from tests.models import default_model, tiny_model
from poot.engine.request import SamplingParams
from poot.engine.engine import Engine
from poot.backends.select import open_device
from poot.errors import CapacityError
from poot.serve import Server


# ---- helpers (test_serve_errors.py uses them too) ----------------------------------------------

def start_server(model, *, num_blocks=256, block_size=4, max_seqs=8, step_tokens=64,
                 max_context=None, served_names=None, **server_kw):
    server = Server(port=0, **server_kw)
    server.load(model, model.runner(num_blocks=num_blocks, block_size=block_size),
                max_seqs=max_seqs, step_tokens=step_tokens, max_context=max_context,
                served_names=served_names)
    return server


def call(server, method, path, body=None, headers=None):
    """One request on its own connection -> (status, headers, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    if response.getheader("Content-Type", "").startswith("application/json"):
        return response.status, response, json.loads(raw)
    return response.status, response, raw.decode()


def metric(server, name):
    _, _, text = call(server, "GET", "/metrics")
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1))


def wait_for_free_blocks(server, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "poot_kv_blocks_used") == 0 and metric(
                server, "poot_running_sequences") == 0:
            return True
        time.sleep(0.05)
    return False


def long_run(server):
    """A max_tokens that keeps a short prompt generating for a while."""
    return min(400, server.engine.context_limit - 32)


def engine_alone(model, prompt_ids, **params):
    """(text, token ids, finish reason) of a request run alone on a fresh engine."""
    engine = Engine(model.runner(num_blocks=256, block_size=4), model.tokenizer)
    outs = list(engine.generate(prompt_ids, SamplingParams(**params)))
    return ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids],
            outs[-1].finish_reason)


@pytest.fixture(scope="module")
def server(tiny):
    server = start_server(tiny)
    yield server
    server.close(grace=0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# ---- the routes -----------------------------------------------------------------------------

def test_health_says_loading_until_the_engine_is_ready(tiny):
    server = Server(port=0)
    try:
        assert call(server, "GET", "/health")[::2] == (503, {"status": "loading"})
        status, _, body = call(server, "GET", "/v1/models")
        assert status == 503 and body["error"]["code"] == "server_loading"
        server.load(tiny, tiny.runner(num_blocks=32, block_size=4))
        status, _, body = call(server, "GET", "/health")
        assert status == 200 and body["status"] == "serving"
        assert body["backend"] == "reference" and body["plan"]["kv_blocks"] == 32
        assert isinstance(body["devices"], list)
    finally:
        server.close(grace=0)


def test_models_lists_the_served_model(server, client, tiny):
    assert [m.id for m in client.models.list().data] == [tiny.name]
    assert client.models.retrieve(tiny.name).id == tiny.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-this-one")


def test_completion_equals_the_engine_run_alone(client, tiny):
    prompt = "Hello there, how"
    text, ids, reason = engine_alone(tiny, tiny.tokenizer.encode(prompt), max_tokens=9,
                                     temperature=0, ignore_eos=True)
    r = client.completions.create(model=tiny.name, prompt=prompt, max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == tiny.name
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(tiny.tokenizer.encode(prompt)), 9, len(tiny.tokenizer.encode(prompt)) + 9)


def test_requests_are_made_a_few_at_a_time_and_not_while_the_engine_issues_a_step(
        server, tiny, monkeypatch):
    """Serving.intake: 12 clients at once (completions, chats, /tokenize), at most
    INTAKE_SLOTS making their requests at a time (an encode made slow here, sleeping midway so
    that overlaps show) and none while Engine.host_free is clear (held clear here, as while the
    engine's thread issues a step on a device); every answer as it is alone."""
    from poot.serve import http as serve_http
    real, running, most, started = tiny.tokenizer.encode, [0], [0], [0]
    lock = threading.Lock()

    def slow_encode(text, **kw):
        with lock:
            running[0] += 1
            started[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)                # gives the interpreter lock up, as a long encode would
        try:
            return real(text, **kw)
        finally:
            with lock:
                running[0] -= 1
    monkeypatch.setattr(tiny.tokenizer, "encode", slow_encode)
    monkeypatch.setattr(serve_http, "ENGINE_TURN_S", 60.0)     # no wait ends by its bound here
    bodies = [("/v1/completions", {"prompt": f"Hello {i}", "max_tokens": 3, "temperature": 0,
                                   "ignore_eos": True}) for i in range(6)] + \
        [("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hi {i}"}],
                                   "max_tokens": 3, "temperature": 0}) for i in range(3)] + \
        [("/tokenize", {"prompt": f"Count {i}"}) for i in range(3)]
    answers = [None] * len(bodies)

    def ask(i):
        answers[i] = call(server, "POST", *bodies[i])
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    server.engine.host_free.clear()
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        assert started[0] == 0, "a request was made while the engine issued a step"
    finally:
        server.engine.host_free.set()
    for t in threads:
        t.join()
    assert all(status == 200 for status, _, _ in answers), answers
    assert 1 < most[0] <= serve_http.INTAKE_SLOTS, most[0]
    for (path, body), (_, _, got) in zip(bodies, answers):
        if path == "/tokenize":
            assert got["tokens"] == real(body["prompt"])
        elif path == "/v1/completions":
            assert got["choices"][0]["text"] == engine_alone(
                tiny, real(body["prompt"]), max_tokens=3, temperature=0, ignore_eos=True)[0]


def test_a_completion_without_max_tokens_takes_openais_default_of_16(client, tiny):
    r = client.completions.create(model=tiny.name, prompt="Hi", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_a_prompt_that_begins_as_an_earlier_one_reports_its_cached_tokens(client, tiny):
    prompt = list(range(3, 60))
    first = client.completions.create(model=tiny.name, prompt=prompt, max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model=tiny.name, prompt=prompt + [61, 62], max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 56     # 14 blocks of 4


def test_a_prompt_of_token_ids_is_taken_as_it_is(client, tiny):
    ids = [5, 90, 31, 7, 200]
    text, _, _ = engine_alone(tiny, ids, max_tokens=5, temperature=0, ignore_eos=True)
    r = client.completions.create(model=tiny.name, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text and r.usage.prompt_tokens == 5


def test_a_streamed_completion_equals_the_whole_one_and_ends_with_usage(client, tiny):
    args = dict(model=tiny.name, prompt="Streams of", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("start", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x8a",
                                   b"P\xffST /v1/completions"])
def test_bytes_that_cannot_start_a_request_get_a_400_without_a_line_end(server, start):
    """A TLS handshake sent to this plain-HTTP port (or binary noise) has no line end to wait
    for: it is answered at once, long before the idle timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(start)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in head
    error = json.loads(body)["error"]
    assert "not an HTTP request" in error["message"] and error["type"] == "invalid_request_error"
    assert ("TLS" in error["message"]) == (start[:1] == b"\x16")


def test_the_stream_is_server_sent_events_one_per_http_chunk(server):
    body = json.dumps({"prompt": "raw", "max_tokens": 6, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"Content-Type: text/event-stream" in head and b"Transfer-Encoding: chunked" in head
    events = []
    while True:                       # each HTTP chunk is exactly one event, written at once
        size, _, rest = rest.partition(b"\r\n")
        size = int(size, 16)
        if size == 0:
            break
        events.append(rest[:size].decode())
        assert rest[size:size + 2] == b"\r\n"
        rest = rest[size + 2:]
    assert all(e.startswith("data: ") and e.endswith("\n\n") and e.count("\n\n") == 1
               for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len(payloads) >= 2


def test_stop_strings_cut_the_text_before_them(client, tiny):
    args = dict(model=tiny.name, prompt="Stop right", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    assert len(full) >= 8, f"the tiny model wrote too little text: {full!r}"
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(stop=[stop, "\x00unused"], **args)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **args)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_completion_logprobs_have_the_completions_shape(client, tiny):
    r = client.completions.create(model=tiny.name, prompt="Log", max_tokens=4, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))
    # vLLM's return_tokens_as_token_ids: the same tokens named by id, the same text
    by_id = client.completions.create(model=tiny.name, prompt="Log", max_tokens=4,
                                      temperature=0, logprobs=3, extra_body={
                                          "ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in by_id.choices[0].logprobs.tokens]
    assert tiny.tokenizer.decode(ids, skip_special=True) == r.choices[0].text
    assert by_id.choices[0].logprobs.text_offset == lp.text_offset
    assert all(k.startswith("token_id:") for top in by_id.choices[0].logprobs.top_logprobs
               for k in top)


def test_seeded_sampling_repeats_and_unseeded_varies(client, tiny):
    args = dict(model=tiny.name, prompt="Random", max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True})
    first = client.completions.create(seed=42, **args).choices[0].text
    assert client.completions.create(seed=42, **args).choices[0].text == first
    text, _, _ = engine_alone(tiny, tiny.tokenizer.encode("Random"), max_tokens=16,
                              temperature=1.0, seed=42, ignore_eos=True)
    assert first == text
    others = {client.completions.create(**args).choices[0].text for _ in range(3)}
    assert others != {first}


# ---- n, several prompts, echo ---------------------------------------------------------------

def by_index(chunks, count):
    """Each choice's text and last finish_reason, joined from stream chunks by choice index."""
    texts, finishes = [""] * count, [None] * count
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    return texts, finishes


def test_n_choices_are_the_request_with_seed_plus_j_whole_and_streamed(client, tiny):
    prompt = "Choices of"
    ids = tiny.tokenizer.encode(prompt)
    expected = [engine_alone(tiny, ids, max_tokens=7, temperature=1.0, seed=30 + j,
                             ignore_eos=True) for j in range(3)]
    args = dict(model=tiny.name, prompt=prompt, max_tokens=7, temperature=1.0, seed=30, n=3,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.text, c.finish_reason) for c in r.choices] == [(t, f) for t, _, f in expected]
    assert len({c.text for c in r.choices}) == 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 21)  # prompt once
    chunks = list(client.completions.create(stream=True, stream_options={
        "include_usage": True}, **args))
    assert by_index(chunks, 3) == ([t for t, _, _ in expected], ["length"] * 3)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 21
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_several_prompts_are_indexed_prompt_times_n_plus_choice(client, tiny):
    prompts = ["First prompt", [7, 8, 9, 10], "A third"]
    ids = [tiny.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    expected = [engine_alone(tiny, i, max_tokens=5, temperature=0.8, seed=2 + j,
                             ignore_eos=True)[0] for i in ids for j in range(2)]
    args = dict(model=tiny.name, prompt=prompts, max_tokens=5, temperature=0.8, seed=2, n=2,
                extra_body={"ignore_eos": True})
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == expected
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 30
    chunks = list(client.completions.create(stream=True, **args))
    assert by_index(chunks, 6) == (expected, ["length"] * 6)
    lists = client.completions.create(model=tiny.name, prompt=[ids[0], ids[2]], max_tokens=5,
                                      temperature=0.8, seed=2, extra_body={"ignore_eos": True})
    assert [c.text for c in lists.choices] == [expected[0], expected[4]]


def test_echo_leads_each_choice_with_its_prompt_and_scores_its_tokens(client, tiny):
    """echo with logprobs: the prompt's text, then the completion's; the prompt's tokens in
    logprobs too (the first with no log probability), each scored as the tiny model's logits
    score it, the completion's as without echo. Streamed, the first chunk of each choice
    carries it."""
    prompt = "Echo me"
    ids = tiny.tokenizer.encode(prompt)
    args = dict(model=tiny.name, max_tokens=4, temperature=0, logprobs=2,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=prompt, **args).choices[0]
    r = client.completions.create(prompt=prompt, echo=True, n=2, **args)
    lp_scored = reference_scores(tiny, ids)
    for choice in r.choices:
        lp = choice.logprobs
        assert choice.text == prompt + plain.text
        assert lp.tokens == [tiny.tokenizer.token_bytes(i).decode("utf-8", "replace")
                             for i in ids] + plain.logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(lp_scored, abs=1e-4)
        assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(prompt=prompt, echo=True, n=2, stream=True, **args))
    assert by_index(chunks, 2)[0] == [prompt + plain.text] * 2
    firsts = [next(c.choices[0] for c in chunks if c.choices[0].index == j) for j in range(2)]
    assert all(f.text.startswith(prompt) and f.logprobs.token_logprobs[0] is None
               for f in firsts)


def reference_scores(model, ids):
    """The log probability of each token of `ids` after the first, from the reference
    runner's logits of the positions before it."""
    from poot.engine.batch import SamplingRows, StepBatch
    from poot.engine.sampling import log_softmax
    n = len(ids)
    batch = StepBatch(np.array(ids, np.int32), np.arange(n, dtype=np.int32),
                      np.zeros(n, np.int32), np.array([list(range(64))], np.int32),
                      np.arange(n, dtype=np.int32), SamplingRows.greedy(n))
    lp = log_softmax(model.runner(num_blocks=64, block_size=4).logits(batch).astype(np.float64))
    return [lp[p, ids[p + 1]] for p in range(n - 1)]


def test_lm_eval_harness_scores_token_prompts_with_echo_and_max_tokens_0(client, tiny):
    """What lm-eval-harness sends to score text: several prompts of token ids, echo, logprobs
    1, max_tokens 0, temperature 0. Each choice is its prompt alone, scored; streamed too."""
    prompts = [[5, 90, 31, 7, 200, 11], [40, 41, 42], [300, 2, 9, 9, 9, 9, 9, 9, 9, 9, 1]]
    args = dict(model=tiny.name, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                temperature=0)
    r = client.completions.create(**args)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 20
    for choice, ids in zip(r.choices, prompts):
        lp = choice.logprobs
        assert choice.finish_reason == "length"
        assert choice.text == tiny.tokenizer.decode(ids, skip_special=True)
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(reference_scores(tiny, ids), abs=1e-4)
        for token, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) == 1 and token <= max(top.values()) + 1e-6   # is_greedy's test
    chunks = list(client.completions.create(stream=True, **args))
    assert by_index(chunks, 3) == ([c.text for c in r.choices], ["length"] * 3)
    plain = client.completions.create(model=tiny.name, prompt="no scores", echo=True,
                                      max_tokens=0)
    assert plain.choices[0].text == "no scores" and plain.choices[0].logprobs is None


def test_twenty_logprobs_are_reported(client, tiny):
    """OpenAI's most, for the prompt's tokens and the completion's (named by id: the tiny
    vocabulary's tokens share texts, which would share a key)."""
    r = client.completions.create(model=tiny.name, prompt="Twenty", max_tokens=3,
                                  temperature=0, logprobs=20, echo=True, extra_body={
                                      "ignore_eos": True, "return_tokens_as_token_ids": True})
    tops = r.choices[0].logprobs.top_logprobs
    assert all(len(top) == 20 for top in tops[1:])
    for top in tops[1:]:
        assert list(top.values()) == sorted(top.values(), reverse=True)


def test_a_client_leaving_a_stream_of_n_choices_ends_them_all(server):
    body = json.dumps({"prompt": "all of them", "n": 4, "max_tokens": long_run(server),
                       "temperature": 0.7, "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    received = b""
    while received.count(b"data: ") < 8:
        received += sock.recv(4096)
    assert metric(server, "poot_running_sequences") == 4
    sock.close()
    assert wait_for_free_blocks(server)


def greedy_ids(client, tiny, prompt, max_tokens, logprobs=1, **fields):
    """(token ids, the response) of a greedy completion, its tokens named by id (vLLM's
    return_tokens_as_token_ids); `fields` go in the body, penalties and all."""
    r = client.completions.create(model=tiny.name, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, logprobs=logprobs, extra_body={
                                      "ignore_eos": True, "return_tokens_as_token_ids": True,
                                      **fields})
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens], r


def test_logit_bias_bans_and_forces_tokens(client, tiny):
    """-100 bans a token (a greedy reply whose tokens are all banned takes none of them, on
    either route), 100 makes it the choice; a reply equals the engine's run of it alone."""
    plain, _ = greedy_ids(client, tiny, "Biases", 8)
    ban = {str(t): -100 for t in set(plain)}
    banned, _ = greedy_ids(client, tiny, "Biases", 8, logit_bias=ban)
    assert banned and not set(banned) & set(plain)
    _, ids, _ = engine_alone(tiny, tiny.tokenizer.encode("Biases"), max_tokens=8,
                             temperature=0, ignore_eos=True,
                             logit_bias={int(t): b for t, b in ban.items()})
    assert ids == banned
    assert greedy_ids(client, tiny, "Biases", 8, logit_bias={"77": 100})[0] == [77] * 8
    ask = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model=tiny.name, messages=ask, max_tokens=6,
                                          temperature=0, logprobs=True, extra_body={
                                              "ignore_eos": True,
                                              "return_tokens_as_token_ids": True})
    said = {int(t.token.removeprefix("token_id:")) for t in chat.choices[0].logprobs.content}
    again = client.chat.completions.create(model=tiny.name, messages=ask, max_tokens=6,
                                           temperature=0, logprobs=True,
                                           logit_bias={str(t): -100 for t in said},
                                           extra_body={"ignore_eos": True,
                                                       "return_tokens_as_token_ids": True})
    assert not said & {int(t.token.removeprefix("token_id:"))
                       for t in again.choices[0].logprobs.content}


def test_banned_tokens_log_probabilities_are_reported_as_minus_9999(client, tiny):
    """Log probabilities are those of the edited logits: with every token but three banned,
    the three share the whole probability and the banned ones among the top five read -9999,
    vLLM's floor (a number JSON carries)."""
    keep = [40, 41, 42]
    ban = {str(t): -100 for t in range(tiny.config.vocab_size) if t not in keep}
    ids, r = greedy_ids(client, tiny, "Three", 3, logprobs=5, logit_bias=ban)
    lp = r.choices[0].logprobs
    assert set(ids) <= set(keep)
    for top in lp.top_logprobs:
        assert sorted(int(t.removeprefix("token_id:")) for t, v in top.items()
                      if v > -9999) == keep
        assert sorted(top.values())[:2] == [-9999.0, -9999.0]
        assert np.logaddexp.reduce([v for v in top.values() if v > -9999]) == \
            pytest.approx(0, abs=1e-4)


def test_min_tokens_holds_off_the_end_of_sequence(client, tiny):
    """An end-of-sequence token biased to be the choice ends the reply at once, unless
    min_tokens bans it until that many tokens are generated."""
    eos = str(min(tiny.tokenizer.eos_ids))
    args = dict(model=tiny.name, prompt="End", max_tokens=10, temperature=0,
                logit_bias={eos: 100})
    r = client.completions.create(**args)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    r = client.completions.create(**args, extra_body={"min_tokens": 4})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")


def test_penalties_reduce_repeats(client, tiny):
    """The tiny model's greedy reply repeats itself; presence and frequency penalties, and
    vLLM's repetition_penalty, each take the repeats away, as the engine alone does."""
    plain, _ = greedy_ids(client, tiny, "Again and again", 48)
    assert len(plain) - len(set(plain)) > 10
    prompt = tiny.tokenizer.encode("Again and again")
    for fields in (dict(presence_penalty=2.0, frequency_penalty=2.0),
                   dict(repetition_penalty=2.0)):
        ids, _ = greedy_ids(client, tiny, "Again and again", 48, **fields)
        assert len(ids) - len(set(ids)) < (len(plain) - len(set(plain))) // 4, fields
        assert ids == engine_alone(tiny, prompt, max_tokens=48, temperature=0, ignore_eos=True,
                                   **fields)[1]


def test_tokenize_and_detokenize_round_trip(server, tiny):
    status, _, body = call(server, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and body["tokens"] == tiny.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"])
    status, _, back = call(server, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tiny.tokenizer.decode(body["tokens"])


def test_metrics_count_requests_tokens_and_latencies(server, client, tiny):
    gaps = ("poot_engine_launch_gaps_total", "poot_engine_launch_gap_seconds_total",
            "poot_engine_launch_gap_cpu_seconds_total")
    before, gaps_before = metric(server, "poot_generation_tokens_total"), [
        metric(server, name) for name in gaps]
    client.completions.create(model=tiny.name, prompt="Count", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    _, response, text = call(server, "GET", "/metrics")
    assert response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    assert metric(server, "poot_generation_tokens_total") == before + 3
    # the prefill's step launched with nothing landed before it; each decode step after one
    launched, seconds, cpu = (metric(server, name) - b for name, b in zip(gaps, gaps_before))
    assert launched == 2 and 0 < seconds < 1 and 0 < cpu < 1
    assert re.search(r'^poot_requests_total\{route="/v1/completions",status="200"\} [1-9]',
                     text, re.MULTILINE)
    assert metric(server, "poot_time_to_first_token_seconds_count") >= 1
    assert metric(server, 'poot_inter_token_latency_seconds_bucket{le="+Inf"}') >= 2
    for name in ("poot_queue_length", "poot_running_sequences", "poot_kv_blocks_free",
                 "poot_prompt_tokens_total"):
        assert f"# TYPE {name} " in text
    sample = re.compile(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+')
    for line in text.splitlines():        # every sample line: name{label="value",...} number
        assert line.startswith("# ") or sample.fullmatch(line), line


def test_a_request_of_n_choices_is_timed_once_to_its_first_token(server, client, tiny):
    """Its other choices' first tokens, timed from the request too, are no gaps between
    tokens: the histograms get one first token and each choice's later tokens."""
    names = ("poot_time_to_first_token_seconds_count", "poot_inter_token_latency_seconds_count")
    before = [metric(server, name) for name in names]
    client.completions.create(model=tiny.name, prompt="Timed", n=3, max_tokens=5,
                              extra_body={"ignore_eos": True})
    assert [metric(server, name) for name in names] == [before[0] + 1, before[1] + 3 * 4]


def test_cutting_streams_midway_frees_every_kv_block(server, tiny):
    total = metric(server, "poot_kv_blocks_free") + metric(server, "poot_kv_blocks_used")
    socks = []
    for i in range(6):
        body = json.dumps({"prompt": f"cut {i}", "max_tokens": long_run(server), "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(sock)
    for sock in socks:
        received = b""
        while received.count(b"data: ") < 3:      # a few tokens in, then the client leaves
            received += sock.recv(4096)
        sock.close()
    assert wait_for_free_blocks(server), "KV blocks still held after the clients left"
    assert metric(server, "poot_kv_blocks_free") == total


def test_a_client_leaving_before_a_whole_response_cancels_it(server):
    body = json.dumps({"prompt": "leave", "max_tokens": long_run(server), "temperature": 0,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    deadline = time.monotonic() + 10
    while metric(server, "poot_running_sequences") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.close()
    assert wait_for_free_blocks(server)


def test_concurrent_clients_get_what_each_request_gives_alone(server, tiny):
    requests = []
    for client_no in range(16):
        for k in range(3):
            prompt = f"Client {client_no} asks question {k}" + " more" * (client_no % 5) * 3
            requests.append(dict(prompt=prompt, max_tokens=4 + (client_no * 7 + k * 5) % 23,
                                 stream=(client_no + k) % 2 == 0))
    expected = [engine_alone(tiny, tiny.tokenizer.encode(r["prompt"]),
                             max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)[0]
                for r in requests]
    results = [None] * len(requests)
    ids = []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def run_client(client_no):
        for k in range(3):
            i = client_no * 3 + k
            r = requests[i]
            args = dict(model=tiny.name, prompt=r["prompt"], max_tokens=r["max_tokens"],
                        temperature=0, extra_body={"ignore_eos": True})
            if r["stream"]:
                chunks = list(client.completions.create(stream=True, **args))
                results[i] = "".join(c.choices[0].text for c in chunks)
                ids.append(chunks[0].id)
            else:
                response = client.completions.create(**args)
                results[i] = response.choices[0].text
                ids.append(response.id)

    threads = [threading.Thread(target=run_client, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == expected
    assert len(ids) == len(set(ids)) == len(requests)
    assert wait_for_free_blocks(server)


def test_sixty_four_concurrent_streams_each_equal_the_engine_run_alone(tiny):
    """64 clients stream at once, all decoding in the same steps: each answer (text and token
    count) is what its request gives alone, and every block is free after."""
    server = start_server(tiny, num_blocks=1024, max_seqs=64, step_tokens=512)
    try:
        prompts = [f"Stream {i} begins" + " again" * (i % 7) for i in range(64)]
        lengths = [8 + (i * 5) % 17 for i in range(64)]
        expected = [engine_alone(tiny, tiny.tokenizer.encode(p), max_tokens=n, temperature=0,
                                 ignore_eos=True)[0] for p, n in zip(prompts, lengths)]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        results = [None] * 64
        go = threading.Barrier(64)

        def run_client(i):
            go.wait()
            chunks = list(client.completions.create(
                model=tiny.name, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}))
            results[i] = ("".join(c.choices[0].text for c in chunks if c.choices),
                          chunks[-1].usage.completion_tokens)

        threads = [threading.Thread(target=run_client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert results == [(text, n) for text, n in zip(expected, lengths)]
        assert wait_for_free_blocks(server)
    finally:
        server.close(grace=0)


def test_a_kv_cache_too_small_for_everyone_still_gives_identical_outputs(tiny):
    server = start_server(tiny, num_blocks=20, block_size=4, max_seqs=6)   # 80 tokens
    try:
        prompts = [f"tight {i}" * (1 + i % 3) for i in range(8)]
        expected = [engine_alone(tiny, tiny.tokenizer.encode(p), max_tokens=30, temperature=0,
                                 ignore_eos=True)[0] for p in prompts]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        results = [None] * len(prompts)

        def ask(i):
            results[i] = client.completions.create(
                model=tiny.name, prompt=prompts[i], max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == expected
        assert metric(server, "poot_preemptions_total") > 0
        assert wait_for_free_blocks(server)
    finally:
        server.close(grace=0)


def test_the_api_key_guards_every_route_but_health(tiny):
    server = start_server(tiny, num_blocks=32, api_key="s3cret")
    try:
        assert call(server, "GET", "/health")[0] == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/tokenize")):
            status, response, body = call(server, method, path, {"prompt": "x"})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert response.getheader("WWW-Authenticate").startswith("Bearer")
        status, _, _ = call(server, "GET", "/v1/models",
                            headers={"Authorization": "Bearer wrong"})
        assert status == 401
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=tiny.name, prompt="hi", max_tokens=2).usage
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        server.close(grace=0)


def test_closing_lets_in_flight_requests_finish_then_refuses_connections(tiny):
    server = start_server(tiny, num_blocks=64)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=tiny.name, prompt="finish me", max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    closer = threading.Thread(target=server.close, kwargs={"grace": 10.0})
    closer.start()
    rest = list(stream)
    closer.join(15)
    assert not closer.is_alive()
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(first.choices[0].text + "".join(c.choices[0].text for c in rest)) > 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)


# ---- chat -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_server():
    model = poot.load(default_model())
    server = start_server(model, num_blocks=128, block_size=16, max_context=1024)
    yield server, model
    server.close(grace=0)


def test_chat_with_the_default_models_template(default_server):
    server, model = default_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model.name, messages=messages, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    _, _, tokenized = call(server, "POST", "/tokenize", {"messages": messages})
    assert r.usage.prompt_tokens == tokenized["count"]
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    assert all(len(e.top_logprobs) == 2 and bytes(e.bytes).decode("utf-8", "replace") == e.token
               for e in entries)

    chunks = list(client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_n_choices_with_twenty_top_logprobs_whole_and_streamed(default_server):
    """n = 2 sampled chat replies: choice j is the request with seed 7 + j alone; each has its
    role chunk, its deltas and its finish_reason when streamed; top_logprobs up to 20."""
    server, model = default_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = dict(model=model.name, messages=[{"role": "user", "content": "Name an animal."}],
                max_tokens=6, temperature=1.0)
    r = client.chat.completions.create(n=2, seed=7, logprobs=True, top_logprobs=20, **args)
    alone = [client.chat.completions.create(seed=7 + j, **args).choices[0] for j in range(2)]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [a.message.content for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.finish_reason for a in alone]
    for choice in r.choices:
        assert all(len(e.top_logprobs) == 20 for e in choice.logprobs.content)
        assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6
                   for e in choice.logprobs.content)
    chunks = list(client.chat.completions.create(n=2, seed=7, stream=True, **args))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    texts, finishes = ["", ""], [None, None]
    for chunk in chunks:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in r.choices]
    assert finishes == [c.finish_reason for c in r.choices]


def test_a_client_leaving_is_noticed_while_its_tokens_keep_coming(tmp_path):
    """A whole answer writes nothing until its end, so only looking at the connection tells
    that its client left: the sequence stops long before its max_tokens (a tiny model of a long
    context, whose tokens come many times a poll interval)."""
    shape = random_weights.Shape(2, 64, 4, 2, 128, 320, context_length=8192)
    random_weights.write_random_llama(tmp_path / "long.gguf", shape)
    model = poot.load(tmp_path / "long.gguf")
    server = start_server(model, num_blocks=2048, block_size=4)
    try:
        most = server.engine.context_limit - 16
        body = json.dumps({"prompt": "leave", "max_tokens": most, "temperature": 0,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                     b"\r\n%s" % (len(body), body))
        while metric(server, "poot_generation_tokens_total") < 8:
            time.sleep(0.01)
        sock.close()
        assert wait_for_free_blocks(server)
        assert metric(server, "poot_generation_tokens_total") < most // 4
    finally:
        server.close(grace=0)


def test_the_default_model_serves_concurrent_chats_like_single_ones(default_server):
    server, model = default_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    questions = ["Name a color.", "What is 2+2?", "Say hello.", "Name a fruit."]

    def ask(q):
        return client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": q}], max_tokens=6,
            temperature=0).choices[0].message.content

    alone = [ask(q) for q in questions]
    together = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(questions[i])))
               for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


# ---- the program ----------------------------------------------------------------------------

@contextlib.contextmanager
def server_process(*flags, env=None):
    """`python -m poot serve FLAGS --port P` in its own process (with `env` added to the
    environment): yields (process, port); the process is killed if the test leaves it
    running."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "poot", "serve", *map(str, flags), "--port", str(port)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stderr=subprocess.PIPE, text=True, env=dict(os.environ, **(env or {})))
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until_serving(proc, port, seconds):
    """Polls /health of the server process on `port` until it answers 200."""
    deadline, status = time.monotonic() + seconds, None
    while time.monotonic() < deadline and status != 200 and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
        except OSError:
            time.sleep(0.1)
    assert status == 200, proc.stderr.read() if proc.poll() is not None else "no health"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_program_serves_and_exits_0_on_sigterm(tmp_path):
    model_path = tiny_model(tmp_path)
    with server_process("--backend", "reference", "--model", model_path,
                        "--ctx", 256) as (proc, port):
        wait_until_serving(proc, port, 60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        stream = client.completions.create(model=model_path.stem, prompt="bye", max_tokens=30,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        assert list(stream)[-1].choices[0].finish_reason == "length"
        assert proc.wait(20) == 0


NO_VULKAN = {"POOT_VULKAN_LIB": "/nonexistent", "POOT_WGPU_LIB": "/nonexistent"}
NO_GPU = dict(NO_VULKAN, POOT_CUDA_LIB="/nonexistent", POOT_HSA_LIB="/nonexistent")


@pytest.mark.parametrize("flags, status, words, env", [
    (["--backend", "ptx"], 3, "ptx", NO_GPU),
    (["--backend", "auto", "--placement", "tensor:0,1"], 5, "only ptx runs device groups",
     NO_GPU),
    (["--backend", "auto"], 3, "--backend reference", NO_VULKAN),
    (["--backend", "vulkan"], 3, "/nonexistent", NO_VULKAN),
    (["--backend", "wgpu"], 3, "/nonexistent", NO_VULKAN),
    (["--backend", "reference", "--placement", "tensor:0,0"], 2, "twice", {}),
    (["--backend", "reference", "--placement", "sideways:0"], 2, "placement", {}),
    (["--backend", "reference", "--placement", "pipeline:0,1"], 5, "reference", {}),
    (["--backend", "wgpu", "--placement", "pipeline:0,1"], 5, "cannot copy", {}),
    (["--backend", "ptx", "--placement", "tensor:0,1", "--device-timing"], 5, "timing", {}),
    (["--backend", "reference", "--device-timing"], 2, "no device", {}),
    (["--backend", "reference", "--memory-limit", "lots"], 2, "memory-limit", {}),
    (["--backend", "reference", "--max-seqs", "0"], 2, "max-seqs", {}),
    (["--backend", "reference", "--served-model-name", "a", "a"], 2, "distinct", {}),
])
def test_the_program_refuses_what_it_cannot_do_with_an_exit_status(flags, status, words, env,
                                                                    capsys, monkeypatch):
    from poot.serve.cli import main
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(flags + ["--port", "0"]) == status
    err = capsys.readouterr().err
    assert err.startswith("poot-serve: ") and words in err and err.count("\n") == 1


def test_the_program_exits_8_after_its_device_is_lost(tmp_path):
    """A lost device (injected: POOT_INJECT_FAULTS) fails the request in flight, /health says
    "device lost", and the program drains and exits 8 for a supervisor to restart it."""
    with server_process("--backend", "reference", "--model", tiny_model(tmp_path), "--ctx",
                        256, env={"POOT_INJECT_FAULTS": "lost=3"}) as (proc, port):
        wait_until_serving(proc, port, 60)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "lost", "max_tokens": 20, "ignore_eos": True}))
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 500 and "device lost" in body["error"]["message"]
        assert proc.wait(30) == 8
        err = proc.stderr.read()
        assert "injecting faults" in err and "poot-serve: device lost: InjectedFault" in err


def test_the_program_exits_7_on_an_unreadable_model_file(tmp_path, capsys):
    from poot.serve.cli import main
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    assert main(["--backend", "reference", "--model", str(bad), "--port", "0"]) == 7
    assert "broken.gguf" in capsys.readouterr().err


def test_the_program_exits_6_when_the_memory_limit_holds_no_context(tmp_path, capsys):
    from poot.serve.cli import main
    model_path = tiny_model(tmp_path)
    assert main(["--backend", "reference", "--model", str(model_path), "--port", "0",
                 "--memory-limit", "1KiB"]) == 6
    assert "memory-limit" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["vulkan", "wgpu", "auto"])
def test_a_vulkan_driver_without_a_budget_stops_with_exit_6(backend, tmp_path, capsys):
    """lavapipe has no VK_EXT_memory_budget: the free memory is unknown, and never guessed."""
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    try:
        device = open_device("wgpu" if backend == "auto" else backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    try:
        device.memory()
        pytest.skip(f"{device.name} reports a memory budget")
    except CapacityError:
        pass
    assert main(["--backend", backend, "--model", str(tiny_model(tmp_path)), "--port",
                 "0"]) == 6
    assert "budget" in capsys.readouterr().err


@pytest.mark.parametrize("backend, model", [("vulkan", "tiny"), ("wgpu", "tiny"),
                                            ("wgpu", "default")])
def test_vulkan_without_a_budget_serves_within_a_memory_limit(tmp_path, backend, model):
    from poot.errors import BackendUnavailable
    try:
        open_device(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    model_path = tiny_model(tmp_path) if model == "tiny" else default_model()
    with server_process("--backend", backend, "--memory-limit", "512MiB", "--model",
                        model_path, "--ctx", 256) as (proc, port):
        wait_until_serving(proc, port, 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        got = client.completions.create(model=model_path.stem, prompt="Hello", max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        want = poot.LLM(model_path, backend="reference").generate(
            "Hello", max_tokens=8, temperature=0, ignore_eos=True)
        assert got.choices[0].text == want.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


# ---- startup: backends, placement, the memory plan and its check -------------------------------

def test_the_server_warms_its_engine_up_and_forgets_the_request(tiny):
    """Before it serves, Server.load runs a short greedy request (Engine.warm_up) on the runner
    it serves with, so that its first clients pay none of the steps' one-time work; nothing of
    it shows: /metrics counts from zero, every KV block is free and none keeps a prefix (blocks
    of one token: the prompt fills some), and injected faults count the served steps alone."""
    from poot.engine.faults import Faults
    runner = tiny.runner(num_blocks=64, block_size=1)
    runner.faults = Faults(every=1)         # every served step would fail
    server = Server(port=0)
    server.load(tiny, runner, max_context=32)
    try:
        assert any(np.any(a != 0) for a in runner.interpreter.state.values())  # its keys, values
        assert runner.faults.steps == 0
        for name in ("poot_prompt_tokens_total", "poot_generation_tokens_total",
                     "poot_engine_steps_total", "poot_engine_steps_ahead_total",
                     "poot_kv_blocks_used", "poot_kv_blocks_cached",
                     "poot_prefix_cache_query_tokens_total"):
            assert metric(server, name) == 0, name
        assert metric(server, "poot_kv_blocks_free") == 64
        runner.faults.every = None
        prompt = tiny.tokenizer.encode("Ready.")        # the warm-up's own prompt
        status, _, body = call(server, "POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert metric(server, "poot_prefix_cache_query_tokens_total") == len(prompt)
        assert metric(server, "poot_prefix_cache_hit_tokens_total") == 0
    finally:
        server.close(grace=0)


def poll_health(port, proc, timeout=120):
    """Every /health answer from the first one the port gives until serving, as (status, body)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            response = conn.getresponse()
            seen.append((response.status, json.loads(response.read())))
            conn.close()
        except OSError:
            pass
        if seen and seen[-1][0] == 200:
            break
        time.sleep(0.02)
    return seen


def test_health_is_503_during_a_slow_load_and_200_only_after_the_plan_is_checked():
    """The default model on lavapipe: mapping it, planning, allocating and uploading ~90 MiB
    of weights takes long enough for /health to be asked while it runs."""
    from poot.errors import BackendUnavailable
    model_path = default_model()
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    with server_process("--backend", "vulkan", "--memory-limit", "1GiB", "--model",
                        model_path) as (proc, port):
        seen = poll_health(port, proc)
        assert seen and seen[-1][0] == 200, proc.stderr.read() if proc.poll() is not None else seen
        assert seen[0] == (503, {"status": "loading"})
        assert all(answer == (503, {"status": "loading"}) for answer in seen[:-1])
        plan = seen[-1][1]["plan"]
        assert plan["footprint"]["total"] <= plan["memory_free"] == 1 << 30
        assert plan["checked"]["planned"] == plan["footprint"]["total"]
        if "count of its allocations" in plan["checked"]["source"]:    # lavapipe: no budget
            assert plan["checked"]["measured"] == plan["checked"]["planned"]
        # 64 sequences of the model's whole context share the cache the limit leaves
        assert (plan["max_seqs"], plan["context"]) == (64, poot.load(model_path).context_length)
        assert -(-plan["context"] // 16) <= plan["kv_blocks"] < 64 * -(-plan["context"] // 16)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        log = proc.stderr.read()
        block = log[log.index("plan for "):log.index("poot-serve: serving")]
        assert "weights" in block and "arenas" in block and "state" in block
        assert "checked: the allocation took" in block


@pytest.mark.parametrize("backend, words", [("ptx", "libcuda"), ("rocm", "hsa_init")])
def test_a_named_backend_that_cannot_open_stops_with_the_drivers_reason(backend, words,
                                                                          tmp_path, capsys):
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    try:
        open_device(backend)
        pytest.skip(f"{backend} opens here")
    except BackendUnavailable:
        pass
    assert main(["--backend", backend, "--model", str(tiny_model(tmp_path)), "--port", "0"]) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"poot-serve: {backend}: ") and words in err and err.count("\n") == 1


def test_auto_picks_wgpu_on_lavapipe_and_never_vulkan(tmp_path, capsys):
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    for backend in ("ptx", "rocm"):
        try:
            open_device(backend)
            pytest.skip(f"{backend} opens here, so auto picks it")
        except BackendUnavailable:
            pass
    try:
        open_device("wgpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    assert open_device("auto").backend == "wgpu"
    assert main(["--model", str(tiny_model(tmp_path)), "--port", "0"]) == 6
    assert capsys.readouterr().err.startswith("poot-serve: wgpu: ")


def test_an_ordinal_the_driver_does_not_list_is_a_usage_error(tmp_path, capsys):
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    model = str(tiny_model(tmp_path))
    for backend in ("vulkan", "wgpu"):
        assert main(["--backend", backend, "--placement", "pipeline:7", "--model", model,
                     "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"poot-serve: --placement pipeline:7: {backend}: no Vulkan")
    # one ordinal that exists simply opens that device (here: then lavapipe's budget is unknown)
    assert main(["--backend", "vulkan", "--placement", "tensor:0", "--model", model,
                 "--port", "0"]) == 6
    assert "budget" in capsys.readouterr().err


def test_a_memory_limit_below_the_smallest_footprint_stops_with_exit_6(capsys):
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    model_path = default_model()
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    assert main(["--backend", "vulkan", "--memory-limit", "64MiB", "--model", str(model_path),
                 "--port", "0"]) == 6
    err = capsys.readouterr().err
    assert re.search(r"no serving shape fits: the smallest, \d+ sequences? x 512 tokens", err)
    assert "64.0 MiB free (--memory-limit" in err and err.count("\n") == 1


def test_device_timing_shows_each_kernels_device_time_in_metrics(tmp_path):
    from poot.errors import BackendUnavailable
    try:
        open_device("vulkan")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    model_path = tiny_model(tmp_path)
    with server_process("--backend", "vulkan", "--memory-limit", "512MiB", "--device-timing",
                        "--model", model_path, "--ctx", 256) as (proc, port):
        wait_until_serving(proc, port, 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        got = client.completions.create(model=model_path.stem, prompt="Hello", max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        want = poot.LLM(model_path, backend="reference").generate(
            "Hello", max_tokens=4, temperature=0, ignore_eos=True)
        assert got.choices[0].text == want.text
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        seconds = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^poot_kernel_seconds_total\{kernel="([^"]+)"\} (\S+)$', text, re.M)}
        launches = {m.group(1): int(m.group(2)) for m in re.finditer(
            r'^poot_kernel_launches_total\{kernel="([^"]+)"\} (\S+)$', text, re.M)}
        assert any(k.startswith("matvec_") for k in seconds)
        assert any(k.startswith("argmax_") for k in launches)
        assert all(v > 0 for v in seconds.values()) and set(seconds) == set(launches)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_device_timing_on_a_backend_without_it_is_refused(capsys, tmp_path):
    from poot.errors import BackendUnavailable
    from poot.serve.cli import main
    try:
        open_device("wgpu")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    assert main(["--backend", "wgpu", "--device-timing", "--model", str(tiny_model(tmp_path)),
                 "--port", "0"]) == 2
    assert "no per-kernel timing" in capsys.readouterr().err
