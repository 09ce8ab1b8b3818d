"""The engine over the real reference runner and a tiny random Llama: batching, chunked prefill,
paged KV with preemption, stop conditions, seeds, cancellation and failure.

The recurring check is that a request's tokens do not depend on what else is in flight: greedy
(or seeded) outputs in a batch, after preemption, or on the engine thread equal the same request
run alone.
"""
import dataclasses
import threading

import numpy as np
import pytest

import poot
from tests.models import tiny_model
from poot.engine.batch import SamplingRows, StepBatch
from poot.engine.faults import Faults
from poot.engine.engine import Engine
from poot.engine.request import (EngineFailed, InvalidRequest, SamplingParams, Sequence,
                                 StopText, Usage)
from poot.engine.sampling import best, log_softmax
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
    assert a.seeds != b.seeds              # no seed: a fresh random one per request


def test_a_stop_string_ends_the_text_before_it(model):
    prompt = prompts(model, [4], seed=2)[0]
    full = "".join(o.text for o in make_engine(model).generate(prompt, greedy(24)))
    assert len(full) >= 8, f"the tiny model wrote too little text: {full!r}"
    stop = full[len(full) // 2:len(full) // 2 + 3]
    outs = list(make_engine(model).generate(prompt, greedy(24, stop=("\x00never", stop))))
    assert "".join(o.text for o in outs) == full[:full.index(stop)]
    assert outs[-1].finish_reason == "stop"


def test_a_stop_string_found_while_the_next_step_runs_drops_its_token_and_frees_its_blocks(
        model):
    """The engine launches a sequence's next step before it decodes the text of the token
    just landed: a stop string found in that text ends the sequence with its next step in
    flight. That step's token is dropped, its blocks are freed once it lands, and the request
    beside it writes what it writes alone."""
    prompt, other = prompts(model, [5, 9], seed=4)
    texts = [o.text for o in make_engine(model).generate(prompt, greedy(24))]
    k = next(k for k in range(2, len(texts)) if texts[k] and
             ("".join(texts[:k]) + texts[k]).find(texts[k]) == len("".join(texts[:k])))
    engine = make_engine(model)
    stopped = engine.submit(prompt, greedy(24, stop=(texts[k],)))
    beside = engine.submit(other, greedy(30))
    outs, in_flight = [], []

    def listener(handle, out):
        outs.append(out)
        in_flight.append(handle.seq_ids[0] in engine.scheduler.in_flight)
    stopped.listen(listener)
    engine.run_until_idle()
    assert in_flight[-1] and outs[-1].finish_reason == "stop"   # its next step ran meanwhile
    assert tokens(outs) == alone(model, prompt, greedy(24))[:k + 1]
    assert "".join(o.text for o in outs) == "".join(texts[:k])
    assert stopped.finished and stopped.usage.completion_tokens == k + 1
    assert tokens(beside) == alone(model, other, greedy(30))
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0
    assert engine.stats().generation_tokens_total == k + 1 + 30


def test_min_tokens_holds_off_stop_strings(model):
    """vLLM's min_tokens: a stop string ends the reply only from the n-th token on."""
    prompt = prompts(model, [4], seed=2)[0]
    texts = [o.text for o in make_engine(model).generate(prompt, greedy(24))]
    full = "".join(texts)
    k = next(k for k in range(2, 20) if texts[k] and full.count(texts[k]) == 1)
    stop = texts[k]
    held = list(make_engine(model).generate(prompt, greedy(24, stop=(stop,), min_tokens=k + 2)))
    assert "".join(o.text for o in held) == full and held[-1].finish_reason == "length"
    armed = list(make_engine(model).generate(prompt, greedy(24, stop=(stop,), min_tokens=k + 1)))
    assert "".join(o.text for o in armed) == "".join(texts[:k])
    assert armed[-1].finish_reason == "stop"


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


# ---- n choices of a prompt, several prompts, the prompt's log probabilities -----------------

class Counting:
    """A reference runner that counts the tokens its steps compute and checks that no step
    has more rows than `max_rows`."""

    def __init__(self, runner, max_rows=None):
        self.runner, self.max_rows, self.computed, self.rows = runner, max_rows, 0, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, batch):
        self.computed += len(batch.tokens)
        self.rows.append(len(batch.sample_tokens))
        assert self.max_rows is None or self.rows[-1] <= self.max_rows
        self.runner.launch(batch)


def counting_engine(model, num_blocks=64, max_rows=None, **kw):
    runner = Counting(model.runner(num_blocks=num_blocks, block_size=4), max_rows)
    return Engine(runner, model.tokenizer, **kw), runner


def choices(outputs, count):
    """Each choice's tokens, by Output.index."""
    return [[t for o in outputs if o.index == i for t in o.token_ids] for i in range(count)]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("length", [13, 12])
def test_n_choices_are_the_requests_of_seeds_seed_plus_j_and_compute_the_prompt_once(
        model, caching, temperature, length):
    """n = 4 of a seeded request: choice j gives the tokens of the request alone with seed
    seed + j. The first computes the prompt; the others take its full blocks (held for them,
    not through the prefix cache) and compute only the rest: the 13-token prompt's last token,
    the 12-token prompt's last block (a choice computes at least its last prompt token).
    Usage counts the prompt once; every block is free after."""
    prompt = prompts(model, [length], seed=9)[0]
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=41, ignore_eos=True)
    expected = [alone(model, prompt, dataclasses.replace(params, seed=41 + j)) for j in range(4)]
    engine, runner = counting_engine(model, prefix_caching=caching)
    handle = engine.submit(prompt, params, n=4)
    engine.run_until_idle()
    outs = list(handle)
    assert choices(outs, 4) == expected
    if temperature:
        assert len({tuple(e) for e in expected}) == 4
    assert [o.finish_reason for o in outs if o.finish_reason] == ["length"] * 4
    assert handle.finished and handle.usage == Usage(length, 32, 0)
    rest = length - (length - 1) // 4 * 4
    assert runner.computed == length + 3 * rest + 4 * 7     # each choice's 7 fed back
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == 64
    assert stats.prefix_cache_hit_tokens_total == 0 and stats.prompt_tokens_total == length


def test_a_fork_holds_the_prompt_for_its_choices_after_the_first_has_finished(model):
    """max_tokens 1 without a prefix cache: the first choice ends at its first token and frees
    its blocks, yet the others still take the prompt's full blocks from the fork's hold."""
    prompt = prompts(model, [21], seed=2)[0]
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=5)
    engine, runner = counting_engine(model, prefix_caching=False)
    handle = engine.submit(prompt, params, n=3)
    engine.run_until_idle()
    assert choices(list(handle), 3) == [
        alone(model, prompt, dataclasses.replace(params, seed=5 + j)) for j in range(3)]
    assert runner.computed == 21 + 2 * 1
    assert engine.kv.num_used == 0 and not engine.scheduler.holds


def test_n_choices_beside_others_in_a_tight_cache_give_their_tokens_and_free_every_block(
        model, monkeypatch):
    """Twelve blocks of 4 for three requests of 3 choices: sequences are preempted and forks'
    holds given back (their waiting choices then compute the prompt themselves); every choice
    still gives its tokens alone, and every block comes back."""
    dropped = []
    drop = Scheduler._drop_hold

    def counted(self, but=None):
        dropped.append(drop(self, but))
        return dropped[-1]

    monkeypatch.setattr(Scheduler, "_drop_hold", counted)
    requests = [(p, SamplingParams(max_tokens=12, temperature=0.9, seed=s, ignore_eos=True))
                for p, s in zip(prompts(model, [17, 9, 21], seed=3), (1, 2, 3))]
    expected = [[alone(model, p, dataclasses.replace(q, seed=q.seed + j)) for j in range(3)]
                for p, q in requests]
    for caching in (True, False):
        engine = make_engine(model, num_blocks=12, max_seqs=4, prefix_caching=caching)
        handles = [engine.submit(p, q, n=3) for p, q in requests]
        engine.run_until_idle()
        assert [choices(list(h), 3) for h in handles] == expected
        stats = engine.stats()
        assert stats.preemptions_total > 0 and stats.kv_blocks_used == 0
        assert stats.kv_blocks_free == 12 and not engine.scheduler.holds
    assert any(dropped)


def test_several_prompts_are_one_request_indexed_prompt_times_n_plus_choice(model):
    ps = prompts(model, [5, 14, 3], seed=11)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=8, ignore_eos=True)
    engine = make_engine(model, max_seqs=4)
    handle = engine.submit_prompts(ps, params, n=2)
    engine.run_until_idle()
    assert choices(list(handle), 6) == [alone(model, p, dataclasses.replace(params, seed=8 + j))
                                        for p in ps for j in range(2)]
    assert handle.usage == Usage(5 + 14 + 3, 36, 0)
    assert engine.stats().kv_blocks_used == 0
    with pytest.raises(InvalidRequest) as bad:
        engine.submit_prompts([ps[0], []], params)
    assert bad.value.param == "prompt" and str(bad.value).startswith("prompt 1: ")
    with pytest.raises(InvalidRequest) as bad:
        engine.submit(ps[0], params, n=17)
    assert bad.value.param == "n"


def test_cancelling_a_request_aborts_every_choice_and_frees_the_blocks(model):
    engine = make_engine(model, prefix_caching=False)
    handle = engine.submit_prompts(prompts(model, [9, 30], seed=1), greedy(40), n=3)
    handle.next_output()                    # a step or more: some choices wait still
    assert engine.stats().kv_blocks_used > 0
    handle.cancel()
    outs = list(handle)
    assert sorted(o.index for o in outs if o.finish_reason == "abort") == [
        i for i in range(6) if not any(o.index == i and o.finish_reason == "length"
                                       for o in outs)]
    assert handle.finished and engine.stats().kv_blocks_used == 0 and not engine.scheduler.holds


def reference_logprobs(model, prompt):
    """log_softmax of the reference model's logits at every position of `prompt`, float64."""
    n = len(prompt)
    batch = StepBatch(np.array(prompt, np.int32), np.arange(n, dtype=np.int32),
                      np.zeros(n, np.int32), np.array([list(range(64))], np.int32),
                      np.arange(n, dtype=np.int32), SamplingRows.greedy(n))
    logits = model.runner(num_blocks=64, block_size=4).logits(batch)
    return log_softmax(logits.astype(np.float64))


def check_prompt_logprobs(entries, prompt, expected, k):
    assert [e.token_id for e in entries] == prompt[1:]
    for p, e in enumerate(entries):
        assert e.logprob == pytest.approx(expected[p, prompt[p + 1]], abs=1e-5)
        assert [i for i, _ in e.top] == best(expected[p], k).tolist()
        assert np.allclose([lp for _, lp in e.top], expected[p, best(expected[p], k)],
                           atol=1e-5)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_are_the_log_softmax_of_the_logits_at_every_position(model,
                                                                             max_tokens):
    """Each prompt token after the first is scored by the logits of the position before it:
    every such position is a row of its step, forced to the next prompt token, so a step of a
    runner of 4 rows scores at most 4 (the 30-token prompt takes several steps beside a
    request decoding, which keeps its token each step). The prompt is computed whole, even
    where the prefix cache holds it; max_tokens 0 ends once it is scored."""
    prompt = prompts(model, [30], seed=12)[0]
    expected = reference_logprobs(model, prompt)
    engine, runner = counting_engine(model, max_rows=4, max_seqs=4, step_tokens=64)
    list(engine.generate(prompt, greedy(1)))                # the prefix cache holds it now
    hits = engine.stats().prefix_cache_hit_tokens_total
    other = engine.submit(prompts(model, [3], seed=13)[0], greedy(20))
    other.next_output()
    steps = engine.stats().steps_total
    outs = list(engine.generate(prompt, greedy(max_tokens, prompt_logprobs=5)))
    check_prompt_logprobs(outs[0].prompt_logprobs, prompt, expected, 5)
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert engine.stats().prefix_cache_hit_tokens_total == hits
    assert engine.stats().steps_total - steps >= 29 // 3     # 3 rows a step beside `other`
    assert max(runner.rows) == 4
    if max_tokens == 0:
        assert len(outs) == 1 and outs[0].finish_reason == "length" and not outs[0].token_ids
        assert outs[0].usage == Usage(30, 0, 0)
    else:
        assert tokens(outs) == alone(model, prompt, greedy(3))
    assert tokens(other) == alone(model, prompts(model, [3], seed=13)[0], greedy(20))[1:]
    assert engine.stats().kv_blocks_used == 0


def test_each_choice_reports_the_prompt_logprobs_its_first_computed(model):
    prompt = prompts(model, [10], seed=14)[0]
    expected = reference_logprobs(model, prompt)
    for max_tokens in (0, 2):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3,
                                prompt_logprobs=1)
        engine, runner = counting_engine(model, prefix_caching=False)
        outs = list(engine.submit(prompt, params, n=3))
        firsts = [next(o for o in outs if o.index == j) for j in range(3)]
        for first in firsts:
            check_prompt_logprobs(first.prompt_logprobs, prompt, expected, 1)
        assert runner.computed == 10 + 2 * 2 + (3 * (max_tokens - 1) if max_tokens else 0)
        assert engine.kv.num_used == 0


def test_max_tokens_0_without_prompt_logprobs_ends_at_once(model):
    engine = make_engine(model)
    handle = engine.submit_prompts(prompts(model, [4, 6]), SamplingParams(max_tokens=0), n=2)
    outs = list(handle)
    assert [(o.index, o.finish_reason, o.token_ids) for o in outs] == [
        (i, "length", []) for i in range(4)]
    assert handle.usage == Usage(10, 0, 0) and engine.stats().steps_total == 0


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


def test_a_failing_step_fails_a_request_of_several_sequences_whole(model):
    """A request of several prompts and choices whose step fails ends once, with the error
    last and nothing after it, though its other sequences were in other steps or waiting:
    they end with it and free their blocks."""
    faults = Faults(every=4)
    engine = faulty_engine(model, faults, max_seqs=3, step_tokens=8)
    handles = [engine.submit_prompts(prompts(model, [5, 9, 3], seed=s), greedy(6), n=2)
               for s in range(4)]
    got = [[] for _ in handles]
    for handle, items in zip(handles, got):
        handle.listen(lambda h, item, items=items: items.append((h.finished, item)))
    while engine.step():
        if faults.injected:
            faults.every = None             # one step fails
    assert faults.injected == 1
    failed = 0
    for handle, items in zip(handles, got):
        ends = [i for i, (_, item) in enumerate(items) if isinstance(item, EngineFailed)]
        assert ends in ([], [len(items) - 1]), items
        assert [f for f, _ in items].count(True) == 1 and items[-1][0], items
        failed += bool(ends)
    assert 1 <= failed < len(handles)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0


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
    emit = Sequence.emit

    def fragile(seq, *args):
        if seq.seq_id == handles[0].seq_ids[0] and seq.num_generated == 2:
            raise UnicodeError("a decoder fault")
        return emit(seq, *args)
    monkeypatch.setattr(Sequence, "emit", fragile)
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


def test_a_mask_not_yet_kept_holds_up_only_its_own_sequence(model):
    """On a threaded engine a constrained sequence whose mask is not ready (ready() False)
    sits out the steps while its mask is computed on the mask thread: the free request beside
    it decodes to its end meanwhile, and the constrained one then writes what it writes
    alone."""
    import json

    from poot.grammar import compiled, schema_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    grammar = compiled(("mask-thread", json.dumps(schema)), lambda: schema_grammar(schema),
                       model.tokenizer)
    gate = threading.Event()

    class Gated:
        """The grammar's constraint, whose masks after the first wait for `gate`."""
        def __init__(self, matcher=None):
            self.matcher, self.asked = matcher, 0

        def start(self):
            return Gated(grammar.start())

        def ready(self):
            return self.asked == 0 or gate.is_set()

        def allowed(self):
            self.asked += 1
            if self.asked > 1:
                assert threading.current_thread().name == "poot-masks" or gate.is_set()
                gate.wait()
            return self.matcher.allowed()

        def advance(self, token):
            self.matcher.advance(token)

    bound = SamplingParams(max_tokens=40, temperature=0, constraint=Gated())
    free_prompt, bound_prompt = prompts(model, [5, 6], seed=9)
    want = alone(model, bound_prompt, SamplingParams(max_tokens=40, temperature=0,
                                                     constraint=grammar))
    engine = make_engine(model)
    engine.start()
    try:
        held = engine.submit(bound_prompt, bound)
        free = engine.submit(free_prompt, greedy(24))
        assert len(tokens(free)) == 24             # while the constrained one waits
        assert engine.stats().running == 1
        gate.set()
        assert tokens(held) == want
    finally:
        gate.set()
        engine.stop()


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
    batch, rows = s.build(plan)
    assert len(batch.tokens) == 16 and rows == [(a, None)]          # b's chunk samples nothing
    s.computed(plan)
    s.accept(a, 7, 64)
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
        s.accept(seq, 7, 64)
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
