"""The device runner against the reference runner: same step graph, same batches, on every
device backend that opens here (skips with the reason elsewhere)."""
import contextlib
import math
from collections import Counter

import numpy as np
import pytest

import poot
from poot.backends.select import open_device
from poot.codegen.ptx import PTX_CAPS
from poot.engine import kernel_choice
from poot.engine.kernel_choice import DEQUANT_PAST_TOKENS, MMA_MIN_TOKENS, MULTIPROCESSORS
from poot.engine import device_choice
from poot.engine.device_runner import Allocation, DeviceRunner
from poot.engine.batch import LogitEdits, SamplingRows, StepBatch
from poot.engine.sampling import choice_args, choose, edit_logits, sample
from poot.errors import BackendUnavailable
from poot.kernels import choice, lang, matmul, ops
from poot.kernels.quant import DEVICE_DTYPES
from tests.models import default_model, tiny_model


# Two logits closer than this may come out in either order on a device (f16 KV and products).
NEAR_TIE = 0.01


def step(tokens, start, row_tables):
    """One sequence's tokens from position `start`, every token's logits sampled."""
    n = len(tokens)
    return StepBatch(np.array(tokens, np.int32), np.arange(start, start + n, dtype=np.int32),
                     np.zeros(n, np.int32), np.array([row_tables], np.int32),
                     np.arange(n, dtype=np.int32), SamplingRows.greedy(n))


def prefill_of(n):
    """One random n-token prompt in one step, its last 8 tokens sampled."""
    prompt = np.random.default_rng().integers(3, 300, n).astype(np.int32)
    return StepBatch(prompt, np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                     np.array([list(range(max(16, -(-n // 16))))], np.int32),
                     np.arange(n - 8, n, dtype=np.int32), SamplingRows.greedy(8))


def greedy(runner, prompt, n, table):
    ids, logits = list(prompt), []
    out = runner.logits(step(ids, 0, table))[-1:]
    for _ in range(n):
        logits.append(out[0])
        ids.append(int(np.argmax(out[0])))
        out = runner.logits(step(ids[-1:], len(ids) - 1, table))
    return ids[len(prompt):], np.array(logits)


@pytest.mark.parametrize("dtype", DEVICE_DTYPES)
def test_tiny_model_matches_reference(tmp_path, device, dtype):
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 24, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 24, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3   # f16 KV cache


def test_default_model_greedy_tokens_match_reference(device):
    model = poot.load(default_model())
    prompt = model.tokenizer.encode("The capital of France is")
    table = list(range(64))
    want_ids, want = greedy(model.runner(None, num_blocks=64), prompt, 32, table)
    got_ids, got = greedy(model.runner(device, num_blocks=64), prompt, 32, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


def test_batched_decode_replays_equal_single_steps(tmp_path, device):
    """Several sequences decoding together (a captured bucket, padded) give each one's logits."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    runner = model.runner(device, num_blocks=64)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9, 3)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    for p, t in zip(prompts, tables):
        runner.logits(step(p, 0, t))
    width = 16
    batch = StepBatch(np.array([p[-1] for p in prompts], np.int32),
                      np.array([len(p) for p in prompts], np.int32), np.arange(3, dtype=np.int32),
                      np.array(tables, np.int32)[:, :width], np.arange(3, dtype=np.int32),
                      SamplingRows.greedy(3))
    together = runner.logits(batch)
    reference = model.runner(None, num_blocks=64)
    for p, t in zip(prompts, tables):
        reference.logits(step(p, 0, t))
    want = reference.logits(batch)
    assert np.linalg.norm(together - want) / np.linalg.norm(want) < 2e-3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny random model with the default model's vocabulary of 49,152 tokens (24 candidate
    chunks): the device's choice over rows that long, at the cost of a tiny model's steps."""
    return poot.load(tiny_model(tmp_path_factory.mktemp("wide"), shape="tiny-wide"))


def decoding(model, device, n, monkeypatch):
    """`model` on `device` with n sequences prefilled: (its runner, a random generator, a
    function giving the StepBatch of decode step `decode` under SamplingRows, the names of the
    buffers the runner reads back, as it reads)."""
    runner = model.runner(device, num_blocks=64)
    rng = np.random.default_rng()
    tables = np.array([list(range(i * 8, i * 8 + 8)) for i in range(n)], np.int32)
    for i in range(n):
        runner.logits(step(rng.integers(3, 3000, 5 + i).tolist(), 0, tables[i]))
    reader, read = runner._read, []

    def recorded(name, nbytes, offset=0):
        read.append(name)
        return reader(name, nbytes, offset)
    monkeypatch.setattr(runner, "_read", recorded)

    def batch(decode, rows):
        return StepBatch(rng.integers(3, 3000, n).astype(np.int32),
                         np.array([5 + i + decode for i in range(n)], np.int32),
                         np.arange(n, dtype=np.int32), tables, np.arange(n, dtype=np.int32), rows)
    return runner, rng, batch, read


def test_sampled_rows_are_drawn_on_the_device(wide, device, monkeypatch):
    """Sampled rows (greedy rows beside them) take the tokens choose() gives on the same step's
    full logits, drawn on the device (choice.draw: top-k cuts of 1 to past TOP_KEEP, top-p,
    min-p, temperature alone), which reads back their tokens alone: no logits, no candidates.
    A 49k vocabulary."""
    n = 8
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    cuts = [dict(top_k=[1, 5, 0, 40, choice.TOP_KEEP, 64, 2, 3]),
            dict(top_k=[0, 0, 0, 0, 0, 0, 0, 90], top_p=[1, .9, .5, 1, .95, 1, 1, .9],
                 min_p=[0, 0, 0, .05, 0, .1, 0, 0])]
    for decode, cut in enumerate(cuts):
        rows = SamplingRows(temperature=np.array([.7, 1, 0, 1.3, .9, 2, 1, .5], np.float32),
                            top_k=np.array(cut["top_k"], np.int32),
                            top_p=np.array(cut.get("top_p", [1] * n), np.float32),
                            min_p=np.array(cut.get("min_p", [0] * n), np.float32),
                            seed=rng.integers(0, 2**63, n).astype(np.uint64),
                            step=np.arange(n, dtype=np.int64))
        batch = batch_of(decode, rows)
        read.clear()
        got = runner.step(batch).tokens
        assert read == ["argmax"], read
        logits = runner.logits(batch)   # the same step again: the same cache, the same logits
        want = [choose(logits[r], *choice_args(rows, r)) for r in range(n)]
        assert got.tolist() == want


def test_logprob_steps_take_sample_s_rows_from_candidates(wide, device, monkeypatch):
    """Steps that report log probabilities (the chosen token's and the 5 best) give sample()'s
    output on the same step's full logits: the tokens the device chose (greedy, drawn at
    temperature 1 or another), their log probabilities from the device's candidates (top-k
    cuts no longer than a chunk keeps: each token is a candidate) without reading the logits
    back."""
    n = 6
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    for decode, temperature in enumerate(([0, 1, 1, 0, 1, 1], [0, 1, 0.7, 1, 1, 0])):
        rows = SamplingRows(temperature=np.array(temperature, np.float32),
                            top_k=np.array([0, 5, 40, 20, choice.TOP_KEEP, 3], np.int32),
                            top_p=np.array([1, .9, 1, 1, 1, 1], np.float32),
                            min_p=np.array([0, 0, 0, 0, .05, 0], np.float32),
                            seed=rng.integers(0, 2**63, n).astype(np.uint64),
                            step=np.arange(n, dtype=np.int64), n_logprobs=5, logprobs=True)
        batch = batch_of(decode, rows)
        read.clear()
        got = runner.step(batch)
        assert runner._output_name() not in read, read
        want = sample(runner.logits(batch), rows)   # the same step again: the same logits
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.top_ids.tolist() == want.top_ids.tolist()
        assert np.allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-4)
        assert np.allclose(got.top_logprobs, want.top_logprobs, rtol=0, atol=1e-4)


def test_rows_that_report_no_logprobs_take_the_device_s_tokens(wide, device, monkeypatch):
    """In a step where some rows report log probabilities, the rows that do not (reports) take
    the device's token, so a sampled row at 0.7 beside them reads no logits back; each row's
    token is sample()'s, the reporting rows' log probabilities too."""
    n = 6
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    reports = np.array([True, False, False, True, False, True])
    rows = SamplingRows(temperature=np.array([0, 0.7, 1.3, 1, 0.9, 0], np.float32),
                        top_k=np.array([0, 5, 40, 7, choice.TOP_KEEP, 3], np.int32),
                        top_p=np.array([1, .9, 1, 1, 1, 1], np.float32),
                        min_p=np.array([0, 0, 0, 0, .05, 0], np.float32),
                        seed=rng.integers(0, 2**63, n).astype(np.uint64),
                        step=np.arange(n, dtype=np.int64), n_logprobs=4, logprobs=True,
                        reports=reports)        # short top-k cuts: always decided
    batch = batch_of(0, rows)
    read.clear()
    got = runner.step(batch)
    assert runner._output_name() not in read, read
    want = sample(runner.logits(batch), rows)   # the same step again: the same logits
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.top_ids[reports].tolist() == want.top_ids[reports].tolist()
    assert np.allclose(got.logprobs[reports], want.logprobs[reports], rtol=0, atol=1e-4)
    assert np.allclose(got.top_logprobs[reports], want.top_logprobs[reports], rtol=0, atol=1e-4)


def random_edits(rng, n_rows, vocab, counts, bans=None):
    """LogitEdits of n_rows rows, {row: how many edits} of random tokens: repeats both sides of
    1, adds of both signs, a tenth of them bans; `bans` {row: tokens} bans those tokens too."""
    rows = {}
    for r, count in counts.items():
        banned = np.asarray((bans or {}).get(r, []), np.int64)
        tokens = np.concatenate([banned, rng.choice(np.setdiff1d(np.arange(vocab), banned),
                                                    count - len(banned), replace=False)])
        add = rng.standard_normal(count).astype(np.float32) * 2
        add[rng.random(count) < 0.1] = -np.inf
        add[:len(banned)] = -np.inf
        rows[r] = (tokens, rng.uniform(0.5, 2, count), add)
    return LogitEdits.of(n_rows, rows)


def random_masks(rng, masked, vocab):
    """(masks, masked) of SamplingRows: the masked rows allow 40 random tokens each."""
    words = -(-vocab // 32)
    allowed = np.zeros((len(masked), words * 32), bool)
    for r in np.flatnonzero(masked):
        allowed[r, rng.choice(vocab, 40, replace=False)] = True
    masks = np.packbits(allowed, axis=1, bitorder="little").view(np.uint32)
    masks[~masked] = 0xFFFFFFFF
    return masks, masked


def test_rows_with_masks_and_edits_are_edited_on_the_device(wide, device, monkeypatch):
    """Rows with a mask (SamplingRows.masks), with edits (SamplingRows.edits: penalties, biases,
    bans), with both, beside rows with neither: the device edits the step's logits in place as
    sampling.edit_logits defines, and each row takes sample()'s token of the edited logits,
    with and without log probabilities (the rows at other temperatures than 1 reporting none),
    from the device's argmax or candidates; no row reads its logits back, so a constrained row
    costs the others nothing."""
    n = 6
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    masked = np.array([False, True, False, True, True, False])
    for decode, logprobs in enumerate((False, True)):
        rows = SamplingRows(temperature=np.array([0, 0, 0.8, 1, 0, 0.7], np.float32),
                            top_k=np.array([0, 0, 5, 10, 0, 20], np.int32),
                            top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                            seed=rng.integers(0, 2**63, n).astype(np.uint64),
                            step=np.arange(n, dtype=np.int64), n_logprobs=2 * logprobs,
                            logprobs=logprobs, reports=np.array([1, 1, 0, 1, 1, 0], bool))
        rows.masks, rows.masked = random_masks(rng, masked, runner.vocab_size)
        batch = batch_of(decode, rows)
        raw = runner.logits(StepBatch(batch.tokens, batch.positions, batch.seq_rows,
                                      batch.block_tables, batch.sample_tokens,
                                      SamplingRows.greedy(n)))
        top = np.argsort(-raw, axis=1)[:, :3]
        rows.edits = random_edits(rng, n, runner.vocab_size, {2: 300, 3: 50, 5: 20},
                                  bans={5: top[5]})
        read.clear()
        got = runner.step(batch)
        assert runner._output_name() not in read, read
        edited = runner.logits(batch)   # the same step again: the same logits, edited
        np.testing.assert_allclose(edited, edit_logits(raw, rows), rtol=3e-7, atol=0)
        want = sample(edited, rows)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert all(rows.masks[r, t // 32] >> (t % 32) & 1
                   for r, t in enumerate(got.tokens) if masked[r])
        assert got.tokens[5] not in top[5]
        if logprobs:
            reports = rows.reports
            assert np.allclose(got.logprobs[reports], want.logprobs[reports], rtol=0, atol=1e-4)
            assert got.top_ids[reports].tolist() == want.top_ids[reports].tolist()


def test_rows_whose_edits_do_not_fit_are_edited_and_sampled_on_the_host(wide, device, monkeypatch):
    """With room for 64 edits a step (4 a row), a row of 40 fits, the next row of 40 does not
    (it and its mask are left to the host: its logits are read back, edited by the definition
    and sampled), and a later row of 10 still fits: every row gets sample()'s token of the
    edited logits, and runner.logits gives every row edited."""
    n = 4
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    monkeypatch.setattr(device_choice, "EDITS_PER_ROW", 64 // runner.max_seqs)
    rows = SamplingRows(temperature=np.array([0, 1, 1, 0], np.float32),
                        top_k=np.array([0, 0, 30, 0], np.int32), top_p=np.ones(n, np.float32),
                        min_p=np.zeros(n, np.float32),
                        seed=rng.integers(0, 2**63, n).astype(np.uint64),
                        step=np.arange(n, dtype=np.int64), n_logprobs=1, logprobs=True)
    rows.masks, rows.masked = random_masks(rng, np.array([False, True, True, False]),
                                           runner.vocab_size)
    batch = batch_of(0, rows)
    raw = runner.logits(StepBatch(batch.tokens, batch.positions, batch.seq_rows,
                                  batch.block_tables, batch.sample_tokens,
                                  SamplingRows.greedy(n)))
    rows.edits = random_edits(rng, n, runner.vocab_size, {0: 40, 2: 40, 3: 10})
    read.clear()
    got = runner.step(batch)
    assert runner._edit_state() == (True, [2])
    assert read.count(runner._output_name()) == 1, read      # the host's row
    edited = runner.logits(batch)
    np.testing.assert_allclose(edited, edit_logits(raw, rows), rtol=3e-7, atol=0)
    want = sample(edited, rows)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert np.allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-4)


def test_staged_steps_give_the_reference_tokens(tmp_path, device, monkeypatch):
    """Steps whose inputs and greedy tokens pass through the device's host_array memory,
    copied by the step itself (recorded with its launches): ptx and a discrete GPU's vulkan do
    it by default; a host-mapped device (lavapipe) is made to here. Three sequences prefill,
    then decode together (a recorded bucket, padded), against the reference's tokens."""
    if not hasattr(device, "host_array"):
        pytest.skip(f"{device.backend}: no host_array")
    monkeypatch.setattr(device, "step_staging", True)
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    runners = [model.runner(None, num_blocks=64), model.runner(device, num_blocks=64)]
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 9, 3)]
    tables = np.array([list(range(i * 16, i * 16 + 16)) for i in range(3)], np.int32)
    got = []
    for runner in runners:
        ids = [list(p) for p in prompts]
        for p, t in zip(ids, tables):
            s = step(p, 0, t)
            last = StepBatch(s.tokens, s.positions, s.seq_rows, s.block_tables,
                             s.sample_tokens[-1:], SamplingRows.greedy(1))
            p.append(int(runner.step(last).tokens[0]))
        for _ in range(6):
            batch = StepBatch(np.array([p[-1] for p in ids], np.int32),
                              np.array([len(p) - 1 for p in ids], np.int32),
                              np.arange(3, dtype=np.int32), tables, np.arange(3, dtype=np.int32),
                              SamplingRows.greedy(3))
            for p, token in zip(ids, runner.step(batch).tokens):
                p.append(int(token))
        got.append(ids)
    assert got[1] == got[0]


def test_staged_tables_as_wide_as_each_step_give_the_reference_tokens(tmp_path, device,
                                                                      monkeypatch):
    """An engine over staged steps whose block tables are as wide as the step's longest
    sequence (their width growing, then shrinking as long sequences end): the reference's
    greedy tokens, and the staged tables hold nothing past each row's width."""
    from poot.engine.engine import Engine
    from poot.engine.request import SamplingParams
    if not hasattr(device, "host_array"):
        pytest.skip(f"{device.backend}: no host_array")
    monkeypatch.setattr(device, "step_staging", True)
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in (70, 5, 33, 2, 51)]
    lengths = [4, 30, 12, 25, 3]
    got = []
    for on in (None, device):
        runner = model.runner(on, num_blocks=96, block_size=4, max_seqs=4)
        engine = Engine(runner, model.tokenizer, max_seqs=4, max_context=160)
        handles = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0,
                                                   ignore_eos=True))
                   for p, n in zip(prompts, lengths)]
        while engine.step():
            if on is not None:
                host = runner._host["block_tables"].reshape(runner.max_seqs, -1)
                for r, width in enumerate(runner._tables_written["block_tables"]):
                    assert not host[r, width:].any()
        got.append([[t for o in h for t in o.token_ids] for h in handles])
    assert got[1] == got[0]
    assert [len(t) for t in got[1]] == lengths


def test_every_backend_refuses_a_launch_of_an_empty_grid(device):
    from poot.backends import EmptyLaunch
    kernel = ops.elementwise("add")
    buffers = [device.alloc(64) for _ in range(3)]
    program = device.program(kernel)
    for grid in ((0,), (4, 0), (1, 1, 0)):
        with pytest.raises(EmptyLaunch, match="empty grid"):
            device.launch(program, kernel, grid, (*buffers, 16, 16))
    device.launch(program, kernel, (1,), (*buffers, 16, 16))
    device.synchronize()
    for b in buffers:
        device.free(b)


@contextlib.contextmanager
def launches_recorded(device):
    """The names of the kernels the device launches meanwhile, in order (it launches them as
    ever)."""
    launched, launch = [], device.launch

    def recorded(program, kernel, grid, args):
        launched.append(kernel.name)
        return launch(program, kernel, grid, args)
    device.launch = recorded
    try:
        yield launched
    finally:
        del device.launch


def test_a_step_that_samples_no_row_launches_nothing_empty(tmp_path, device):
    """A prompt's chunk before its last samples no row: such a step computes no logits (no
    gather, head or argmax) and every launch it makes has work, as every backend refuses an
    empty grid (backends.workgroups)."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    runner = model.runner(device, num_blocks=16, max_tokens=32)
    with launches_recorded(device) as launched:
        s = step(list(range(3, 23)), 0, list(range(16)))
        out = runner.step(StepBatch(s.tokens, s.positions, s.seq_rows, s.block_tables,
                                    np.zeros(0, np.int32), SamplingRows.greedy(0)))
    assert out.tokens.shape == (0,) and launched
    assert not any("argmax" in name or "gather" in name for name in launched), launched


def test_engine_serves_prompts_of_several_chunks(tmp_path, device):
    """Prompts longer than a step's token budget prefill in chunks (the steps before a prompt's
    last chunk sample nothing): alone, beside sequences decoding and beside other long prompts,
    each request's greedy tokens are those of the reference engine's run of it alone."""
    from poot.engine.request import SamplingParams
    from poot.engine.engine import Engine
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    # a fixed draw: a random model's greedy tokens from f16 caches can part from float32's at a
    # near-tie, which a fresh draw meets now and then (seen once on wgpu in CI)
    rng = np.random.default_rng(5)
    lengths, new = (100, 7, 70, 5, 130), (6, 12, 5, 9, 4)
    prompts = [rng.integers(3, 300, n).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in new]

    def served(runner, together):
        engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32)
        if not together:
            return [[t for o in engine.generate(p, q) for t in o.token_ids]
                    for p, q in zip(prompts, params)]
        handles = [engine.submit(p, q) for p, q in zip(prompts[:2], params[:2])]
        engine.step()
        engine.step()                   # the short one decodes while the long one prefills
        handles += [engine.submit(p, q) for p, q in zip(prompts[2:], params[2:])]
        engine.run_until_idle()
        assert engine.kv.num_used == 0
        return [[t for o in h for t in o.token_ids] for h in handles]

    want = served(model.runner(None, num_blocks=64), together=False)
    runner = model.runner(device, num_blocks=64, max_tokens=32, max_seqs=4)
    assert served(runner, together=False) == want
    assert served(runner, together=True) == want


def test_penalties_biases_and_min_tokens_give_the_reference_engines_tokens(tmp_path, device):
    """Requests with penalties, logit biases (a ban among them) and min_tokens, greedy and
    seeded, batched on the device (their edits applied there), give the tokens the reference
    engine gives each alone; min_tokens holds off the end-of-sequence token that a bias of +50
    makes the greedy choice, until its fifth token."""
    from poot.engine.request import SamplingParams
    from poot.engine.engine import Engine
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng(8)            # a fixed draw, as in the tests above
    prompts = [rng.integers(3, 300, n).tolist() for n in (9, 30, 5, 14)]
    eos = min(model.tokenizer.eos_ids)
    params = [SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8,
                             frequency_penalty=0.5, presence_penalty=0.4, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 50.0},
                             min_tokens=5),
              SamplingParams(max_tokens=10, temperature=0.9, seed=7, top_k=40,
                             frequency_penalty=-1.5, logit_bias={17: 4.0, 18: -100.0},
                             ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    alone = Engine(model.runner(None, num_blocks=64), model.tokenizer)
    want = [[t for o in alone.generate(p, q) for t in o.token_ids]
            for p, q in zip(prompts, params)]
    assert want[1][5:] == [eos] and eos not in want[1][:5] and 18 not in want[2]
    runner = model.runner(device, num_blocks=64, max_tokens=32, max_seqs=4)
    engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32)
    with launches_recorded(device) as launched:
        plain = engine.submit(prompts[3], params[3])
        engine.run_until_idle()
        assert "logit_edits" not in launched        # steps without edits launch nothing more
        assert [t for o in plain for t in o.token_ids] == want[3]
        handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
        engine.run_until_idle()
    assert [[t for o in h for t in o.token_ids] for h in handles] == want
    assert "logit_edits" in launched
    if "capture" in device.features:      # a bucket's decode steps recorded with and without
        assert {key.edited for key in runner.graphs} == {False, True}


def test_prompts_sharing_a_start_read_its_cached_blocks_on_the_device(tmp_path, device):
    """Prefix caching on a device: requests whose prompts share a 48-token start take its KV
    blocks (three of 16) from the one that computed it, read through their block tables, and
    give the greedy tokens the reference engine gives each alone."""
    from poot.engine.engine import Engine
    from poot.engine.request import SamplingParams
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng(6)        # a fixed draw, as in the test above
    start = rng.integers(3, 300, 48).tolist()
    prompts = [start + rng.integers(3, 300, n).tolist() for n in (5, 9, 1, 20)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = Engine(model.runner(None, num_blocks=64), model.tokenizer)
    want = [[t for o in alone.generate(p, params) for t in o.token_ids] for p in prompts]
    engine = Engine(model.runner(device, num_blocks=64, max_tokens=32, max_seqs=4),
                    model.tokenizer, max_seqs=4, step_tokens=32)
    first = [t for o in engine.generate(prompts[0], params) for t in o.token_ids]
    handles = [engine.submit(p, params) for p in prompts[1:]]
    engine.run_until_idle()
    outs = [list(h) for h in handles]
    assert [first] + [[t for o in out for t in o.token_ids] for out in outs] == want
    assert all(out[-1].usage.cached_tokens == 48 for out in outs)
    assert engine.stats().prefix_cache_hit_tokens_total == 3 * 48


def test_steps_that_fail_on_the_device_fail_only_their_requests(tmp_path, device):
    """Every 9th step fails at its third launch (while issued, or while its decode step is
    captured), or just before its recorded step replays: its requests fail, the runner
    recovers, and every other request, then every request served again, gets the reference
    engine's tokens. A device that cannot recover is lost, and so is the engine."""
    from poot.engine.faults import Faults
    from poot.engine.request import EngineFailed, SamplingParams
    from poot.engine.engine import Engine
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng()
    lengths, new = (40, 6, 9, 3, 50, 7, 12), (8, 10, 6, 12, 5, 9, 7)
    requests = [(rng.integers(3, 300, n).tolist(),
                 SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
                for n, m in zip(lengths, new)]
    reference = Engine(model.runner(None, num_blocks=64), model.tokenizer)
    want = [[t for o in reference.generate(p, q) for t in o.token_ids] for p, q in requests]
    gaps = []

    def settled(i, got):
        """Answer i, or the reference's where the two part at a token whose two best logits
        (the reference's) lie within NEAR_TIE: the device's f16 arithmetic may take either."""
        if isinstance(got, EngineFailed) or got == want[i]:
            return got
        k = next(j for j, (a, b) in enumerate(zip(got, want[i])) if a != b)
        logits = reference.runner.logits(step(requests[i][0] + want[i][:k], 0, list(range(8))))
        best = np.sort(logits[-1])[-2:]
        gaps.append(float(best[1] - best[0]))
        return want[i] if gaps[-1] < NEAR_TIE else got

    runner = model.runner(device, num_blocks=64, max_tokens=32, max_seqs=4)
    engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32)

    def served():
        handles = [engine.submit(p, q) for p, q in requests]
        engine.run_until_idle()
        got = []
        for h in handles:
            try:
                got.append([t for o in h for t in o.token_ids])
            except EngineFailed as e:
                got.append(e)
        return [settled(i, g) for i, g in enumerate(got)]

    runner.faults = faults = Faults(every=2)      # the first decode step, while captured
    with pytest.raises(EngineFailed, match="injected fault in step 2"):
        list(engine.generate(*requests[1]))
    assert not runner.graphs and engine.kv.num_used == 0
    faults.every = None
    assert settled(2, [t for o in engine.generate(*requests[2]) for t in o.token_ids]) == want[2]
    faults.every = 9
    got = served()
    assert faults.injected and engine.error is None and engine.kv.num_used == 0
    assert any(isinstance(g, EngineFailed) for g in got)
    assert [g for g in got if not isinstance(g, EngineFailed)] == [
        w for g, w in zip(got, want) if not isinstance(g, EngineFailed)] != [], gaps
    faults.every = None
    assert served() == want, gaps
    faults.lost_at = faults.steps + 2
    assert all(isinstance(g, EngineFailed) for g in served())
    assert engine.device_lost and engine.error.startswith("device lost")


WILD_LAUNCH = """
import sys
import poot
from poot.backends.ptx import DeviceBuffer
from poot.backends.select import open_device
from poot.engine.request import EngineFailed, SamplingParams
from poot.engine.engine import Engine
model = poot.load(sys.argv[1])
runner = model.runner(open_device("ptx"), num_blocks=16, max_tokens=32, max_seqs=4)
engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32)
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
print("before", len([o for o in engine.generate([5, 6, 7], params)]))
launch = runner._launch
def wild(kernel, grid, *args):      # every buffer at an address nothing maps
    return launch(kernel, grid, *(DeviceBuffer(0xDEAD0000, a.nbytes)
                                  if isinstance(a, DeviceBuffer) else a for a in args))
runner._launch = wild
try:
    list(engine.generate([5, 6, 7], params))
except EngineFailed as e:
    print("failed:", e)
print("lost:", engine.device_lost)
"""


def test_an_illegal_address_on_ptx_loses_the_device(tmp_path):
    """A step's kernels touch memory nothing maps: CUDA reports CUDA_ERROR_ILLEGAL_ADDRESS at
    the next synchronisation, and every call after it (the runner's recovery too) fails the
    same way, so the engine reports the device lost in the driver's words. In a process of
    its own: the context stays broken."""
    import subprocess
    import sys
    try:
        open_device("ptx")
    except BackendUnavailable as e:
        pytest.skip(str(e))
    done = subprocess.run([sys.executable, "-c", WILD_LAUNCH, str(tiny_model(tmp_path))],
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert "before 4" in out and "lost: True" in out, out + done.stderr
    assert "failed: device lost: DriverError" in out and "CUDA_ERROR_ILLEGAL_ADDRESS" in out


@pytest.mark.parametrize("dtype", ["F16", "Q4_K"])
@pytest.mark.parametrize("n", [20, 70])
def test_long_prefill_matches_reference(tmp_path, device, dtype, n):
    """A 20- and a 70-token step: the matmuls run over groups of tokens (matvec), or on matrix
    instructions (mma_tiled, its columns split where its tiles would not fill the device) where
    the device has them."""
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    batch = prefill_of(n)
    want = model.runner(None, num_blocks=16).logits(batch)
    got = model.runner(device, num_blocks=16, max_tokens=128).logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_prefill_with_shared_kv_heads_matches_reference(tmp_path, device, monkeypatch):
    """Workgroups of a long step take several query heads of one KV head (forced here: the
    tiny model's steps are too short to share them by themselves)."""
    monkeypatch.setattr(kernel_choice, "SHARED_HEADS_PER_SM", 0)
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    cfg = model.config
    if ops.attention_heads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           device.subgroup_size) == 1:
        pytest.skip("the tiny model's KV heads each serve one query head")
    batch = prefill_of(40)
    want = model.runner(None, num_blocks=16).logits(batch)
    runner = model.runner(device, num_blocks=16, max_tokens=128)
    assert runner.choice.attention_heads(40, cfg.n_heads, cfg.n_kv_heads) > 1
    got = runner.logits(batch)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def split_runner(model, device, num_blocks, split_tokens):
    runner = DeviceRunner(model, device, num_blocks, split_tokens=split_tokens)
    runner.allocate()
    runner.upload()
    return runner


def test_split_attention_matches_reference(tmp_path, device):
    """Attention split every block (32 splits over the 512-token table): a 16-token prefill (the
    most tokens a split step takes), then decode across split boundaries, the reference's tokens
    fed to both."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    table = list(np.random.default_rng().permutation(32))
    prompt = np.random.default_rng().integers(3, 300, 16).tolist()
    runner = split_runner(model, device, 32, 16)
    assert runner.attention_splits == 32
    want_ids, want = greedy(model.runner(None, num_blocks=32), prompt, 40, table)
    ids = prompt + want_ids
    got = [runner.logits(step(prompt, 0, table))[-1]]
    got += [runner.logits(step(ids[n - 1:n], n - 1, table))[0]
            for n in range(len(prompt) + 1, len(ids))]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_split_attention_batched_decode(tmp_path, device):
    """Sequences of different lengths in shuffled blocks decoding together (a captured bucket)
    with attention split every 32 tokens."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    runner = split_runner(model, device, 64, 32)
    reference = model.runner(None, num_blocks=64)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 64, 40)]
    tables = rng.permutation(64).reshape(4, 16)[:3].astype(np.int32)
    for p, t in zip(prompts, tables):
        for start in range(0, len(p), 16):
            chunk = step(p[start:start + 16], start, t)
            runner.logits(chunk)
            reference.logits(chunk)
    batch = StepBatch(np.array([p[-1] for p in prompts], np.int32),
                      np.array([len(p) for p in prompts], np.int32), np.arange(3, dtype=np.int32),
                      tables, np.arange(3, dtype=np.int32), SamplingRows.greedy(3))
    together, want = runner.logits(batch), reference.logits(batch)
    assert np.linalg.norm(together - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("dtype,n", [("F16", 130), ("BF16", 130), ("Q8_0", 130), ("Q4_K", 130),
                                     ("Q8_0", 300), ("Q4_K", 300)])
def test_prefill_on_matrix_instructions_matches_reference(tmp_path, device, dtype, n):
    """An n-token prefill step on a device with matrix instructions: its matmuls run mma_tiled
    (operands rounded to f16, bf16 for BF16 weights), the 8 sampled rows' lm_head the matvec;
    past DEQUANT_PAST_TOKENS on wgmma, block quants decoded to f16 first (dequant_f16), then
    F16's tiles. The bounds are twice what that rounding plus the f16 KV cache give in numpy."""
    if not {"fragment_load", "mma_f16", "mma_bf16"} <= device.caps:
        pytest.skip(f"{device.name} has no matrix instructions (fragment_load, mma_f16/bf16)")
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    batch = prefill_of(n)
    want = model.runner(None, num_blocks=32).logits(batch)
    runner = model.runner(device, num_blocks=32, max_tokens=512)
    runner.time_kernels()                      # launches one by one, each kernel named
    got = runner.logits(batch)
    decoded = n > DEQUANT_PAST_TOKENS and lang.WGMMA in device.caps
    ran = set(runner.kernel_times)
    name = "mma_tiled_f16" if decoded else f"mma_tiled_{dtype.lower()}"
    assert any(kernel.startswith(name) for kernel in ran), ran           # whatever its variant
    assert any(kernel.startswith(name) and kernel.endswith("_residual") for kernel in ran) or \
        "split_sum_residual" in ran
    if dtype in ("F16", "BF16"):            # x rounded once for the ring-buffered variant
        assert f"mma_x16_{dtype.lower()}" in ran
    assert (f"dequant_f16_{dtype.lower()}" in ran) == decoded, ran
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (8e-3 if dtype == "BF16" else 2e-3)


def test_batched_decode_on_matrix_instructions_matches_reference(tmp_path, device):
    """20 sequences decoding together (a captured bucket of 32): the step's matmuls run on the
    tensor cores with 64-token tiles, split along the columns, the slices in mma_partials."""
    if not {"fragment_load", "mma_f16", "mma_bf16"} <= device.caps:
        pytest.skip(f"{device.name} has no matrix instructions (fragment_load, mma_f16/bf16)")
    model = poot.load(tiny_model(tmp_path, dtype="Q4_K"))
    runner = model.runner(device, num_blocks=64, max_seqs=32)
    reference = model.runner(None, num_blocks=64)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 300, n).tolist() for n in rng.integers(1, 15, 20)]
    tables = rng.permutation(64)[:20, None].astype(np.int32)
    for p, t in zip(prompts, tables):
        runner.logits(step(p, 0, t))
        reference.logits(step(p, 0, t))
    batch = StepBatch(np.array([p[-1] for p in prompts], np.int32),
                      np.array([len(p) for p in prompts], np.int32), np.arange(20, dtype=np.int32),
                      tables, np.arange(20, dtype=np.int32), SamplingRows.greedy(20))
    together, want = runner.logits(batch), reference.logits(batch)
    assert np.linalg.norm(together - want) / np.linalg.norm(want) < 2e-3


class LaunchLog:
    """A CUDA device as far as a runner's plan and launches go: PTX's caps (without the matrix
    instructions where asked), and launch() records each kernel, grid and argument list."""
    backend, name, subgroup_size = "ptx", "a launch log", 32

    def __init__(self, matrix=True, multiprocessors=None):
        self.caps = PTX_CAPS if matrix else PTX_CAPS - {"mma_f16", "mma_bf16"}
        if multiprocessors:
            self.multiprocessors = multiprocessors
        self.launched = []

    def launch(self, program, kernel, grid, args):
        assert program is kernel and len(args) == len(kernel.params), kernel.name
        self.launched.append((kernel, grid, args))

    def view(self, buffer, offset):
        """A part of a stacked weight's planes (the tensor-core lowering reads q, k, v apart)."""
        return buffer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("multiprocessors", [132, 1])
def test_a_decode_step_folds_its_rope_into_the_attention(tmp_path, arch, multiprocessors):
    """On the host (LaunchLog): a step whose sequences are each at one position, every token
    sampled, launches no rope_store_kv where the one-pass attention runs: that attention
    takes the rope (its variant, with the rope's k, v, inv_freq and, for Qwen3's q/k norms,
    their weights). A prompt's step (a sequence at several positions), a step with tokens not
    sampled, and a step the tensor cores' decode kernel takes (one multiprocessor: it is
    always full) launch the rope on its own."""
    model = poot.load(tiny_model(tmp_path, dtype="Q4_0", arch=arch))
    log = LaunchLog(multiprocessors=multiprocessors)
    runner = DeviceRunner(model, log, num_blocks=16, max_tokens=64, max_seqs=16)
    runner.programs = {k.name: k for k in runner._kernels()}
    runner.buffers = {a.name: a for a in runner.allocations()}
    ropes = [op for op in runner.steps if op.kind == "rope_store_kv"]
    assert len(ropes) == model.config.n_layers and \
        all(("eps" in op.attrs) == (arch == "qwen3") for op in ropes)
    for T, R, one in ((1, 1, True), (16, 16, True), (16, 16, False), (16, 3, True)):
        runner._one_position = one
        log.launched.clear()
        for _ in runner.launches(T, R):
            pass
        folded = one and T == R and multiprocessors > 1
        names = [kernel.name for kernel, _, _ in log.launched]
        assert sum("rope_store_kv" in n for n in names) == (0 if folded else len(ropes))
        attention = [(k, a) for k, _, a in log.launched if k.name.startswith("attention")]
        assert all(("_rope_" in k.name) == folded for k, _ in attention)
        if not folded:
            continue
        assert len(attention) == len(ropes)
        for (kernel, args), rope in zip(attention, ropes):
            given = dict(zip([p.name for p in kernel.params], args))
            for name, t in zip(("k", "v", "inv_freq", "q_norm", "k_norm"),
                               (*rope.inputs[1:3], *rope.inputs[8:])):
                assert given[name] is runner._buffer(t), name


@pytest.mark.parametrize("multiprocessors", [132, None, 1])
@pytest.mark.parametrize("dtype", ["Q4_K", "F32"])
def test_every_step_length_launches_compiled_kernels_within_the_partials(tmp_path,
                                                                          multiprocessors, dtype):
    """On the host, every step length 1..max_tokens: each launch is of a kernel the runner
    builds, with its parameters' count of arguments; matmuls of MMA_MIN_TOKENS or more run
    mma_tiled (F32, which mma_vec does not decode), or up to 16 tokens mma_vec and past them
    mma_tiled (Q4_K), split where the tiles give fewer workgroups than multiprocessors
    (always in this small model, never with one multiprocessor); split ones, and the stacked
    gate/up's SwiGLU always, write within mma_partials, which is as large as the largest needs,
    and a split_sum follows each. A norm folded into a matmul is a norm_x16 launch first: into
    norm_x16 for the x16 mma_vec after it, into mma_x16 for the x16 mma_tiled after it."""
    model = poot.load(tiny_model(tmp_path, dtype=dtype, shape="tiny-k"))   # rows, cols 256, 512
    log = LaunchLog(multiprocessors=multiprocessors)
    runner = DeviceRunner(model, log, num_blocks=16, max_tokens=200, max_seqs=16)
    least = MMA_MIN_TOKENS if dtype == "F32" else 17
    assert runner.choice.mma_min_tokens == least
    runner.programs = {k.name: k for k in runner._kernels()}
    runner.buffers = {a.name: a for a in runner.allocations()}
    partials = runner.buffers.get("mma_partials")
    largest, matrix, normed, made = 0, set(), Counter(), 0
    x16s = {"mma_tiled": runner.buffers.get("mma_x16"), "mma_vec": runner.buffers.get("norm_x16")}
    for T in range(1, 201):
        log.launched.clear()
        for _ in runner.launches(T, min(T, 16)):
            pass
        for i, (kernel, grid, args) in enumerate(log.launched):
            if kernel.name.startswith("reduce_norm_x16"):
                made += 1
                assert args[-3] is x16s["mma_tiled"] and log.launched[i + 1][0].name.startswith(
                    "mma_tiled") and "_x16" in log.launched[i + 1][0].name
            if kernel.name.startswith("norm_x16"):
                after, _, after_args = log.launched[i + 1]
                family = after.name.split("_")[0] + "_" + after.name.split("_")[1]
                normed[family] += 1
                x16 = x16s[family]
                assert args[2] is x16 and grid[0] * args[3] * 2 <= x16.nbytes
                assert "_x16" in after.name and x16 in after_args
            if not kernel.name.startswith(("mma_tiled", "matvec", "mma_vec")):
                continue
            names = [p.name for p in kernel.params]
            n = args[names.index("n_tokens")]
            assert kernel.name.startswith("mma_tiled") == (n >= least), kernel.name
            assert kernel.name.startswith("mma_vec") == (
                dtype == "Q4_K" and n < least), kernel.name
            if not kernel.name.startswith("mma_tiled"):
                continue
            rows, cols = args[names.index("rows")], args[names.index("cols")]
            want = matmul.mma_launch(rows, cols, n, multiprocessors or MULTIPROCESSORS)
            assert grid == want.grid(rows, n)
            matrix.add(want.splits > 1)
            if kernel.name.endswith("_split"):
                assert args[-1] == want.split_cols and partials in args
                assert log.launched[i + 1][0].name.startswith(("split_sum", "reduce_norm_x16"))
                largest = max(largest, want.splits * n * rows)
            else:
                assert want.splits == 1
    assert matrix == ({False} if multiprocessors == 1 else {True})
    # a split residual sum makes the next matmul's normed x16 (reduce_norm_x16, over views)
    assert (made > 0) == (multiprocessors != 1)
    assert partials == (Allocation("mma_partials", largest * 4, "arenas") if largest else None)
    assert set(normed) == ({"mma_tiled", "mma_vec"} if dtype == "Q4_K" else {"mma_tiled"})


@pytest.mark.parametrize("matrix", [True, False])
def test_prompt_steps_take_attention_tiles_where_a_tile_is_one_sequence(tmp_path, matrix):
    """On the host: a step with prompt tokens launches the tensor-core tiles (PROMPT_KERNEL's
    kernel, on its grid) where some 16-token tile is two or more tokens of one sequence
    (ops.tiled_tokens of the uploaded rows), and the untiled attention where others are left; a
    decode step (every token sampled), a step with no such tile, or a device without the
    matrix instructions, the plain attention alone."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    log = LaunchLog(matrix=matrix)
    runner = DeviceRunner(model, log, num_blocks=16, max_tokens=64, max_seqs=16)
    runner.programs = {k.name: k for k in runner._kernels()}
    runner.buffers = {a.name: a for a in runner.allocations()}
    cases = [([0] * 40, 1, {"attention_tiles"}), ([0] * 3 + [1] * 17, 2,
                                                    {"attention_tiles", "untiled"}),
             (list(range(8)), 2, {"attention"}), ([0] * 16, 16, {"attention"})]
    for rows, R, kinds in cases:
        runner._step_rows, runner._step_tiles = np.array(rows), None
        log.launched.clear()
        for _ in runner.launches(len(rows), R):
            pass
        tiles = kernel_choice.PROMPT_TILES[kernel_choice.PROMPT_KERNEL]
        heads, kv_heads = model.config.n_heads, model.config.n_kv_heads
        tile_heads = ops.attention_tile_heads(heads, kv_heads)
        launched = set()
        for kernel, grid, _ in log.launched:
            if kernel.name == tiles[0](model.config.head_dim, tile_heads).name:
                assert tuple(grid) == tiles[1](len(rows), heads, tile_heads)
                launched.add("attention_tiles")
            elif kernel.name.startswith("attention"):
                launched.add("untiled" if kernel.name.endswith("_untiled") else "attention")
        layers = sum(k.name.startswith("attention") for k, _, _ in log.launched)
        assert launched == (kinds if matrix else {"attention"}), rows
        assert layers == model.config.n_layers * len(launched)


def test_one_by_one_tokens_take_the_tensor_cores_where_they_fill_the_device(tmp_path):
    """On the host: where a step's tokens times KV heads give every multiprocessor a workgroup,
    its decode tokens run flash.attention_decode (grid: a workgroup a token and KV head), and
    beside prompt tiles its untiled form; fewer workgroups, or a device without the matrix
    instructions, keep the one-pass kernel."""
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    kv_heads = model.config.n_kv_heads
    for matrix, sms, rows, R, want in (
            (True, 8, [0] * 16, 16, {"attention_decode"}),
            (True, 8, [0] * 3 + [1] * 17, 2, {"attention_flash", "attention_decode_untiled"}),
            (True, 200, [0] * 16, 16, {"attention"}), (False, 8, [0] * 16, 16, {"attention"})):
        log = LaunchLog(matrix=matrix, multiprocessors=sms)
        runner = DeviceRunner(model, log, num_blocks=16, max_tokens=64, max_seqs=16)
        runner.programs = {k.name: k for k in runner._kernels()}
        runner.buffers = {a.name: a for a in runner.allocations()}
        runner._step_rows, runner._step_tiles = np.array(rows), None
        log.launched.clear()
        for _ in runner.launches(len(rows), R):
            pass
        names = {next(kind for kind in ("attention_decode", "attention_flash", "attention")
                      if k.name.startswith(kind)) + "_untiled" * k.name.endswith("_untiled")
                 for k, _, _ in log.launched if k.name.startswith("attention")}
        assert names == want, (matrix, sms, rows)
        for kernel, grid, _ in log.launched:
            if kernel.name.startswith("attention_decode"):
                assert tuple(grid) == (len(rows) * kv_heads,)


def test_long_steps_decode_block_quants_first_on_wgmma(tmp_path):
    """On the host, a device with wgmma: steps of more than DEQUANT_PAST_TOKENS decode each
    block-quant weight to f16 (dequant_f16 into the dequant_f16 arena, sized for the largest)
    and launch F16's tile over it; shorter steps, the format's own tile."""
    model = poot.load(tiny_model(tmp_path, dtype="Q4_K", shape="tiny-k"))
    log = LaunchLog()
    log.caps = PTX_CAPS | {lang.WGMMA}
    runner = DeviceRunner(model, log, num_blocks=32, max_tokens=300, max_seqs=16)
    runner.programs = {k.name: k for k in runner._kernels()}
    runner.buffers = {a.name: a for a in runner.allocations()}
    decoded = runner.buffers["dequant_f16"]
    largest = max(math.prod(runner.choice.tiled_weight(op).shape) for op in runner.choice.tiled_ops())
    assert decoded.nbytes == largest * 2
    for T, long in ((200, False), (256, False), (257, True), (300, True)):
        log.launched.clear()
        for _ in runner.launches(T, 8):
            pass
        tiles = [(i, k) for i, (k, _, _) in enumerate(log.launched)
                 if k.name.startswith("mma_tiled")]
        assert tiles and all(k.name.startswith("mma_tiled_f16" if long else "mma_tiled_q4_k")
                             for _, k in tiles), T
        for i, kernel in tiles:
            before, _, args = log.launched[i - 1]
            assert (before.name == "dequant_f16_q4_k") == long
            assert (log.launched[i][2][0] is decoded) == long
            if long:
                assert args[-3] is decoded and kernel.name.split("_")[2] == "f16"


def test_no_partials_without_matrix_instructions(tmp_path):
    model = poot.load(tiny_model(tmp_path, dtype="Q4_K"))
    runner = DeviceRunner(model, LaunchLog(matrix=False), num_blocks=16, max_tokens=200)
    assert "mma_partials" not in {a.name for a in runner.allocations()}
    assert not any(k.name.startswith("mma_tiled") for k in runner._kernels())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "smollm3"])
def test_qwen_variants_match_reference(tmp_path, device, arch):
    """q/k/v biases (qwen2) and q/k norms (qwen3: folded into rope_store_kv) around the fused
    q/k/v matmul and rope; a layer without rope (SmolLM3's fourth) stores its keys as they are."""
    shape = "tiny-deep" if arch == "smollm3" else None
    model = poot.load(tiny_model(tmp_path, dtype="F16", arch=arch, shape=shape))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    runner = model.runner(device, num_blocks=32)
    assert "rms_norm" not in {s.kind for s in runner.steps}
    got_ids, got = greedy(runner, [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    kinds = [s.kind for s in runner.steps]
    assert kinds.count("store_kv") == len(model.config.nope_layers) == (arch == "smollm3")


@pytest.mark.parametrize("arch, keys", [
    ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
               "rope.scaling.original_context_length": 64}),
    ("granite", {"embedding_scale": 6.0, "residual_scale": 0.3, "attention.scale": 0.09,
                 "logit_scale": 4.0})])
def test_llama_variants_of_metadata_match_reference(tmp_path, device, arch, keys):
    """GGUF keys that change the graph, not the tensors: YaRN's scaling (its frequencies and
    the factor on the rotated dims, in the fused rope and store), Granite's multipliers (the
    scaled embeddings, residual adds and logits, the attention scale)."""
    from poot.formats.gguf import GGUFFile, write_gguf
    source = GGUFFile(tiny_model(tmp_path, dtype="F16", arch=arch))
    meta = dict(source.metadata, **{f"{arch}.{k}": v for k, v in keys.items()})
    path = tmp_path / f"{arch}-variant.gguf"
    write_gguf(path, meta, [(n, t.dtype, source.array(n)) for n, t in source.tensors.items()])
    model = poot.load(path)
    assert model.config.rope_scale > 1 or model.config.residual_scale != 1
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_a_llama_layer_is_six_launches(tmp_path, device):
    """attn_norm folded into one q/k/v matmul, rope with store_kv, attention, the output
    projection with its residual, ffn_norm folded into gate/up with SwiGLU, down with its
    residual; the stacked q/k/v weight replaces the three."""
    model = poot.load(tiny_model(tmp_path, dtype="Q8_0"))
    runner = model.runner(device, num_blocks=32)
    launches = [s.kind for s in runner.steps if s.kind != "reshape"]
    layer = ["matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul"]
    assert launches == ["embedding", *layer * model.config.n_layers, "gather", "matmul"]
    weights = [a.name for a in runner.allocations() if a.kind == "weights"]
    assert "blk.0.attn_q.weight+blk.0.attn_k.weight+blk.0.attn_v.weight:quants" in weights
    assert not any(name.startswith("blk.0.attn_k.weight:") for name in weights)


def test_mixed_dtypes_fuse_what_shares_a_dtype(tmp_path, device):
    """A Q4_K_M-like mix: q and k stack (v in Q6_K stays apart, its own matmul with the norm
    folded in); gate and up differ, so each is a matmul and SwiGLU its own kernel."""
    mixed = (("attn_v", "Q6_K"), ("ffn_up", "Q8_0"))
    model = poot.load(tiny_model(tmp_path, dtype="Q4_K", mixed=mixed))
    runner = model.runner(device, num_blocks=32)
    layer = ["matmul", "matmul", "rope_store_kv", "attention", "matmul", "matmul", "matmul",
             "glu", "matmul"]
    assert [s.kind for s in runner.steps if s.kind != "reshape"] == \
        ["embedding", *layer * model.config.n_layers, "gather", "matmul"]
    assert [len(s.outputs) for s in runner.steps if s.kind == "matmul"][:2] == [2, 1]
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(runner, [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_k_quant_mix_with_q5_0_layers_matches_reference(tmp_path, device):
    """A Q5_K_M / Gemma-3-Q4_K_M-like mix of the formats read through quant.UNIT_FORMATS beside
    the older ones: Q5_K matrices, v in Q6_K, down in Q5_0, up in Q4_K."""
    mixed = (("attn_v", "Q6_K"), ("ffn_down", "Q5_0"), ("ffn_up", "Q4_K"))
    model = poot.load(tiny_model(tmp_path, dtype="Q5_K", mixed=mixed))
    table = list(np.random.default_rng().permutation(32))
    want_ids, want = greedy(model.runner(None, num_blocks=32), [5, 80, 9, 41], 12, table)
    got_ids, got = greedy(model.runner(device, num_blocks=32), [5, 80, 9, 41], 12, table)
    assert got_ids == want_ids
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("k", [5, 20])
def test_forced_rows_score_their_token_from_candidates_or_the_row_read_back(wide, device,
                                                                             monkeypatch, k):
    """Rows forced to a token (a prompt position scored: SamplingRows.forced) give sample()'s
    output on the same step's full logits, the k best alternatives up to 20 (OpenAI's most):
    from the candidates where the token is one of them (its best), from the row read back
    where it is not (a token of the worst); rows beside them sample as ever."""
    n = 6
    runner, rng, batch_of, read = decoding(wide, device, n, monkeypatch)
    rows = SamplingRows(temperature=np.array([0, 0, 1, 0, 0, 0.8], np.float32),
                        top_k=np.array([0, 0, 5, 0, 0, 3], np.int32),
                        top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                        seed=rng.integers(0, 2**63, n).astype(np.uint64),
                        step=np.arange(n, dtype=np.int64), n_logprobs=k, logprobs=True,
                        reports=np.array([True, True, True, True, True, False]))
    batch = batch_of(0, rows)
    logits = runner.logits(batch)           # the step once: its logits, for tokens to force
    best_ones, worst = np.argmax(logits, axis=1), np.argmin(logits, axis=1)
    rows.forced = np.array([best_ones[0], worst[1], -1, best_ones[3], worst[4], -1], np.int32)
    read.clear()
    got = runner.step(batch)
    assert read.count(runner._output_name()) == 2, read         # the two worst, alone
    want = sample(runner.logits(batch), rows)   # the same step again: the same logits
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.tokens[[0, 1, 3, 4]].tolist() == rows.forced[[0, 1, 3, 4]].tolist()
    reports = rows.reports
    assert got.top_ids[reports].tolist() == want.top_ids[reports].tolist()
    assert np.allclose(got.logprobs[reports], want.logprobs[reports], rtol=0, atol=1e-4)
    assert np.allclose(got.top_logprobs[reports], want.top_logprobs[reports], rtol=0, atol=1e-4)


def test_n_choices_and_prompt_logprobs_on_the_device(tmp_path, device):
    """A request of 3 choices whose prompt (three chunks of a 32-token step) is scored: the
    choices after the first read its blocks through their block tables and compute the rest,
    and each gives the reference engine's greedy tokens; the prompt's log probabilities (rows
    of a runner of 4, forced to the prompt's tokens) are the reference's within what an f16
    KV cache moves them."""
    from poot.engine.engine import Engine
    from poot.engine.request import SamplingParams
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng(7)        # a fixed draw, as in the tests above
    prompt = rng.integers(3, 300, 70).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3)

    def served(runner):
        engine = Engine(runner, model.tokenizer, max_seqs=4, step_tokens=32,
                        prefix_caching=False)
        outs = list(engine.submit(prompt, params, n=3))
        assert engine.kv.num_used == 0
        return outs

    want, got = served(model.runner(None, num_blocks=64)), served(
        model.runner(device, num_blocks=64, max_tokens=32, max_seqs=4))
    for j in range(3):
        assert [t for o in got if o.index == j for t in o.token_ids] == \
            [t for o in want if o.index == 0 for t in o.token_ids]
    scored = [next(o for o in outs if o.index == 0).prompt_logprobs for outs in (want, got)]
    assert [e.token_id for e in scored[1]] == prompt[1:]
    assert np.allclose([e.logprob for e in scored[1]], [e.logprob for e in scored[0]],
                       atol=5e-3)
    assert np.mean([[i for i, _ in a.top] == [i for i, _ in b.top]
                    for a, b in zip(*scored)]) > 0.9


def test_embeddings_on_a_device_equal_the_reference(tmp_path, device):
    """Embed requests batched with generating ones (chunked prefill, several rows a step), then
    again with their prompts cached: the device's embeddings are the reference's."""
    from poot.engine.engine import Engine
    from poot.engine.request import SamplingParams
    model = poot.load(tiny_model(tmp_path, dtype="F16"))
    rng = np.random.default_rng(7)
    batch = [rng.integers(3, 300, n).tolist() for n in (3, 30, 17, 1, 45)]
    generating = [rng.integers(3, 300, n).tolist() for n in (7, 20)]
    embed = SamplingParams(temperature=0.0, embed=True)
    gen = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    def embeddings(engine):
        others = [engine.submit(p, gen) for p in generating]
        handles = [engine.submit(p, embed) for p in batch]
        engine.run_until_idle()
        assert all(list(h)[-1].finish_reason == "length" for h in others)
        outs = [list(h)[0] for h in handles]
        return [model.embedding(o.hidden) for o in outs], outs

    want, _ = embeddings(Engine(model.runner(None, num_blocks=128, block_size=4),
                                model.tokenizer))
    engine = Engine(model.runner(device, num_blocks=128, block_size=16, max_tokens=32,
                                 max_seqs=8), model.tokenizer, max_seqs=8, step_tokens=32)
    for again in (False, True):
        got, outs = embeddings(engine)
        for g, w in zip(got, want):
            assert float(g @ w) > 0.9995, float(g @ w)      # f16 weights and KV cache
        if again:
            assert sum(o.usage.cached_tokens for o in outs) > 0
    assert engine.kv.num_used == 0
