"""A seeded fuzz of malformed requests against poot-serve (tests/http_fuzz.py): every answer
is a 4xx with an OpenAI-shaped body or a well-formed 200, no 5xx but where a fault was injected,
and the server serves at the end with every KV block free."""
import threading

import pytest

from poot.engine.faults import Faults
from poot.serve import Server
from tests import http_fuzz
from tests.test_serve import call, metric, wait_for_free_blocks
from tests.test_serve_errors import still_serving


def fuzz(server, model, seed, n, threads=8):
    """Sends n cases of the seed from `threads` clients; [(case kind, problem)]."""
    cases = iter(http_fuzz.Requests(seed, model.name, model.tokenizer.vocab_size))
    lock, found, sent = threading.Lock(), [], [0]

    def client():
        while True:
            with lock:
                if sent[0] >= n:
                    return
                sent[0] += 1
                case = next(cases)
            answer = http_fuzz.send(server.port, case)
            for problem in http_fuzz.problems(case, answer):
                with lock:
                    found.append((case.kind, problem, case.data[:300]))

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    return found


@pytest.mark.parametrize("seed", [1, 2])
def test_malformed_requests_get_4xx_and_the_server_serves_on(tiny, seed):
    server = Server(port=0, idle_timeout=2.0)
    server.load(tiny, tiny.runner(num_blocks=64, block_size=4), max_seqs=8, step_tokens=64,
                max_context=256)
    try:
        assert fuzz(server, tiny, seed, 1500) == []
        assert call(server, "GET", "/health")[0] == 200
        still_serving(server)
        assert wait_for_free_blocks(server)
    finally:
        server.close(grace=0)


def test_with_faults_injected_only_their_requests_fail(tiny):
    """Every 5th step fails: the well-formed requests in it get 500s (or a stream's error
    event) that name the injected fault, and nothing else does."""
    runner = tiny.runner(num_blocks=64, block_size=4)
    runner.faults = Faults(every=5)
    server = Server(port=0, idle_timeout=2.0)
    server.load(tiny, runner, max_seqs=8, step_tokens=64, max_context=256)
    try:
        assert fuzz(server, tiny, 3, 1000) == []
        assert runner.faults.injected > 0
        assert metric(server, "poot_engine_step_failures_total") == runner.faults.injected
        runner.faults.every = None
        still_serving(server)
        assert wait_for_free_blocks(server)
    finally:
        server.close(grace=0)
