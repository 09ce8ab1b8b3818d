"""Steps launched ahead: where every sequence of the step in flight chooses on the device, the
engine launches the next step before that one lands, its chosen tokens fed on the device
(Scheduler.ahead, StepBatch.feed, choice.feed_tokens), prompts' next chunks and newcomers beside
them. The device runs it on staged inputs of two
sides and waits for one step at a time (marks): ptx, and a discrete GPU's vulkan; lavapipe's
vulkan is made to stage here. Checked against the reference runner's tokens, whatever ends,
joins, is cancelled or fails meanwhile, and through poot-serve over HTTP."""
import http.client
import json
import re
import threading
import time

import numpy as np
import pytest

import poot
from poot.engine.engine import Engine
from poot.engine.faults import Faults
from poot.engine.request import EngineFailed, SamplingParams, Sequence
from poot.engine.scheduler import Scheduler
from poot.serve import Server
from tests.models import tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny"), dtype="F16"))


def staged(device, monkeypatch):
    if "marks" not in device.features or "staging" not in device.features:
        pytest.skip(f"{device.backend}: steps are not staged with marks (no step is fed)")
    monkeypatch.setattr(device, "step_staging", True)


def make_engine(model, device, ahead=True, step_tokens=256):
    runner = model.runner(device, num_blocks=96, block_size=4, max_seqs=4)
    return Engine(runner, model.tokenizer, max_seqs=4, max_context=160, ahead=ahead,
                  step_tokens=step_tokens)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def drain(handle):
    """(token ids, finish reason) of a handle whose steps are run meanwhile, or the error."""
    ids, reason = [], None
    try:
        for out in handle:
            ids += out.token_ids
            reason = out.finish_reason or reason
    except EngineFailed as e:
        return e
    return ids, reason


def run(engine, requests, later=(), after=3):
    """Each request's (tokens, finish reason): `requests` submitted at once, `later` ones
    after `after` steps (joining while steps are launched ahead)."""
    handles = [engine.submit(p, params) for p, params in requests]
    for _ in range(after):
        engine.step()
    handles += [engine.submit(p, params) for p, params in later]
    while engine.step():
        pass
    return [drain(h) for h in handles]


def prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, n).tolist() for n in lengths]


def test_steps_launched_ahead_give_the_tokens_of_steps_launched_in_turn(model, device,
                                                                      monkeypatch):
    """Prompts of one to three chunks, replies of different lengths, stop tokens that end some
    early (their token after the stop is computed ahead and dropped), newcomers joining: the
    tokens and finish reasons the same device gives with no step launched ahead (fresh prompts
    each run: against the reference's, a near-tie of f16 products parts them in about one run
    in forty), steps launched ahead (prompts' chunks among them), every block free."""
    staged(device, monkeypatch)
    seed = int(np.random.default_rng().integers(1 << 30))
    first = prompts([70, 5, 33, 2], seed)
    later = prompts([9, 40], seed + 1)
    lengths = [6, 30, 12, 25, 3, 20]
    plain = run(make_engine(model, device, ahead=False),
                [(p, greedy(24)) for p in first + later], after=0)
    # a stop token a few tokens into some replies: the first time it comes, they end there
    stops = [[plain[i][0][i + 1]] if i % 2 else [] for i in range(len(lengths))]
    params = [greedy(n, stop_token_ids=s) for n, s in zip(lengths, stops)]
    want = run(make_engine(model, device, ahead=False, step_tokens=16),
               list(zip(first, params[:4])), list(zip(later, params[4:])))
    engine = make_engine(model, device, step_tokens=16)
    assert engine.ahead
    got = run(engine, list(zip(first, params[:4])), list(zip(later, params[4:])))
    assert got == want, f"prompts of seed {seed}"
    assert any(reason == "stop" for _, reason in got)
    stats = engine.stats()
    # every step but the first goes ahead: prompts' later chunks and newcomers' first ones too
    assert stats.steps_ahead_total >= stats.steps_total - 2, stats
    assert engine.kv.num_used == 0 and not engine.scheduler.in_flight
    assert engine.idle


def test_without_ahead_the_same_runner_gives_the_same_tokens(model, device, monkeypatch):
    staged(device, monkeypatch)
    requests = [(p, greedy(n)) for p, n in zip(prompts([12, 30, 4], 7), (9, 14, 20))]
    off = make_engine(model, device, ahead=False)
    assert run(off, requests) == run(make_engine(model, device), requests)
    assert off.stats().steps_ahead_total == 0


def test_a_warmed_up_engine_gives_the_tokens_of_a_fresh_one(model, device, monkeypatch):
    """Engine.warm_up (what a server runs before it serves) runs its request's steps on the
    device: a prompt's, steps launched ahead on its tokens, the one-token decode recorded; then
    the engine counts from zero with every block free, and greedy requests get the tokens a
    fresh engine gives them."""
    staged(device, monkeypatch)
    requests = [(p, greedy(n)) for p, n in zip(prompts([12, 30, 4], 11), (9, 14, 20))]
    want = run(make_engine(model, device), requests)
    engine = make_engine(model, device)
    engine.warm_up(prompts([5], 12)[0])
    assert engine.runner.graphs
    stats = engine.stats()
    assert (stats.steps_total, stats.steps_ahead_total, stats.prompt_tokens_total,
            stats.generation_tokens_total) == (0, 0, 0, 0), stats
    assert engine.kv.num_free == engine.runner.num_blocks and engine.idle
    assert run(engine, requests) == want
    assert engine.stats().steps_ahead_total > 0


def test_sampled_rows_are_drawn_on_the_device_and_go_ahead(model, device, monkeypatch):
    """A sampled (seeded) row is drawn on the device (choice.draw), so steps go ahead of it as
    of greedy ones, the drawn token their input, and its tokens are those the runner gives with
    no step ever launched ahead (the reference's may differ where its logits differ)."""
    staged(device, monkeypatch)
    requests = [(p, SamplingParams(max_tokens=10, temperature=t, top_p=top_p, seed=5,
                                   ignore_eos=True))
                for p, t, top_p in zip(prompts([6, 11, 9], 3), (0.8, 1.0, 0.0), (1.0, 0.9, 1.0))]
    engine = make_engine(model, device)
    assert run(engine, requests) == run(make_engine(model, device, ahead=False), requests)
    assert engine.stats().steps_ahead_total > 0


def test_a_request_cancelled_between_steps_launched_ahead_frees_its_blocks(model, device,
                                                                          monkeypatch):
    """A cancel lands the step in flight (the one launched ahead of it has landed by then):
    the request ends "abort", the others go on with the reference's tokens."""
    staged(device, monkeypatch)
    requests = [(p, greedy(30)) for p in prompts([8, 13, 21], 11)]
    want = run(make_engine(model, None), requests)
    engine = make_engine(model, device)
    handles = [engine.submit(p, params) for p, params in requests]
    while engine.stats().steps_ahead_total < 3:
        assert engine.step()
    assert engine.scheduler.in_flight            # a step launched ahead is in flight
    handles[1].cancel()
    while engine.step():
        pass
    got = [drain(h) for h in handles]
    assert got[1][1] == "abort" and got[1][0] == want[1][0][:len(got[1][0])]
    assert [got[0], got[2]] == [want[0], want[2]]
    assert engine.kv.num_used == 0 and not engine.scheduler.in_flight


def test_a_fault_in_a_step_launched_ahead_fails_its_requests_and_serving_goes_on(
        model, device, monkeypatch):
    """Every 7th step fails part way through its launches: the requests of the step (and of
    the step launched on its tokens) fail, their blocks are freed, and a request after them
    gets the reference's tokens."""
    staged(device, monkeypatch)
    engine = make_engine(model, device)
    engine.runner.faults = Faults(every=7)
    got = run(engine, [(p, greedy(25)) for p in prompts([5, 9, 14], 13)])
    assert any(isinstance(g, EngineFailed) for g in got)
    assert engine.stats().steps_ahead_total > 0 and engine.stats().step_failures_total > 0
    assert engine.kv.num_used == 0 and not engine.scheduler.in_flight
    engine.runner.faults = None
    prompt = prompts([10], 17)[0]
    assert run(engine, [(prompt, greedy(12))]) == \
        run(make_engine(model, None), [(prompt, greedy(12))])
    assert engine.error is None


def test_ahead_plans_a_decode_token_for_each_sequence_its_step_does_not_end(model):
    """Scheduler.ahead with no device: the step in flight's sequences that sample greedily
    each get one fed token (a sequence that step ends by length none); nothing where one of
    them samples on the host, reports log probabilities, or where a sequence waits."""
    s = Scheduler(num_blocks=32, block_size=4, max_seqs=4, step_tokens=64, table_width=8,
                  vocab_size=300)
    def sequence(i, prompt, params):
        return Sequence.create(i, prompt, params, params.max_tokens, model.tokenizer)

    a, b = sequence(0, [5, 6, 7], greedy(5)), sequence(1, [8, 9], greedy(1))
    for seq in (a, b):
        s.add(seq)
    plan = s.schedule()
    assert [(seq.seq_id, n) for seq, n in plan] == [(0, 3), (1, 2)]
    ahead = s.ahead(plan, context_limit=100)
    assert [(seq.seq_id, n) for seq, n in ahead] == [(0, 1)]     # b's one token ends it
    assert len(a.blocks) == 1                   # its 4th token fits the block it has
    batch, rows = s.build(ahead, {0: (3, 0)})
    assert batch.positions.tolist() == [3] and batch.feed.tolist() == [0]
    assert batch.block_tables.tolist() == [a.blocks] and rows == [(a, None)]
    c = sequence(2, [1, 2], greedy(4))
    s.add(c)
    s.max_seqs = 2                                      # every row taken: a newcomer waits
    assert [seq for seq, _ in s.ahead(plan, context_limit=100)] == [a]
    s.max_seqs = 4                                      # else it joins the step ahead
    ahead = s.ahead(plan, context_limit=100)
    assert [(seq.seq_id, n) for seq, n in ahead] == [(0, 1), (2, 2)] and not s.waiting
    batch, rows = s.build(ahead, {0: (3, 0), 1: (2, 1)})
    assert batch.tokens.tolist() == [0, 1, 2] and batch.feed.tolist() == [0, -1, -1]
    assert batch.positions.tolist() == [3, 0, 1] and rows == [(a, None), (c, None)]
    assert batch.sampling.step.tolist() == [1, 0]
    s.remove(c)
    a.params = SamplingParams(max_tokens=5, temperature=0.5, seed=3)
    ahead = s.ahead(plan, context_limit=100)            # a sampled row is drawn on the device
    batch, rows = s.build(ahead, {0: (3, 0)})
    assert batch.sampling.temperature.tolist() == [0.5] and batch.sampling.seed.tolist() == [a.seed]
    assert batch.sampling.step.tolist() == [a.num_generated + 1]
    a.params = greedy(5, logprobs=2)
    assert s.ahead(plan, context_limit=100) == []
    a.params = greedy(5)
    assert [seq for seq, _ in s.ahead(plan, context_limit=4)] == []   # the context ends a
    assert s.ahead(plan, context_limit=100, redo={0}) == []    # a's row chose nothing
    assert s.ahead(plan[1:], context_limit=100) == []   # a running sequence sat the step out


def test_ahead_goes_on_with_a_prompt_whose_chunk_is_in_flight(model):
    """Scheduler.ahead with no device: a prompt longer than a step computes its next chunk
    ahead, from the tokens in flight on (fed none: they are known), and samples where that
    chunk ends it; a decode token of another sequence comes first, and a newcomer takes what
    the budget leaves."""
    s = Scheduler(num_blocks=32, block_size=4, max_seqs=4, step_tokens=6, table_width=8,
                  vocab_size=300)
    long_prompt = list(range(10, 21))                   # 11 tokens: chunks of 6 and 5
    d = Sequence.create(0, long_prompt, greedy(3), 3, model.tokenizer)
    s.add(d)
    plan = s.schedule()
    assert [(seq.seq_id, n) for seq, n in plan] == [(0, 6)]
    ahead = s.ahead(plan, context_limit=100)
    assert [(seq.seq_id, n) for seq, n in ahead] == [(0, 5)]
    batch, rows = s.build(ahead, {0: (6, None)})
    assert batch.tokens.tolist() == long_prompt[6:] and batch.feed.tolist() == [-1] * 5
    assert batch.positions.tolist() == list(range(6, 11)) and rows == [(d, None)]
    assert batch.sampling.step.tolist() == [0]
    s.launched(plan)
    s.launched(ahead)
    s.computed(plan)                                    # the first chunk lands
    e = Sequence.create(1, [7, 8, 9], greedy(2), 2, model.tokenizer)
    s.add(e)
    ahead2 = s.ahead(ahead, context_limit=100)          # d's first token, then e's prompt
    assert [(seq.seq_id, n) for seq, n in ahead2] == [(0, 1), (1, 3)]
    batch, rows = s.build(ahead2, {0: (5, 0)})
    assert batch.positions.tolist() == [11, 0, 1, 2] and batch.feed.tolist() == [0, -1, -1, -1]
    assert batch.tokens.tolist()[1:] == [7, 8, 9] and rows == [(d, None), (e, None)]


def grammar_of(model, schema):
    from poot.grammar import compiled, schema_grammar
    return compiled(("ahead", json.dumps(schema)), lambda: schema_grammar(schema),
                    model.tokenizer)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}


def mixed_requests(model):
    """Greedy requests of every kind that goes ahead: plain, constrained by a JSON schema,
    penalised (presence, frequency, repetition, a ban), and min_tokens."""
    p = prompts([9, 4, 17, 6], 23)
    return [(p[0], greedy(30)),
            (p[1], SamplingParams(max_tokens=60, temperature=0,
                                  constraint=grammar_of(model, SCHEMA))),
            (p[2], greedy(30, presence_penalty=0.7, frequency_penalty=0.4,
                          repetition_penalty=1.3, logit_bias={7: -100})),
            (p[3], SamplingParams(max_tokens=20, temperature=0, min_tokens=12))]


def test_constrained_and_edited_rows_go_ahead_with_the_reference_tokens(model, device,
                                                                        monkeypatch):
    """A step with constrained or penalised rows is launched ahead too, its choice made once
    the step before lands (StepRunner.choose: their masks and edits follow its tokens): the
    reference's tokens, which the masks and edits change."""
    staged(device, monkeypatch)
    requests = mixed_requests(model)
    want = run(make_engine(model, None), requests)
    free = run(make_engine(model, None), [(p, greedy(n)) for p, n in
                                         zip([p for p, _ in requests[1:3]], (60, 30))])
    assert all(w[0] != f[0] for w, f in zip(want[1:3], free))
    engine = make_engine(model, device)
    chosen = []
    choose = Engine._choose_ahead
    monkeypatch.setattr(Engine, "_choose_ahead",
                        lambda self, lane: (chosen.append(lane), choose(self, lane)))
    got = run(engine, requests)
    assert got == want
    assert len(chosen) >= 10                    # steps launched ahead with such rows
    assert model.tokenizer.decode(got[1][0]).lstrip().startswith("{")
    assert engine.stats().steps_ahead_total >= 10, engine.stats()
    assert engine.kv.num_used == 0 and not engine.scheduler.in_flight


def test_a_mask_not_ready_when_its_step_chooses_is_computed_again(model, device, monkeypatch):
    """A constrained sequence whose mask is not ready when the step launched ahead of it
    chooses (a threaded engine's mask thread is still at it) chooses nothing there and is
    computed again in a later step; the others' steps never wait: the reference's tokens."""
    staged(device, monkeypatch)
    requests = mixed_requests(model)
    want = run(make_engine(model, None), requests)
    engine = make_engine(model, device)
    asked, redone = [0], []
    choose = Engine._choose_ahead

    def not_every_time(seq):
        asked[0] += 1
        return asked[0] % 3 != 0

    def recording(self, lane):
        choose(self, lane)
        redone.append(len(self._redo))
    engine.scheduler.mask_ready = not_every_time
    monkeypatch.setattr(Engine, "_choose_ahead", recording)
    assert run(engine, requests) == want
    assert any(redone) and engine.stats().steps_ahead_total >= 5
    assert engine.kv.num_used == 0 and not engine.scheduler.in_flight


def completion(port, prompt, max_tokens, stream, hang_up_after=None):
    """(text, finish reason) of one greedy /v1/completions request over HTTP; a stream read
    for `hang_up_after` events, then its connection closed, gives None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    if not stream:
        choice = json.loads(response.read())["choices"][0]
        conn.close()
        return choice["text"], choice["finish_reason"]
    text, reason, events = "", None, 0
    while True:
        line = response.readline()
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            conn.close()
            return text, reason
        choice = json.loads(line[6:])["choices"][0]
        text += choice["text"]
        reason = choice["finish_reason"] or reason
        events += 1
        if hang_up_after is not None and events == hang_up_after:
            conn.close()
            return None


# Greedy tokens of a step computed on the tensor cores (x rounded to f16) may part from the
# reference's where its two best logprobs lie this close (nats): scripts/serve-check's default.
NEAR_TIE = 0.05


def agree_up_to_a_near_tie(text, outs):
    """Whether `text` is the reference's answer (its Outputs `outs`, each token's two best
    logprobs with it) up to where the reference chose a token within NEAR_TIE of another: the
    parting lies among the tokens since the reference's text last agreed, and after it the
    two answers go their own ways. (Requests that ask for log probabilities are not launched
    ahead, so the server's answer is compared as text.)"""
    said, tops = "", []
    for out in outs:
        tops += [lp.top for lp in out.logprobs]
        if not out.text:                        # held back: its tokens' text comes later
            continue
        if not text.startswith(said + out.text):
            return any(top[0][1] - top[1][1] <= NEAR_TIE for top in tops)
        said, tops = said + out.text, []
    return text == said


def test_poot_serve_launches_ahead_over_http(model, device, monkeypatch):
    """poot-serve on a staged device, as it loads by default: 8 concurrent greedy
    completions, streamed and whole, prompts of one to three chunks, and a client that hangs
    up mid-stream: each answer is the reference engine's for its prompt alone (up to a near-tie:
    a step of many tokens rounds x to f16 on the tensor cores), /metrics counts steps launched
    ahead, and every block is free afterwards."""
    staged(device, monkeypatch)
    server = Server(port=0)
    server.load(model, model.runner(device, num_blocks=160, block_size=4, max_seqs=8),
                max_seqs=8, step_tokens=32, served_names=["tiny"])
    try:
        assert server.engine.ahead
        rng = np.random.default_rng()
        jobs = [(rng.integers(3, 300, n).tolist(), m, i % 2 == 0)
                for i, (n, m) in enumerate(zip((4, 70, 9, 33, 2, 50, 17, 6),
                                               (20, 9, 30, 14, 25, 3, 18, 11)))]
        got = [None] * len(jobs)

        def client(i):
            prompt, max_tokens, stream = jobs[i]
            got[i] = completion(server.port, prompt, max_tokens, stream)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
        threads.append(threading.Thread(target=completion, args=(
            server.port, jobs[0][0], 60, True, 5)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (prompt, max_tokens, _), (text, reason) in zip(jobs, got):
            outs = list(Engine(model.runner(num_blocks=64, block_size=4), model.tokenizer)
                        .generate(prompt, greedy(max_tokens, logprobs=2)))
            assert reason == "length" and agree_up_to_a_near_tie(text, outs), \
                (text, "".join(o.text for o in outs))
        deadline = time.monotonic() + 30
        while server.engine.kv.num_used or server.engine.scheduler.running:
            assert time.monotonic() < deadline, "blocks still held"
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        ahead = re.search(r"^poot_engine_steps_ahead_total (\d+)$", metrics, re.MULTILINE)
        assert int(ahead.group(1)) > 0
    finally:
        server.close(grace=0)
