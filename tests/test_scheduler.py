"""The engine over the real reference runner and a tiny random Llama: batching, chunked prefill,
paged KV with preemption, stop conditions, seeds, cancellation and failure.

The recurring check is that a request's tokens do not depend on what else is in flight: greedy
(or seeded) outputs in a batch, after preemption, or on the engine thread equal the same request
run alone.
"""
import threading

import numpy as np
import pytest

import poot
from tests.models import tiny_model
from poot.engine.faults import Faults
from poot.engine.engine import Engine
from poot.engine.request import (EngineFailed, InvalidRequest, SamplingParams, Sequence,
                                 StopText)
from poot.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny")))


def make_engine(model, num_blocks=64, block_size=4, **kw):
    return Engine(model.runner(num_blocks=num_blocks, block_size=block_size), model.tokenizer,
                  **kw)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def prompts(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.tokenizer.vocab_size, n).tolist() for n in lengths]


def tokens(outputs):
    return [t for out in outputs for t in out.token_ids]


def alone(model, prompt, params):
    return tokens(make_engine(model).generate(prompt, params))


def run_together(engine, requests):
    handles = [engine.submit(p, params) for p, params in requests]
    engine.run_until_idle()
    return [tokens(h) for h in handles]


def test_generate_runs_steps_in_the_callers_thread(model):
    engine = make_engine(model)
    prompt = prompts(model, [7])[0]
    outs = list(engine.generate(prompt, greedy(6)))
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (7, 6)
    generated = tokens(outs)
    assert "".join(o.text for o in outs) == model.tokenizer.decode(generated, skip_special=True)
    assert engine.stats().kv_blocks_used == 0


def test_batched_greedy_equals_each_request_alone(model):
    requests = list(zip(prompts(model, [1, 3, 17, 40, 9, 25]),
                        [greedy(n) for n in (12, 5, 9, 3, 16, 7)]))
    expected = [alone(model, p, params) for p, params in requests]
    engine = make_engine(model, max_seqs=4)
    assert run_together(engine, requests) == expected
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.running, stats.waiting) == (0, 0, 0)
    assert stats.generation_tokens_total == sum(len(e) for e in expected)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(model):
    engine = make_engine(model, step_tokens=8, max_seqs=4)
    short, long_ = prompts(model, [3, 60])
    decoding = engine.submit(short, greedy(20))
    decoding.next_output()
    engine.submit(long_, greedy(2))
    steps = engine.stats().steps_total
    for _ in range(12):        # the long prompt needs at least 60/7 steps of prefill
        decoding.next_output()
        now = engine.stats().steps_total
        assert now == steps + 1, "a decoding sequence waited for another's prefill"
        steps = now


def test_preempted_sequences_resume_with_identical_tokens(model):
    # 24 blocks of 4 hold 96 tokens; the six requests together need about 190.
    requests = list(zip(prompts(model, [10, 14, 6, 20, 12, 9], seed=1),
                        [greedy(n) for n in (24, 20, 30, 16, 22, 26)]))
    expected = [alone(model, p, params) for p, params in requests]
    engine = make_engine(model, num_blocks=24, max_seqs=6)
    assert run_together(engine, requests) == expected
    stats = engine.stats()
    assert stats.preemptions_total > 0
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == 24


@pytest.mark.parametrize("num_blocks", [64, 20])
def test_prompts_that_begin_alike_take_the_cached_prefix_and_give_the_same_tokens(model,
                                                                                 num_blocks):
    """Requests that share a 40-token start (a system prompt, a conversation's earlier turns)
    compute it once: later ones take its blocks, report them as cached, and give the tokens
    they give alone; with 20 blocks the cache is taken back mid-load (evictions) and nothing
    changes either."""
    start = prompts(model, [40], seed=3)[0]
    tails = prompts(model, [3, 9, 5, 12, 7, 1], seed=4)
    requests = [(start + tail, greedy(n)) for tail, n in zip(tails, (12, 8, 15, 6, 10, 9))]
    expected = [alone(model, p, params) for p, params in requests]
    cached = make_engine(model, num_blocks=num_blocks, max_seqs=2)
    first = run_together(cached, requests[:1])          # the start, computed once
    handles = [cached.submit(p, params) for p, params in requests[1:]]
    cached.run_until_idle()
    outs = [list(h) for h in handles]
    assert first + [tokens(o) for o in outs] == expected
    stats = cached.stats()
    assert stats.prefix_cache_hit_tokens_total >= 40 and stats.kv_blocks_used == 0
    assert outs[0][-1].usage.cached_tokens == 40        # ten blocks of 4
    if num_blocks == 20:
        assert stats.prefix_cache_evictions_total > 0
    plain = make_engine(model, num_blocks=num_blocks, max_seqs=2, prefix_caching=False)
    assert run_together(plain, requests) == expected
    assert plain.stats().prefix_cache_hit_tokens_total == 0


def test_seeded_sampling_is_reproducible_alone_or_batched(model):
    prompt, other = prompts(model, [5, 11])
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    expected = alone(model, prompt, seeded)
    engine = make_engine(model)
    together = run_together(engine, [
        (other, SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)),
        (prompt, seeded),
        (other, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))])
    assert together[1] == expected
    a = engine.submit(prompt, SamplingParams(max_tokens=2))
    b = engine.submit(prompt, SamplingParams(max_tokens=2))
    assert a.seed != b.seed                # no seed: a fresh random one per request


def test_a_stop_string_ends_the_text_before_it(model):
    prompt = prompts(model, [4], seed=2)[0]
    full = "".join(o.text for o in make_engine(model).generate(prompt, greedy(24)))
    assert len(full) >= 8, f"the tiny model wrote too little text: {full!r}"
    stop = full[len(full) // 2:len(full) // 2 + 3]
    outs = list(make_engine(model).generate(prompt, greedy(24, stop=("\x00never", stop))))
    assert "".join(o.text for o in outs) == full[:full.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_a_stop_token_ends_generation_and_is_counted_but_not_written(model):
    prompt = prompts(model, [6], seed=3)[0]
    generated = alone(model, prompt, greedy(12))
    stop_id = generated[4]
    cut = generated.index(stop_id)
    outs = list(make_engine(model).generate(prompt, greedy(12, stop_token_ids=(stop_id,))))
    assert tokens(outs) == generated[:cut + 1]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].usage.completion_tokens == cut + 1
    assert "".join(o.text for o in outs) == model.tokenizer.decode(generated[:cut],
                                                                    skip_special=True)


def test_stop_text_holds_back_only_what_may_start_a_stop_string():
    text = StopText(["Hello!", "xyz"])
    assert text.push("say Hel") == ("say ", False)
    assert text.push("lo") == ("", False)
    assert text.push(" x") == ("Hello ", False)
    assert text.push("yz and more") == ("", True)
    assert StopText([]).push("abc") == ("abc", False)
    earliest = StopText(["b", "a"])
    assert earliest.push("cab") == ("c", True)


def test_the_context_limit_ends_generation_and_refuses_prompts_that_cannot_fit(model):
    engine = make_engine(model, max_context=12)
    prompt = prompts(model, [8])[0]
    outs = list(engine.generate(prompt, SamplingParams(temperature=0, ignore_eos=True)))
    assert len(tokens(outs)) == 4 and outs[-1].finish_reason == "length"
    with pytest.raises(InvalidRequest) as too_long:
        engine.submit(prompts(model, [12])[0], greedy(1))
    assert too_long.value.param == "prompt"
    with pytest.raises(InvalidRequest) as too_many:
        engine.submit(prompt, greedy(5))
    assert too_many.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        engine.submit([model.tokenizer.vocab_size], greedy(1))


def test_logprobs_are_reported_when_asked(model):
    prompt = prompts(model, [5])[0]
    outs = list(make_engine(model).generate(prompt, greedy(4, logprobs=3)))
    for out in outs:
        (entry,) = out.logprobs
        assert entry.token_id == out.token_ids[0]
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id   # greedy: the best
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(entry.top[0][1])
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    assert all(o.logprobs is None for o in make_engine(model).generate(prompt, greedy(2)))


def test_cancel_finishes_with_abort_and_frees_the_blocks(model):
    engine = make_engine(model)
    handle = engine.submit(prompts(model, [9])[0], greedy(50))
    handle.next_output()
    assert engine.stats().kv_blocks_used > 0
    handle.cancel()
    last = handle.next_output()
    assert last.finish_reason == "abort" and last.usage.completion_tokens == 1
    assert handle.finished and engine.stats().kv_blocks_used == 0


def test_the_engine_thread_serves_many_caller_threads(model):
    requests = list(zip(prompts(model, [2, 8, 15, 4, 30, 6, 11, 3], seed=4),
                        [greedy(n) for n in (9, 4, 12, 7, 5, 10, 3, 8)]))
    expected = [alone(model, p, params) for p, params in requests]
    engine = make_engine(model, num_blocks=40, max_seqs=5)
    engine.start()
    results = [None] * len(requests)

    def client(i):
        results[i] = tokens(engine.submit(*requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine.stop()
    assert results == expected
    assert engine.stats().kv_blocks_used == 0


def faulty_engine(model, faults, **kw):
    runner = model.runner(num_blocks=64, block_size=4)
    runner.faults = faults
    return Engine(runner, model.tokenizer, **kw)


def outcome(handle):
    """A request's tokens, or the EngineFailed it ended with."""
    got = []
    try:
        for out in handle:
            got += out.token_ids
    except EngineFailed as e:
        return e
    return got


def test_a_failing_step_fails_its_requests_and_the_rest_are_served(model):
    """Every 9th step raises: the requests in it fail with the step's error and free their
    blocks; the others, and requests that come after, get the tokens they get alone."""
    requests = list(zip(prompts(model, [3, 12, 7, 20, 5], seed=6),
                        [greedy(n) for n in (8, 5, 9, 6, 7)]))
    faults = Faults(every=9)
    engine = faulty_engine(model, faults, max_seqs=2, step_tokens=8)
    handles = [engine.submit(p, params) for p, params in requests]
    engine.run_until_idle()
    got = [outcome(h) for h in handles]
    failed = [g for g in got if isinstance(g, EngineFailed)]
    assert faults.injected >= 1 and failed and len(failed) < len(requests)
    assert all("injected fault" in str(e) for e in failed)
    for g, (p, params) in zip(got, requests):
        if not isinstance(g, EngineFailed):
            assert g == alone(model, p, params)
    stats = engine.stats()
    assert stats.error is None and stats.step_failures_total == faults.injected
    assert stats.kv_blocks_used == 0 and stats.running == 0
    faults.every = None
    assert tokens(engine.generate(*requests[0])) == alone(model, *requests[0])


def test_a_lost_device_fails_every_request_and_the_engine(model):
    """A step fails and the runner cannot recover: the device is lost. Every request ends
    with that error, the engine refuses new ones and tells on_failure."""
    told = threading.Event()
    engine = faulty_engine(model, Faults(lost_at=3))
    engine.on_failure = told.set
    handles = [engine.submit(p, greedy(10)) for p in prompts(model, [3, 5, 7])]
    engine.start()
    for handle in handles:
        with pytest.raises(EngineFailed, match="device lost"):
            list(handle)
    assert told.wait(10) and engine.device_lost
    assert engine.stats().error.startswith("device lost: InjectedFault")
    assert engine.stats().kv_blocks_used == 0
    with pytest.raises(EngineFailed):
        engine.submit([1, 2], greedy(1))
    engine.stop()


def test_a_request_whose_delivery_raises_fails_alone(model, monkeypatch):
    """A fault in one request's own bookkeeping (its text, its stop checks) fails that request
    only: the step's other requests go on."""
    from poot.engine.request import Sequence
    requests = list(zip(prompts(model, [4, 6], seed=2), [greedy(6), greedy(6)]))
    expected = alone(model, *requests[1])
    engine = make_engine(model)
    handles = [engine.submit(p, params) for p, params in requests]
    accept = Sequence.accept

    def fragile(seq, token_id, *args):
        if seq.seq_id == handles[0].seq_id and seq.num_generated == 2:
            raise UnicodeError("a decoder fault")
        return accept(seq, token_id, *args)
    monkeypatch.setattr(Sequence, "accept", fragile)
    engine.run_until_idle()
    first, second = outcome(handles[0]), outcome(handles[1])
    assert isinstance(first, EngineFailed) and "a decoder fault" in str(first)
    assert second == expected
    assert engine.error is None and engine.stats().kv_blocks_used == 0


def test_a_constrained_request_follows_its_grammar_and_leaves_the_batch_as_it_was(model):
    """The constraint's masks ride in the step's SamplingRows: its request writes JSON of the
    schema, and seeded requests batched beside it write what they write alone."""
    import json

    from poot.grammar import compiled, schema_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {
        "type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
    grammar = compiled(("scheduler", json.dumps(schema)), lambda: schema_grammar(schema),
                       model.tokenizer)
    seeded = SamplingParams(max_tokens=30, seed=11, ignore_eos=True)
    requests = list(zip(prompts(model, [5, 7, 3], seed=6),
                        [seeded, SamplingParams(max_tokens=200, seed=3, constraint=grammar),
                         greedy(30)]))
    expected = [alone(model, *requests[0]), alone(model, *requests[2])]
    engine = make_engine(model)
    handles = [engine.submit(p, params) for p, params in requests]
    engine.run_until_idle()
    assert [tokens(handles[0]), tokens(handles[2])] == expected
    outs = list(handles[1])
    assert outs[-1].finish_reason == "stop"
    value = json.loads("".join(o.text for o in outs))
    assert set(value) == {"n", "ok"} and isinstance(value["ok"], bool)


def test_a_constraint_that_fails_fails_its_request_alone(model):
    class Refusing:
        """A constraint whose every state fails (as one whose grammar no token continues)."""
        def start(self):
            return self

        def allowed(self):
            raise ValueError("no token continues")

        def advance(self, token):
            raise ValueError("no token continues")

    requests = list(zip(prompts(model, [4, 6], seed=2),
                        [greedy(6, constraint=Refusing()), greedy(6)]))
    expected = alone(model, *requests[1])
    engine = make_engine(model)
    handles = [engine.submit(p, params) for p, params in requests]
    engine.run_until_idle()
    first, second = outcome(handles[0]), outcome(handles[1])
    assert isinstance(first, EngineFailed) and "no token continues" in str(first)
    assert second == expected and engine.error is None


# ---- the policy alone: no runner, no thread -----------------------------------------------------

def sequences(model, lengths, max_tokens=8):
    out = [Sequence.create(i, [5] * n, greedy(max_tokens), max_tokens, model.tokenizer)
           for i, n in enumerate(lengths)]
    for seq in out:
        seq.last_token_time = 0.0
    return out


def test_the_scheduler_decodes_first_then_chunks_prompts_within_the_budget(model):
    s = Scheduler(num_blocks=64, block_size=4, max_seqs=4, step_tokens=16, table_width=16,
                  vocab_size=model.tokenizer.vocab_size)
    a, b, c = sequences(model, [10, 30, 3])
    for seq in (a, b, c):
        s.add(seq)
    plan = s.schedule()
    assert [(q.seq_id, n) for q, n in plan] == [(0, 10), (1, 6)]   # c waits for the budget
    batch, sampled = s.build(plan)
    assert len(batch.tokens) == 16 and sampled == [a]               # b's chunk samples nothing
    s.computed(plan)
    s.accept(a, 7, None, 0.0, 64)
    plan = s.schedule()
    assert [(q.seq_id, n) for q, n in plan] == [(0, 1), (1, 15)]    # a's token first
    assert s.prompt_tokens_total == 43 and s.generation_tokens_total == 1


def test_the_scheduler_preempts_the_latest_arrival_and_never_one_in_flight(model):
    s = Scheduler(num_blocks=6, block_size=4, max_seqs=4, step_tokens=64, table_width=6,
                  vocab_size=model.tokenizer.vocab_size)
    a, b = sequences(model, [12, 8])            # 3 + 2 blocks of 6
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.computed(plan)
    for seq in (a, b):
        s.accept(seq, 7, None, 0.0, 64)
    a.tokens += [7] * 4                         # a needs two more blocks; b's are the only ones
    a.num_computed = len(a.tokens) - 1
    s.launched([(b, 1)])                        # b's step is in flight: a cannot take its blocks
    landed = []
    assert s.schedule(make_room=lambda: landed.append(1) and False) == [(b, 1)]
    assert landed == [1] and s.preemptions_total == 0
    s.released([(b, 1)])
    plan = s.schedule()
    assert [q.seq_id for q, _ in plan] == [0] and s.waiting == [b] and b.num_computed == 0
    assert s.preemptions_total == 1 and b.blocks == []
