"""The writer of streamed responses (poot/serve/streams.py: its thread, its sender process): a
client that stops reading holds up no other stream, and gets its whole stream once it reads
again; one that leaves ends its request; a socket's bytes are all sent before its stream is
done, and the socket is the handler's again."""
import json
import socket
import threading
import time

import pytest

import poot
from poot.engine.engine import Engine
from poot.engine.request import Output
from poot.serve import openai, streams
from poot.serve.metrics import Metrics
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def engine(model):
    engine = Engine(model.runner(num_blocks=256, block_size=4), model.tokenizer, max_seqs=4)
    engine.start()
    yield engine
    engine.stop()


def request(model, max_tokens):
    body = {"model": model.name, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    return openai.Completion.text(body, model, [model.name])


def pair():
    """(the server's end, non-blocking with a small send buffer; the client's end)."""
    server, client = socket.socketpair()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server.settimeout(0.0)
    return server, client


def start(engine, writer, model, sock, max_tokens):
    req = request(model, max_tokens)
    stream = streams.Stream(sock, req, engine.submit(req.prompts[0], req.params), Metrics())
    writer.attach(stream)
    return stream


def read_all(sock):
    sock.settimeout(30)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        piece = sock.recv(65536)
        assert piece, "the stream ended early"
        data += piece
    return data


def generated(data):
    """The tokens a whole stream reports (its usage), after checking it ends as it should."""
    events = [line[6:].strip() for line in data.decode().split("\r\n")
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-3:]
    return chunks[-1]["usage"]["completion_tokens"]


def test_a_client_that_reads_nothing_holds_up_no_other_stream(engine, model):
    writer = streams.Writer()
    stalled_end, stalled = pair()
    reading_end, reading = pair()
    slow = start(engine, writer, model, stalled_end, 300)
    fast = start(engine, writer, model, reading_end, 40)
    assert generated(read_all(reading)) == 40
    assert fast.done.wait(10)
    time.sleep(0.5)
    assert not slow.done.is_set(), "the stalled stream's bytes fit anyway"
    assert generated(read_all(stalled)) == 300
    assert slow.done.wait(10) and not slow.gone


def test_a_client_that_leaves_ends_its_request(engine, model):
    writer = streams.Writer()
    server_end, client = pair()
    stream = start(engine, writer, model, server_end, 400)
    client.recv(100)
    client.close()
    assert stream.done.wait(10) and stream.gone
    deadline = time.monotonic() + 10
    while engine.kv.num_used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.kv.num_used == 0


def test_the_writer_waits_while_the_engine_launches(engine, model):
    """engine.launched is clear from a step's landing to the next launch, and the writer
    encodes nothing while it is."""
    lane, seen = engine.lanes[0], []
    launch = lane.launch

    def noting(batch):
        seen.append(engine.launched.is_set())
        return launch(batch)
    lane.launch = noting
    writer = streams.Writer()
    writer.launched = threading.Event()         # held clear here: as if the engine launched
    server_end, client = pair()
    stream = start(engine, writer, model, server_end, 8)
    deadline = time.monotonic() + 10
    while engine.stats().generation_tokens_total < 8 and time.monotonic() < deadline:
        time.sleep(0.02)
    client.settimeout(0.3)
    with pytest.raises(TimeoutError):
        client.recv(1)
    writer.launched.set()
    assert generated(read_all(client)) == 8 and stream.done.wait(10)
    # the prefill's launch followed no landing; every decode step's did
    assert seen[0] and not any(seen[1:]) and len(seen) == 8 and engine.launched.is_set()
    lane.launch = launch
    writer.close()


def test_the_engine_holds_intake_back_while_it_issues_a_step_on_a_device(model, device):
    """Engine.host_free is clear while the engine's thread schedules and launches a step on a
    device (the device waits for those launches; the server's intake waits for host_free:
    Serving.intake) and set while it waits for the device; the reference runner, whose
    launch computes the step, never clears it."""
    for runner in (model.runner(device, num_blocks=64, block_size=4, max_seqs=4),
                   model.runner(num_blocks=64, block_size=4)):
        engine = Engine(runner, model.tokenizer, max_seqs=4)
        lane, seen = engine.lanes[0], []
        launch, collect = lane.launch, lane.collect

        def noting_launch(*a, **kw):
            seen.append(("launch", engine.host_free.is_set()))
            return launch(*a, **kw)

        def noting_collect(*a, **kw):
            seen.append(("collect", engine.host_free.is_set()))
            return collect(*a, **kw)
        lane.launch, lane.collect = noting_launch, noting_collect
        req = request(model, 6)
        handle = engine.submit(req.prompts[0], req.params)
        while engine.step():
            pass
        assert sum(len(out.token_ids) for out in handle) == 6
        launches = [free for what, free in seen if what == "launch"]
        collects = [free for what, free in seen if what == "collect"]
        assert launches and collects and all(collects) and engine.host_free.is_set()
        assert not any(launches) if runner.queues else all(launches), (runner, seen)


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("usage", [False, True])
def test_a_text_chunk_is_the_json_of_its_whole_chunk(model, kind, usage):
    """A stream's chunk of text alone is encoded from a cut encoding of such a chunk: the bytes
    equal json.dumps of the chunk built whole, for every choice and any text."""
    body = {"model": model.name, "max_tokens": 4, "stream": True, "n": 2,
            "stream_options": {"include_usage": usage}}
    if kind == "chat":
        req = openai.Completion.chat(dict(body, messages=[{"role": "user", "content": "hi"}]),
                                     model, [model.name])
    else:
        req = openai.Completion.text(dict(body, prompt="Once"), model, [model.name])
    texts = [" plain", 'quote " and \\ back', "line\nbreak\ttab\x01", "é ü 中文 🙂", "\0text\0"]
    for index in (0, 1, 0):
        for text in texts:
            got, = req.chunks(Output(token_ids=[5], text=text, index=index))
            choice = ({"index": index, "delta": {"content": text}, "logprobs": None,
                       "finish_reason": None} if kind == "chat" else
                      {"index": index, "text": text, "logprobs": None, "finish_reason": None})
            whole = {"id": req.id, "object": "chat.completion.chunk" if kind == "chat"
                     else "text_completion", "created": req.created, "model": model.name,
                     "choices": [choice]}
            if usage:
                whole["usage"] = None
            assert got == json.dumps(whole).encode()


def test_a_landing_no_launch_follows_leaves_the_writer_free(model):
    """A step landed to abort a sequence in flight (no launch follows) sets engine.launched
    again: else the writer would wait until some later step."""
    engine = Engine(model.runner(num_blocks=64, block_size=4), model.tokenizer, max_seqs=4)
    req = request(model, 50)
    handle = engine.submit(req.prompts[0], req.params)
    engine.step()                   # its prefill in flight
    assert engine.launched.is_set() and engine._flight[0] is not None
    handle.cancel()
    engine._apply_inbox()           # the abort lands that step first
    assert engine._flight[0] is None and engine.launched.is_set()
