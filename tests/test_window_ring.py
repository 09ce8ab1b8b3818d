"""Sliding-window layers' keys in a ring a sequence (engine/kvcache.py: Ring).

A tiny random Gemma 2 and 3 (window 8) serve prompts and generations many windows long, in
several prefill chunks and beside each other, with their window layers' caches a ring of a few
blocks that wraps again and again: their logits and greedy tokens are those of the same model
with every layer's cache whole (the reference interpreter, and each device backend that opens
here). The plan counts the rings once and the global layers' blocks at full context, so the
same memory serves more; the scheduler takes a ring on admission and gives it back on finish,
abort and preemption.
"""
import numpy as np
import pytest

import poot
from poot.engine import plan
from poot.engine.batch import SamplingRows, StepBatch
from poot.engine.device_runner import DeviceRunner
from poot.engine.engine import Engine
from poot.engine.kvcache import Ring, blocks_for, ring_for, ring_tensors
from poot.engine.request import SamplingParams
from poot.models.random_weights import write_random_gemma
from tests.conftest import open_or_skip
from tests.models import tiny_model

ARCHS = ("gemma2", "gemma3")
BLOCK = 16
CHUNK = 26          # the most tokens of one sequence a step computes: 33 positions, 3 blocks


def tiny_gemma(tmp_path, arch, context=512):
    path = tmp_path / f"ring-{arch}-{context}.gguf"
    if not path.exists():
        write_random_gemma(path, arch, dtype="F16", seed=3, context=context)
    return poot.load(path)


def ring(rings=3, chunk=CHUNK):
    return Ring(window=8, block_size=BLOCK, chunk=chunk, rings=rings)


def test_a_ring_holds_the_window_and_a_chunk():
    r = Ring(window=4096, block_size=16, chunk=1, rings=2)
    assert r.length == 4096 // 16 and r.num_blocks == 2 * r.length     # decode alone
    r = Ring(window=8, block_size=16, chunk=CHUNK, rings=3)
    assert r.length == 3 and ring(3).length == 3
    assert Ring(window=8, block_size=16, chunk=25, rings=3).length == 2
    assert r.table(1, 8).tolist() == [3, 4, 5, 3, 4, 5, 3, 4]
    assert ring_for(0, 16, 4, 16, 4096) is None                  # no window layers
    assert ring_for(512, 16, 4, 512, 1024) is None               # it would save nothing
    assert ring_for(512, 16, 4, 512, 4096).length == 64


def collides(length, window, chunk, block=4):
    """Whether some step of a sequence computing `chunk` tokens from some start, its window
    layers in a ring of `length` blocks, writes a slot that one of its tokens reads for
    another position of its window."""
    table = np.arange(200) % length
    for start in range(120):
        written = {table[p // block] * block + p % block: p for p in range(start, start + chunk)}
        for p in range(start, start + chunk):
            for j in range(max(0, p - window + 1), p + 1):
                if written.get(table[j // block] * block + j % block, j) != j:
                    return True
    return False


@pytest.mark.parametrize("chunk", [1, 3, 5, 16, 40])
def test_no_write_of_a_step_reaches_what_its_tokens_read(chunk):
    """...and with a block less, one does."""
    for window in (1, 7, 8, 9, 33):
        length = Ring(window=window, block_size=4, chunk=chunk, rings=1).length
        assert not collides(length, window, chunk)
        assert length == 1 or collides(length - 1, window, chunk)


def batch_of(parts, ring_=None, width=32):
    """One step of (row, start, tokens, table) parts, every token's logits sampled."""
    tokens = np.concatenate([np.array(t, np.int32) for _, _, t, _ in parts])
    positions = np.concatenate([np.arange(s, s + len(t), dtype=np.int32)
                                for _, s, t, _ in parts])
    rows = np.concatenate([np.full(len(t), r, np.int32) for r, _, t, _ in parts])
    tables = np.zeros((max(r for r, *_ in parts) + 1, width), np.int32)
    windows = None if ring_ is None else np.zeros_like(tables)
    for r, _, _, table in parts:
        tables[r, :len(table)] = table
        if ring_ is not None:
            windows[r] = ring_.table(r, width)
    return StepBatch(tokens, positions, rows, tables, np.arange(len(tokens), dtype=np.int32),
                     SamplingRows.greedy(len(tokens)), window_tables=windows)


def mixed_steps(vocab, seed=0):
    """Three sequences (150, 90 and 40 tokens: 19, 11 and 5 windows) in steps of up to CHUNK
    tokens each (half of them whole chunks, from any offset in a block), prefill chunks of one
    beside decode tokens of another, each with its own shuffled global blocks."""
    rng = np.random.default_rng(seed)
    lengths = (150, 90, 40)
    seqs = [rng.integers(3, vocab, n).tolist() for n in lengths]
    tables = np.split(rng.permutation(32)[:30], 3)
    done, steps = [0, 0, 0], []
    while any(d < n for d, n in zip(done, lengths)):
        parts = []
        for row, (seq, table) in enumerate(zip(seqs, tables)):
            n = CHUNK if rng.random() < 0.5 else int(rng.integers(1, CHUNK))
            n = min(n, len(seq) - done[row])
            if n > 0 and rng.random() < 0.8:
                parts.append((row, done[row], seq[done[row]:done[row] + n], table.tolist()))
                done[row] += n
        if parts:
            steps.append(parts)
    return steps


@pytest.mark.parametrize("arch", ARCHS)
def test_the_reference_with_rings_gives_the_whole_caches_logits(tmp_path, arch):
    model = tiny_gemma(tmp_path, arch)
    r = ring()
    whole, ringed = model.runner(None, num_blocks=32), model.runner(None, num_blocks=32, ring=r)
    assert ringed.graph.inputs["window_tables"].shape == ("S", "B")
    assert len(ring_tensors(ringed.graph)) == 2 * sum(model.config.sliding)
    for name in ring_tensors(ringed.graph):
        ringed.interpreter.state[name][:] = np.nan      # nothing read before it is written
    for parts in mixed_steps(model.config.vocab_size):
        want = whole.logits(batch_of(parts))
        got = ringed.logits(batch_of(parts, r))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_models_without_window_layers_have_no_ring(tmp_path):
    model = poot.load(tiny_model(tmp_path))
    assert model.window == 0
    assert "window_tables" not in model.runner(None, num_blocks=8).graph.inputs
    assert plan.ring_of(model, plan.Candidate(4, 512, 128)) is None


def serve(runner, model, prompts, params, max_seqs=3):
    engine = Engine(runner, model.tokenizer, max_seqs=max_seqs, step_tokens=CHUNK * 2)
    handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
    engine.run_until_idle()
    assert engine.kv.num_used == 0
    if engine.scheduler.rings is not None:
        assert engine.scheduler.rings.num_free == engine.scheduler.ring.rings
    return [[t for o in h for t in o.token_ids] for h in handles], \
        [[o.logprobs for o in h] for h in handles]


def requests(vocab):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, vocab, n).tolist() for n in (120, 9, 70, 33)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0)
              for m in (30, 60, 12, 40)]
    return prompts, params


@pytest.mark.parametrize("arch", ARCHS)
def test_an_engine_with_rings_serves_the_whole_caches_tokens(tmp_path, arch):
    """Four requests, three at a time (the last waits for a ring), chunked prefill beside
    decode: the greedy tokens and their log probabilities of the whole-cache engine."""
    model = tiny_gemma(tmp_path, arch)
    prompts, params = requests(model.config.vocab_size)
    want, want_lp = serve(model.runner(None, num_blocks=64), model, prompts, params)
    got, got_lp = serve(model.runner(None, num_blocks=64, ring=ring()), model, prompts, params)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=1e-4)


@pytest.fixture(scope="module", params=["ptx", "rocm", "vulkan", "wgpu"])
def device(request):
    return open_or_skip(request.param)


def device_runner(model, device, ring_=None, max_tokens=CHUNK * 3, max_seqs=3, **kw):
    runner = DeviceRunner(model, device, 64, BLOCK, max_tokens, max_seqs, ring=ring_, **kw)
    runner.allocate()
    runner.upload()
    return runner


@pytest.mark.parametrize("arch", ARCHS)
def test_a_device_with_rings_gives_the_whole_caches_logits(tmp_path, device, arch):
    """The mixed steps on the device (its caches poisoned first), whole attention and attention
    split every 16 tokens, against the reference's whole caches."""
    model = tiny_gemma(tmp_path, arch)
    r = ring()
    whole = model.runner(None, num_blocks=64)
    rows = CHUNK * 3                    # every token of a step sampled
    runners = [device_runner(model, device, r, max_seqs=rows),
               device_runner(model, device, r, max_seqs=rows, split_tokens=16)]
    for runner in runners:
        for name in ring_tensors(runner.graph):
            nbytes = next(a.nbytes for a in runner.allocations() if a.name == name)
            device.write(runner.buffers[name], np.full(nbytes // 2, 0x7E00, np.uint16))  # NaN
    for parts in mixed_steps(model.config.vocab_size, seed=1):
        want = whole.logits(batch_of(parts, width=64))
        for runner in runners:
            got = runner.logits(batch_of(parts, r, width=runner.table_width))
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-3   # f16 caches


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_groups_parts_with_rings_give_the_whole_caches_logits(tmp_path, kind, arch):
    """Two ranks on one Vulkan device (tests/test_group.py): each part's window layers keep
    their rings, read through the same window tables."""
    from poot.engine.group import GroupRunner
    from tests.test_group import OneDeviceGroup
    model = tiny_gemma(tmp_path, arch)
    r = ring()
    parts = GroupRunner(model, OneDeviceGroup(open_or_skip("vulkan")), kind, 64, BLOCK,
                        max_tokens=CHUNK * 3, max_seqs=CHUNK * 3, ring=r)
    parts.allocate()
    parts.upload()
    assert all(ring_tensors(runner.graph) for runner in parts.runners)
    whole = model.runner(None, num_blocks=64)
    for steps in mixed_steps(model.config.vocab_size, seed=2)[:12]:
        want = whole.logits(batch_of(steps, width=64))
        got = parts.logits(batch_of(steps, r, width=parts.runners[0].table_width))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_a_device_engine_with_rings_serves_the_reference_tokens(tmp_path, device, arch):
    model = tiny_gemma(tmp_path, arch)
    prompts, params = requests(model.config.vocab_size)
    want, _ = serve(model.runner(None, num_blocks=64), model, prompts, params)
    got, _ = serve(device_runner(model, device, ring(chunk=CHUNK * 2)), model, prompts, params)
    assert got == want


def overhead(model, device, candidate):
    """A candidate's weights and arenas on the device (its allocator's rounding included), so
    that a test's memory is that and the cache's share."""
    f = plan.footprint(plan.runner_for(model, device, candidate))
    return f.weights + f.arenas


def test_the_plan_serves_more_with_rings(tmp_path, monkeypatch):
    """The same memory: with rings, a longer context or more sequences than with every layer's
    cache whole; the state counted is the global layers' blocks and the rings."""
    device = open_or_skip("vulkan")
    model = tiny_gemma(tmp_path, "gemma3", context=8192)
    cfg = model.config
    shape = plan.Candidate(8, 8192, 128, rings=True)
    assert plan.ring_of(model, plan.Candidate(8, 8192, 128)) is None
    assert plan.variants(model, plan.Candidate(8, 8192, 128))[1] == shape
    r = plan.ring_of(model, shape)
    assert r is not None and r.rings == 8 and r.length == blocks_for(8 + 128 - 1, 16)
    per_token = 2 * cfg.n_kv_heads * cfg.head_dim * 2     # f16 keys and values, one layer
    f = plan.footprint(plan.runner_for(model, device, shape))
    n_global = cfg.n_layers - sum(cfg.sliding)
    assert f.state >= per_token * (n_global * shape.kv_blocks * 16 + sum(cfg.sliding)
                                   * r.num_blocks * 16)
    base = overhead(model, device, plan.Candidate(8, 8192, 128))

    def chosen(state):
        return plan.plan(model, device, base + state, "a test", max_seqs=8,
                         step_tokens=128).require().candidate
    ringed = [chosen(7 << 19), chosen(18 << 20)]
    monkeypatch.setattr(type(model), "window", property(lambda self: 0))
    whole = [chosen(7 << 19), chosen(18 << 20)]
    # one global layer in six: with rings, 3.5 MiB of cache serves a longer context, and 18 MiB
    # a full context for every sequence where whole caches share less than a third of that
    assert ringed[0].context > whole[0].context and ringed[0].rings
    assert ringed[1].context == whole[1].context == 8192
    assert ringed[1].kv_blocks == ringed[1].full_blocks > 3 * whole[1].kv_blocks
    assert ringed[1].rings and not whole[1].rings


def test_the_plan_keeps_shared_blocks_where_rings_would_leave_fewer(tmp_path):
    """64 sequences of a 512-token context: 64 rings of 9 blocks in each window layer take more
    than sequences that share blocks as they grow, in little memory; with room for every
    sequence's whole context, rings leave the global layer more."""
    device = open_or_skip("vulkan")
    model = tiny_gemma(tmp_path, "gemma3")

    base = overhead(model, device, plan.Candidate(64, 512, 128))

    def chosen(state):
        return plan.plan(model, device, base + state, "a test", max_seqs=64,
                         step_tokens=128).require().candidate
    tight, roomy = chosen(2 << 20), chosen(36 << 20)
    assert not tight.rings and roomy.rings and roomy.kv_blocks == roomy.full_blocks
    assert plan.ring_of(model, tight) is None and plan.ring_of(model, roomy).length == 9


# -- the scheduler: a ring a running sequence, given back whenever it stops running ------------
def ring_engine(model, num_blocks=64, max_seqs=3, step_tokens=12, faults=None, **kw):
    """A reference engine of blocks of 4, its window layers in rings of 5 blocks (window 8,
    chunks of 12)."""
    r = Ring(window=8, block_size=4, chunk=step_tokens, rings=max_seqs)
    runner = model.runner(None, num_blocks=num_blocks, block_size=4, ring=r)
    runner.faults = faults
    return Engine(runner, model.tokenizer, max_seqs=max_seqs, step_tokens=step_tokens, **kw)


def alone(model, prompt, params):
    engine = Engine(model.runner(None, num_blocks=128, block_size=4), model.tokenizer)
    return [t for o in engine.generate(prompt, params) for t in o.token_ids]


def all_free(engine):
    s = engine.scheduler
    return (s.kv.num_used == 0 and s.rings.num_free == s.ring.rings
            and all(seq.ring is None for seq in s.running + s.waiting))


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return tiny_gemma(tmp_path_factory.mktemp("ring"), "gemma3")


def test_preempted_sequences_give_back_their_rings_and_resume_with_the_same_tokens(gemma3):
    """30 blocks of 4 hold 120 tokens of the global layer; four requests need about 260: the
    latest are preempted (ring and blocks given back) and resume, each with the tokens it gets
    alone with whole caches."""
    rng = np.random.default_rng(7)
    requests = [(rng.integers(3, 300, n).tolist(), greedy(m))
                for n, m in ((40, 30), (25, 40), (50, 20), (10, 45))]
    engine = ring_engine(gemma3, num_blocks=30)
    assert engine.scheduler.ring.length == 5 and not engine.prefix_caching
    handles = [engine.submit(p, q) for p, q in requests]
    engine.run_until_idle()
    assert [[t for o in h for t in o.token_ids] for h in handles] == \
        [alone(gemma3, p, q) for p, q in requests]
    assert engine.stats().preemptions_total > 0 and all_free(engine)


def test_finished_and_cancelled_sequences_give_back_their_rings(gemma3):
    """Two rings: a third request waits until a sequence is cancelled, then runs in its ring;
    the rest finish, and every ring is free."""
    engine = ring_engine(gemma3, max_seqs=2)
    s = engine.scheduler
    a, b, c = (engine.submit(list(range(k, k + 20)), greedy(30)) for k in (3, 40, 80))
    while len(s.running) < 2:
        engine.step()
    assert s.rings.num_free == 0 and {seq.ring for seq in s.running} == {0, 1}
    assert [seq.ring for seq in s.waiting] == [None]
    held = s.running[0].ring
    a.cancel()
    engine.step()
    assert s.rings.num_free == 1 or s.running[-1].ring == held      # a's ring, free or c's
    while len(s.running) < 2:
        engine.step()
    assert [seq.ring for seq in s.running] == [1 - held, held]      # c took a's ring
    assert [o for o in a][-1].finish_reason == "abort"
    engine.run_until_idle()
    assert [o for o in b][-1].finish_reason == [o for o in c][-1].finish_reason == "length"
    assert all_free(engine)


def test_n_choices_and_repeated_prompts_compute_their_prompts_whole(gemma3):
    """No block is shared where window layers keep rings: n choices give the tokens of their
    seeds alone, a repeated prompt takes nothing from a prefix cache, and everything is
    given back."""
    import dataclasses
    prompt = np.random.default_rng(2).integers(3, 300, 37).tolist()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    engine = ring_engine(gemma3)
    handle = engine.submit(prompt, params, n=3)
    engine.run_until_idle()
    outs = list(handle)
    assert [[t for o in outs if o.index == j for t in o.token_ids] for j in range(3)] == \
        [alone(gemma3, prompt, dataclasses.replace(params, seed=5 + j)) for j in range(3)]
    again = [t for o in engine.generate(prompt, greedy(5)) for t in o.token_ids]
    assert again == alone(gemma3, prompt, greedy(5))
    assert engine.stats().prefix_cache_hit_tokens_total == 0 and all_free(engine)


def test_failed_steps_give_back_their_sequences_rings(gemma3):
    from poot.engine.faults import Faults
    from poot.engine.request import EngineFailed
    rng = np.random.default_rng(6)
    requests = [(rng.integers(3, 300, n).tolist(), greedy(m))
                for n, m in ((3, 8), (30, 5), (17, 9), (40, 6), (5, 7))]
    faults = Faults(every=9)
    engine = ring_engine(gemma3, max_seqs=2, step_tokens=8, faults=faults)
    handles = [engine.submit(p, q) for p, q in requests]
    engine.run_until_idle()
    failed = 0
    for h, (p, q) in zip(handles, requests):
        try:
            assert [t for o in h for t in o.token_ids] == alone(gemma3, p, q)
        except EngineFailed:
            failed += 1
    assert faults.injected >= 1 and 0 < failed < len(requests) and all_free(engine)


def test_poot_serve_on_the_reference_gives_a_gemma_rings_and_says_so(tmp_path):
    """The reference backend's cache under --memory-limit: the rings first, the global layers'
    blocks in the rest (a 4096-token context, where whole caches fit none); the startup line
    names the ring and says there is no prefix cache."""
    from types import SimpleNamespace
    from poot.serve import cli
    model = tiny_gemma(tmp_path, "gemma3", context=8192)
    args = SimpleNamespace(ctx=None, max_seqs=4, prefill_chunk=64)
    runner, shape = cli.reference_runner(model, args, 4 << 20)
    r = runner.ring
    assert r == Ring(window=8, block_size=16, chunk=64, rings=4) and r.length == 5
    assert shape["kv_blocks"] >= blocks_for(shape["context"], 16)
    from poot.errors import CapacityError
    with pytest.raises(CapacityError):          # whole caches: not even one context fits
        cli.reference_blocks(model, shape["context"], 4, 4 << 20)
    engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=64)
    assert not engine.prefix_caching and engine.scheduler.ring == r
    assert "ring of 5 blocks a sequence (window 8), so no prefix cache" in cli.ring_note(runner)
    assert cli.ring_note(poot.load(tiny_model(tmp_path)).runner(None, num_blocks=4)) == ""


def test_the_reference_keeps_shared_blocks_where_rings_would_leave_fewer(tmp_path):
    from types import SimpleNamespace
    from poot.serve import cli
    model = tiny_gemma(tmp_path, "gemma3")            # 512 tokens: rings of 5 for 64 sequences
    args = SimpleNamespace(ctx=None, max_seqs=64, prefill_chunk=64)
    assert cli.reference_runner(model, args, 2 << 20)[0].ring is None
    assert cli.reference_runner(model, args, None)[0].ring.rings == 64
