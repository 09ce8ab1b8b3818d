import numpy as np

from poot.engine.batch import LogitEdits, SamplingRows
from poot.engine.sampling import (BANNED, EXP2, STEPS, SUM_MARGIN, best, choice_args, choose,
                                  choose_counted, draw_bits, edit_logits, log_softmax,
                                  logprobs_among, sample, step_scale, weights)


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, n_logprobs=0):
    return SamplingRows(temperature=np.full(n, temperature, np.float32),
                        top_k=np.full(n, top_k, np.int32), top_p=np.full(n, top_p, np.float32),
                        min_p=np.full(n, min_p, np.float32),
                        seed=np.full(n, seed, np.uint64), step=np.arange(n, dtype=np.int64),
                        n_logprobs=n_logprobs)


def draw_many(logits, n, **params):
    """The token chosen at steps 0..n-1 of one seeded sequence."""
    return np.array([choose(logits, params.get("temperature", 1.0), params.get("top_k", 0),
                            params.get("top_p", 1.0), params.get("min_p", 0.0),
                            draw_bits(12345, step)) for step in range(n)])


def test_draw_bits_are_a_pure_function_of_seed_and_step():
    values = [draw_bits(s, t) for s in (0, 1, 2**63) for t in range(200)]
    assert all(0 <= v < 2**32 for v in values)
    assert draw_bits(99, 5) == draw_bits(99, 5) and draw_bits(99, 5) != draw_bits(99, 6)
    assert abs(np.mean(values) / 2**32 - 0.5) < 0.05


def test_weights_are_the_softmax_s_within_a_step():
    """A token's weight over the highest one's is exp((x - max) / temperature) within one step
    (1/STEPS of an octave) and the integers' rounding; the steps order the tokens by logit;
    banned, NaN and infinite logits weigh as the definition says."""
    rng = np.random.default_rng(4)
    for t in (0.05, 0.7, 1.0, 1.9):
        x = (rng.standard_normal(5000) * 3).astype(np.float32)
        q, w = weights(x, t)
        exact = np.exp((x.astype(np.float64) - x.max()) / t)
        real = exact > 2.0**-20                     # weights of 11 bits and more
        assert q[np.argmax(x)] == 0 and w.max() == 2**31
        ratio = w[real] / 2.0**31 / exact[real]
        # a step truncated raises a weight by up to one step (float32's rounding moves it by a
        # few hundredths); the shift's truncation lowers an 11-bit weight by up to 2^-11
        assert np.all(ratio <= 2 ** (1.05 / STEPS)) and \
            np.all(ratio >= 2 ** (-0.05 / STEPS) * (1 - 2.0**-11))
        order = np.argsort(-x, kind="stable")
        assert np.all(np.diff(q[order].astype(np.int64)) >= 0)
    assert EXP2[0] == 2**31 and np.all(np.diff(EXP2.astype(np.int64)) < 0)
    q, w = weights(np.array([1, BANNED, np.nan, -np.inf, 0.5], np.float32), 1.0)
    assert w[1:4].tolist() == [0, 0, 0] and w[0] == 2**31 and 0 < w[4] < 2**31
    q, w = weights(np.array([np.inf, 3.0, np.inf], np.float32), 1.0)
    assert w.tolist() == [2**31, 0, 2**31]
    assert step_scale(1e-45) == np.finfo(np.float32).max


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = np.random.default_rng().standard_normal((3, 50)).astype(np.float32)
    out = sample(logits, rows(3, temperature=0.0, n_logprobs=5))
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    expected = log_softmax(logits.astype(np.float64))
    assert np.allclose(out.logprobs, expected[np.arange(3), out.tokens], atol=1e-5)
    assert np.allclose(out.top_logprobs, -np.sort(-expected, axis=-1)[:, :5], atol=1e-5)
    assert out.top_ids[:, 0].tolist() == out.tokens.tolist()


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    counts = np.bincount(draw_many(logits, 4000), minlength=4) / 4000
    assert np.allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_temperature_sharpens():
    logits = np.log(np.array([0.6, 0.4], np.float32))
    hot = np.mean(draw_many(logits, 2000, temperature=0.25) == 0)
    assert hot > 0.75     # p0 = .6^4 / (.6^4 + .4^4) = 0.835


def test_top_k_top_p_min_p_cut_the_support():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    assert set(draw_many(logits, 500, top_k=2)) == {0, 1}
    assert set(draw_many(logits, 500, top_p=0.65)) == {0, 1}      # 0.4 + 0.3 reaches 0.65
    assert set(draw_many(logits, 500, top_p=0.69)) == {0, 1}
    assert set(draw_many(logits, 500, top_p=0.71)) == {0, 1, 2}
    assert set(draw_many(logits, 500, min_p=0.49)) == {0, 1, 2}   # 0.2 >= 0.49 * 0.4
    assert set(draw_many(logits, 500, min_p=0.51)) == {0, 1}


def test_seeded_rows_reproduce_regardless_of_batch():
    rng = np.random.default_rng()
    logits = rng.standard_normal((4, 100)).astype(np.float32)
    together = sample(logits, rows(4, seed=3)).tokens
    alone = [sample(logits[i:i + 1], SamplingRows(
        temperature=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
        top_p=np.ones(1, np.float32), min_p=np.zeros(1, np.float32),
        seed=np.full(1, 3, np.uint64), step=np.array([i]))).tokens[0] for i in range(4)]
    assert together.tolist() == alone


def test_best_is_the_stable_sort_cut_short():
    rng = np.random.default_rng(3)
    for n in (1, 7, 100, 999, 1000, 2000):
        values = np.round(rng.standard_normal(1000) * 2).astype(np.float32)   # many ties
        want = np.argsort(-values, kind="stable")[:n]
        assert best(values, n).tolist() == want.tolist()


def test_choose_counted_gives_choose_s_token():
    """Every cut alone and together, ties (zeros of both signs among them), banned tokens,
    flat and peaked distributions, tiny temperatures: the same token as the definition's sort."""
    rng = np.random.default_rng(11)
    for _ in range(1500):
        logits, args = random_row(rng, [1, 5, 256, 3000, 40000], [0, 0, 1, 3, 50, 700])
        if rng.random() < 0.2:
            logits[rng.random(len(logits)) < 0.3] = -0.0
        if rng.random() < 0.2:
            logits[rng.random(len(logits)) < 0.3] = BANNED
        assert choose_counted(logits, *args) == choose(logits, *args), args


def random_row(rng, vocabs, top_ks):
    """Logits of one of `vocabs` sizes (flat or peaked, a third of them rounded into ties) and
    choose()'s arguments after them: every cut alone and together."""
    logits = (rng.standard_normal(int(rng.choice(vocabs)))
              * rng.choice([0.3, 3.0, 12.0])).astype(np.float32)
    if rng.random() < 0.3:
        logits = np.round(logits)
    return logits, (float(rng.choice([0.0, 0.4, 1.0, 1.7, 0.01])), int(rng.choice(top_ks)),
                    float(rng.choice([1.0, 1.0, 0.5, 0.9, 0.999, 0.0])),
                    float(rng.choice([0.0, 0.0, 0.01, 0.2, 1.0])), int(rng.integers(0, 2**32)))


def candidates(logits, chunk, keep, temperature, rng):
    """What choice.top_candidates leaves for a row (chunks of `chunk`, each's best `keep`, padded
    past the vocabulary), its sums off the exact ones by up to half the margin logprobs_among
    allows."""
    vocab = len(logits)
    chunks = -(-vocab // chunk)
    values = np.full((chunks, keep), np.float32(-3.4e38), np.float32)
    ids = np.full((chunks, keep), vocab + 1, np.int32)
    maxima, sums = np.zeros(chunks, np.float32), np.zeros(chunks, np.float32)
    t = temperature if temperature > 0 else 1.0
    for c in range(chunks):
        part = logits[c * chunk:(c + 1) * chunk]
        best_of = np.argsort(-part, kind="stable")[:keep]
        values[c, :len(best_of)], ids[c, :len(best_of)] = part[best_of], c * chunk + best_of
        maxima[c] = part.max()
        exact = np.exp((part.astype(np.float64) - part.max()) / t).sum()
        sums[c] = exact * (1 + rng.uniform(-0.5, 0.5) * SUM_MARGIN)
    return values, ids, maxima, sums


def test_logprobs_among_gives_sample_s_row_or_nothing():
    """From candidates with sums at temperature 1 and a row's token: its log probability and
    the n best ids (best()'s order) and theirs, within what the sums' margin moves them; None
    where the token is no candidate or n is past a chunk's keep."""
    rng = np.random.default_rng(21)
    for _ in range(800):
        logits, args = random_row(rng, [5, 300, 3000, 20000], [0, 0, 1, 3, 16, 50])
        vocab, n = len(logits), int(rng.choice([0, 1, 5, 20]))
        chunk, keep = int(rng.choice([64, 256, 2048])), int(rng.choice([8, 16, 64]))
        token = choose(logits, *args)
        values, ids, maxima, sums = candidates(logits, chunk, keep, 1.0, rng)
        got = logprobs_among(values, ids, maxima, sums, vocab, token, n)
        if n > keep or token not in ids:
            assert got is None
            continue
        chosen, top, top_lp = got
        exact = log_softmax(logits.astype(np.float64))
        assert abs(chosen - exact[token]) < SUM_MARGIN
        assert top.tolist() == best(logits, n).tolist()[:n]
        assert np.allclose(top_lp, exact[top], rtol=0, atol=SUM_MARGIN)


def test_sample_takes_choose_s_tokens_and_the_sorted_top_logprobs():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((6, 30000)) * 4).astype(np.float32)
    params = rows(6, temperature=0.8, top_p=0.95, min_p=0.01, n_logprobs=4)
    out = sample(logits, params)
    assert out.tokens.tolist() == [
        choose(logits[r], 0.8, 0, float(params.top_p[r]), float(params.min_p[r]),
               draw_bits(params.seed[r], params.step[r])) for r in range(6)]
    lp = log_softmax(logits)
    assert out.top_ids.tolist() == np.argsort(-lp, axis=-1, kind="stable")[:, :4].tolist()


def test_forced_rows_score_their_token_and_sample_nothing():
    """A forced row (a prompt position scored) gives the token it is given, its log probability
    of the raw logits and the best alternatives, as a chosen token's; the rows beside it sample
    as ever. From candidates, the same where the token is one of them, else nothing."""
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((4, 3000)) * 4).astype(np.float32)
    params = rows(4, temperature=0.8, n_logprobs=3)
    params.logprobs = True
    forced = np.array([17, -1, int(np.argmax(logits[2])), -1], np.int32)
    plain = sample(logits, params)
    params.forced = forced
    out = sample(logits, params)
    lp = log_softmax(logits)
    assert out.tokens.tolist() == [17, plain.tokens[1], forced[2], plain.tokens[3]]
    assert np.allclose(out.logprobs, lp[np.arange(4), out.tokens], rtol=0, atol=1e-6)
    assert out.top_ids.tolist() == plain.top_ids.tolist()
    for r, token in ((0, 17), (2, int(forced[2]))):
        got = logprobs_among(*candidates(logits[r], 256, 16, 1.0, rng), 3000, token, 3)
        best_in_chunk = np.argsort(-logits[r, token // 256 * 256:][:256],
                                   kind="stable")[:16] + token // 256 * 256
        if token in best_in_chunk:
            assert abs(got[0] - lp[r, token]) < SUM_MARGIN
            assert got[1].tolist() == out.top_ids[r].tolist()
        else:
            assert got is None              # its logit is not among them: read the row


def with_masks(r, allowed):
    """SamplingRows `r` with rows constrained to `allowed` (bool [R, V]; None: unconstrained)."""
    words = -(-max(len(a) for a in allowed if a is not None) // 32)
    masks = np.full((len(allowed), words), 0xFFFFFFFF, np.uint32)
    for i, a in enumerate(allowed):
        if a is not None:
            padded = np.zeros(words * 32, bool)
            padded[:len(a)] = a
            masks[i] = np.packbits(padded, bitorder="little").view(np.uint32)
    r.masks, r.masked = masks, np.array([a is not None for a in allowed])
    return r


def test_constrained_rows_choose_among_their_tokens_and_report_edited_logprobs():
    """A mask bans the tokens it leaves out (BANNED): the row chooses among the others, and its
    log probabilities are those of the edited logits, so every allowed token's is higher than
    the raw one and the banned tokens' are ~-3.4e38; rows without a mask are as they were."""
    rng = np.random.default_rng(3)
    V = 100                                 # not a multiple of 32: the last word is partial
    logits = rng.standard_normal((4, V)).astype(np.float32)
    allowed = [None, np.isin(np.arange(V), [3, 50]), np.arange(V) == 99,
               (np.arange(V) >= 10) & (np.arange(V) < 20)]
    for temperature in (0.0, 1.0):
        free = sample(logits, rows(4, temperature=temperature, n_logprobs=3))
        masked = with_masks(rows(4, temperature=temperature, n_logprobs=3), allowed)
        edited = edit_logits(logits, masked)
        got = sample(edited, masked)
        assert got.tokens[0] == free.tokens[0]
        assert got.tokens[2] == 99 and got.tokens[1] in (3, 50) and 10 <= got.tokens[3] < 20
        if temperature == 0:
            assert got.tokens[1] == [3, 50][int(logits[1, 50] > logits[1, 3])]
        expected = log_softmax(edited.astype(np.float64))
        assert np.allclose(got.logprobs, expected[np.arange(4), got.tokens], atol=1e-5)
        raw = log_softmax(logits.astype(np.float64))[np.arange(4), got.tokens]
        assert got.logprobs[2] == 0 and np.all(got.logprobs[1:] >= raw[1:] - 1e-6)
        assert got.top_ids[0].tolist() == free.top_ids[0].tolist()
        assert got.top_ids[1, :2].tolist() == sorted([3, 50], key=lambda t: -logits[1, t])
        assert got.top_logprobs[1, 2] < -1e38           # a banned token's, past the two


def test_a_constrained_row_draws_by_its_renormalised_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-3] * 28, np.float32))
    allowed = np.zeros(32, bool)
    allowed[[1, 2]] = True                  # 0.3 : 0.15 -> 2/3 : 1/3
    draws = []
    for s in range(3000):
        r = with_masks(rows(1, seed=s), [allowed])
        draws.append(sample(edit_logits(logits[None], r), r).tokens[0])
    assert set(draws) == {1, 2}
    assert abs(np.mean(np.array(draws) == 1) - 2 / 3) < 0.03


def test_edits_divide_positive_logits_multiply_negative_ones_then_add():
    """x / repeat where x > 0, x * repeat where not, then + add; -inf bans (BANNED, never
    below it); tokens without an edit and rows without edits are as they were; a mask comes
    after the edits."""
    logits = np.array([[2.0, -2.0, 0.0, 1.0, 3.0, -1.0],
                       [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], np.float32)
    r = rows(2)
    r.edits = LogitEdits.of(2, {0: (np.array([0, 1, 2, 4, 5]), np.array([2, 2, 2, 1, 1.5]),
                                    np.array([0, 0, 0.5, -np.inf, -0.25]))})
    edited = edit_logits(logits, r)
    assert edited[0].tolist() == [1.0, -4.0, 0.5, 1.0, BANNED, -1.75]
    assert edited[1].tolist() == logits[1].tolist()
    masked = with_masks(r, [np.array([1, 1, 1, 0, 1, 1], bool), None])
    assert edit_logits(logits, masked)[0].tolist() == [1.0, -4.0, 0.5, BANNED, BANNED, -1.75]
    assert sample(edited, r).tokens[0] != 4 and edited.dtype == np.float32


def test_ranked_rows_are_the_best_n_of_every_candidate_in_choose_s_order():
    """_ranked_rows reads only the chunks whose best reaches the n-th best chunk's, and still
    gives each row's best n of all its candidates (highest value, then lowest id), ties
    across chunks and -0.0 included."""
    from poot.engine.sampling import _ranked_rows
    rng = np.random.default_rng(11)
    for trial in range(200):
        R, chunks, width = int(rng.integers(1, 5)), int(rng.integers(1, 70)), int(rng.integers(1, 20))
        values = rng.standard_normal((R, chunks, width)).astype(np.float32) * 3
        if trial % 3 == 0:
            values = np.round(values)           # ties within and across chunks
        values[values == 0] = np.where(rng.random((values == 0).sum()) < 0.5, -0.0, 0.0)
        values = -np.sort(-values, axis=2)      # each chunk best first
        ids = rng.permutation(R * chunks * width).reshape(R, chunks, width).astype(np.int32)
        n = int(rng.integers(1, chunks * width + 1))
        got_values, got_ids = _ranked_rows(values, ids, n)
        for r in range(R):
            order = sorted(zip(values[r].ravel().tolist(), ids[r].ravel().tolist()),
                           key=lambda c: (-c[0], c[1]))[:n]
            assert got_ids[r].tolist() == [i for _, i in order]
            assert got_values[r].tolist() == [v for v, _ in order]
