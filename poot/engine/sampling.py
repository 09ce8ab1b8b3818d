"""Choosing the next token from logits: the numpy definition every runner must match.

Per row, the logits are first edited (`edit_logits`). A row with edits (SamplingRows.edits:
its repetition penalty, then its frequency and presence penalties, then its logit_bias and
min_tokens' bans, folded into one edit a token by engine/logit_controls.py) has each edited
token's logit x become (x / repeat if x > 0 else x * repeat) + add, never below BANNED (a ban
adds -inf); then a constrained row (SamplingRows.masks) has every token its mask leaves out
become BANNED. All that follows sees the edited logits, on every runner (the device runners
edit them in place, before their choice): log probabilities too, so `logprobs` report how
likely each token was under the row's edited logits (where a request has no edits, the model's
raw logits), before the temperature and the cuts, which shape only the choice.

Temperature 0 takes the argmax (lowest id on ties). Otherwise each token weighs an integer, its
softmax weight exp((x - max) / temperature) with its distance below the highest truncated to a
step of 1/STEPS of an octave, held as a fraction of 2^31 (`weights`): sums of integers are
exact in any order, so a device that sums a row in parallel draws the very token this module
does. Tokens rank by weight, then by id (the ranking's key is the weight's step q). The row is
cut to the first top_k, then to the shortest prefix whose weight reaches top_p of what is left,
then to the tokens weighing at least min_p of the highest; one token of what is kept is then
drawn, walking the kept tokens in that order to where their running weight passes bits / 2^32
of the kept weight, with the row's 32 random bits draw_bits(seed, step). The draw depends only on
(seed, step) and the logits, so a seeded request gives the same tokens alone or batched, on any
backend, wherever its logits come out the same. A forced row (SamplingRows.forced) samples
nothing: its token is the one given, scored as a chosen one (a forced row has no edits: it
scores the model's own logits).

`choose` is that definition as written (a sort of the row); `choose_counted` gives the same
token from counts of the weights' steps, as the device kernel (kernels/choice.py's `draw`)
finds it, and is what the host samples with.
"""
import math
from decimal import Decimal, localcontext
from functools import lru_cache

import numpy as np

from ..kernels import choice
from ..kernels.ops import LOWEST
from .batch import StepOutput

# The logit of a banned token: the lowest finite float32. Not -inf: every log probability stays
# a number, and under any token that is not banned its weight is 0.
BANNED = np.float32(LOWEST)
HIGHEST = np.float32(np.finfo(np.float32).max)

# A weight's steps an octave (a weight is the softmax's within 4.2e-5), the highest token's
# weight (2^WEIGHT_BITS) and the last step (2^-31 of the highest; past it, weights are 0)
STEPS, WEIGHT_BITS, Q_LAST = choice.STEPS, choice.WEIGHT_BITS, choice.Q_LAST


def _exp2_table():
    """round(2^31 * 2^(-i / STEPS)) for i < STEPS, as uint32, the same on every machine: from
    float64 powers, which lie within 1e-6 of the exact value, save where one lies that near a
    half, which exact decimal arithmetic settles (no libm's rounding decides an entry)."""
    exact = 2.0 ** (WEIGHT_BITS - np.arange(STEPS) / STEPS)
    table = np.floor(exact + 0.5)
    with localcontext() as context:
        context.prec = 40
        for i in np.flatnonzero(np.abs(exact - np.floor(exact) - 0.5) < 1e-6):
            table[i] = int((Decimal(2) ** (Decimal(WEIGHT_BITS) - Decimal(int(i)) / STEPS))
                           .to_integral_value())
    return table.astype(np.uint32)


EXP2 = _exp2_table()


def splitmix64(x):
    """The splitmix64 finaliser of each of a uint64 array (numpy's arithmetic wraps as 64-bit
    arithmetic does)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def draw_bits(seed, step):
    """The random bits of rows at their steps (uint64 arrays, or one row's ints): a pure
    function of (seed, step), splitmix64's top 32."""
    bits = splitmix64(splitmix64(np.atleast_1d(np.asarray(seed, np.uint64)))
                      ^ np.asarray(step, np.uint64)) >> np.uint64(32)
    return bits if np.ndim(seed) else int(bits[0])


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def step_scale(temperature):
    """The float32 the logits' distance below the highest is multiplied by to make its step:
    STEPS / (temperature * ln 2), at most the largest float32."""
    return np.float32(min(STEPS / (float(temperature) * math.log(2)), float(HIGHEST)))


def weights(logits, temperature):
    """(q, w) of each token of a row at a temperature > 0: q its step below the highest,
    min((max - x) * step_scale, Q_LAST) in float32 arithmetic (each operation rounded as IEEE
    does everywhere) truncated to an integer, and w = EXP2[q % STEPS] >> (q // STEPS), uint32.
    A NaN logit counts as BANNED, and infinities as the largest finite floats."""
    x = np.asarray(logits, np.float32)
    x = np.where(np.isnan(x), BANNED, np.clip(x, BANNED, HIGHEST)).astype(np.float32)
    with np.errstate(over="ignore"):
        scaled = (x.max() - x) * step_scale(temperature)
    q = np.minimum(scaled, np.float32(Q_LAST)).astype(np.uint32)
    return q, EXP2[q % STEPS] >> (q // STEPS)


STEP_WEIGHTS = EXP2[np.arange(Q_LAST + 1) % STEPS] >> (np.arange(Q_LAST + 1) // STEPS)


@lru_cache(maxsize=256)
def min_p_step(min_p):
    """The last step a token may be at to weigh at least min_p (at most 1) of the highest:
    the last q whose weight is at least ceil(min_p * 2^31)."""
    floor = math.ceil(float(min_p) * 2.0 ** WEIGHT_BITS)
    return max(int(np.count_nonzero(STEP_WEIGHTS >= floor)) - 1, 0)


def top_p_target(top_p, total):
    """The weight a top-p prefix must reach: ceil(p * total / 2^32), p = floor(top_p * 2^32)."""
    return -((-int(top_p * 2.0 ** 32) * int(total)) >> 32)


def draw_index(running, bits):
    """The position drawn from running weights (uint64, the kept tokens' in ranking order):
    the first whose running weight passes bits / 2^32 of the last."""
    return int(np.searchsorted(running, (int(bits) * int(running[-1])) >> 32, "right"))


def choose(logits, temperature, top_k, top_p, min_p, bits):
    """The token of one row (logits float32 [V]), as the module's first paragraphs define it."""
    if temperature <= 0:
        return int(np.argmax(logits))
    q, w = weights(logits, temperature)
    order = np.lexsort((np.arange(len(q)), q))          # by step, then id
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1.0:
        running = np.cumsum(w[order], dtype=np.uint64)
        order = order[:int(np.searchsorted(running, top_p_target(top_p, running[-1]))) + 1]
    if min_p > 0.0:
        order = order[q[order] <= min_p_step(min_p)]
    return int(order[draw_index(np.cumsum(w[order], dtype=np.uint64), bits)])


def choose_counted(logits, temperature, top_k, top_p, min_p, bits):
    """choose()'s token without sorting the row, as the device's `draw` finds it: every cut
    keeps a prefix of the ranking, (last, n): the tokens at steps below `last` and the first n
    (in id order) at it, found from the count and weight of the tokens at each step (a step's
    tokens weigh the same); so is the draw's position, the n-th token of its step. Counted in
    two levels, as the kernel counts: the steps' coarse bins (choice.COARSE of 2^FINE_BITS
    steps) for the whole row, then the steps of the one bin a prefix ends in."""
    if temperature <= 0:
        return int(np.argmax(logits))
    q, w = weights(logits, temperature)
    fine = 1 << choice.FINE_BITS
    coarse = q >> choice.FINE_BITS
    # a bin's weight summed in float64 is exact: the row's whole weight is below 2^53
    totals = {"count": np.cumsum(np.bincount(coarse, minlength=choice.COARSE)),
              "weight": np.cumsum(np.bincount(coarse, w, choice.COARSE).astype(np.uint64))}
    ones = np.ones(fine, np.uint64)
    binned = {}

    def steps_of(c, kind):
        """(running, unit): the count or weight of the tokens before bin c's steps and
        through each of them (running[f + 1]: through step f), and a step's token's share."""
        if (c, kind) not in binned:
            unit = ones if kind == "count" else STEP_WEIGHTS[c * fine:(c + 1) * fine]
            at = np.bincount(q[coarse == c] & (fine - 1), minlength=fine).astype(np.uint64)
            before = int(totals[kind][c - 1]) if c else 0
            binned[c, kind] = np.concatenate([[before], before + np.cumsum(at * unit)]), unit
        return binned[c, kind]

    def prefix(target, kind):
        """(step, its first n) of the shortest prefix, one token at least, whose count or
        weight reaches target."""
        c = int(np.searchsorted(totals[kind], target))
        running, unit = steps_of(c, kind)
        f = int(np.searchsorted(running[1:], target))
        return c * fine + f, max(1, -(-(target - int(running[f])) // int(unit[f])))

    def weight_of(last, n):
        """The weight of the prefix (last, n)."""
        if last > Q_LAST:
            return int(totals["weight"][-1])
        c, f = divmod(last, fine)
        running, unit = steps_of(c, "weight")
        return int(running[f]) + n * int(unit[f])

    last, n = Q_LAST + 1, 0                             # all of them
    if 0 < top_k < len(q):
        last, n = prefix(top_k, "count")
    if top_p < 1.0:
        last, n = prefix(top_p_target(top_p, weight_of(last, n)), "weight")
    if min_p > 0.0:
        last, n = min((last, n), (min_p_step(min_p) + 1, 0))
    step, nth = prefix(((int(bits) * weight_of(last, n)) >> 32) + 1, "weight")
    return int(np.flatnonzero(q == step)[nth - 1])


def best(values, n):
    """The first n of np.argsort(-values, kind="stable") (highest first, lower index first on
    ties) without sorting the rest: a partition finds the n-th value, ties at it go by index."""
    if n >= len(values):
        return np.argsort(-values, kind="stable")
    edge = -np.partition(-values, n - 1)[n - 1]
    above = np.flatnonzero(values > edge)
    index = np.concatenate([above, np.flatnonzero(values == edge)[:n - len(above)]])
    return index[np.lexsort((index, -values[index]))]


def _ranked_rows(values, ids, n):
    """The values and ids [R, n] of the best n candidates of each row of values, ids
    [R, chunks, width] (each chunk's first `width`: a row's best n <= width are among them), in
    choose()'s order (highest value, then lowest id; padding past the vocabulary last), without
    sorting the rest: a row has thousands, its cuts read a few. One int64 key a candidate
    orders both ways: the value's bits made to sort as integers, negated, above the id.
    Only the chunks whose best reaches the n-th best of the chunks' bests are read: a row's n
    best candidates reach it (those n bests do), so their chunks' bests do too."""
    R, chunks, _ = values.shape
    if 0 < n < chunks and not np.isnan(values).any():     # (a NaN orders no chunk)
        firsts = values[:, :, 0]
        reach = np.partition(firsts, chunks - n, axis=1)[:, chunks - n]
        m = int((firsts >= reach[:, None]).sum(axis=1).max())
        if m < chunks:
            kept = np.argpartition(-firsts, m - 1, axis=1)[:, :m, None]
            values = np.take_along_axis(values, kept, axis=1)
            ids = np.take_along_axis(ids, kept, axis=1)
    values = values.reshape(R, -1) + np.float32(0.0)       # -0.0 ties with 0.0
    bits = values.view(np.int32)
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
    keys = (-order << 32) | ids.reshape(R, -1).astype(np.int64)
    if n < keys.shape[1]:
        keys = np.partition(keys, n - 1, axis=1)[:, :n]
    keys = np.sort(keys, axis=1)
    order = (-(keys >> 32)).astype(np.int32)
    ranked = (order ^ ((order >> 31) & 0x7FFFFFFF)).view(np.float32)
    return ranked, (keys & 0xFFFFFFFF).astype(np.int64)


SUM_MARGIN = 1e-4      # how far a device's float32 sums may be from the exact one, relatively


def logprobs_among(values, ids, maxima, sums, vocab, token, n):
    """sample_row()'s log probabilities of a row whose token is known, from a device's
    candidates (choice.top_candidates at temperature 1: for each chunk of the row, values and
    ids [chunks, keep] of its best `keep`, ids past the vocabulary padding; its largest logit
    (maxima) and sum of exp(logit - largest) (sums, within SUM_MARGIN)): (the token's log
    probability, the n best ids and theirs), log(sum of exp) from the chunks' sums. None where
    the token is no candidate (its logit is not known) or n is more than a chunk keeps (a row's
    best n are among its chunks' best n)."""
    mine = ids == token
    if n > values.shape[1] or not np.any(mine):
        return None
    best_values, best_ids = _ranked_rows(values[None, :, :n], ids[None, :, :n], n)  # best()'s
    real = best_ids[0] < vocab
    best_values, best_ids = best_values[0][real], best_ids[0][real]
    peak = np.float64(values[:, 0].max())
    total = np.sum(np.asarray(sums, np.float64) * np.exp(np.asarray(maxima, np.float64) - peak))
    norm = peak + np.log(total)
    return np.float64(values[mine][0]) - norm, best_ids, best_values.astype(np.float64) - norm


def edit_row(logits, rows, r):
    """Row r of SamplingRows `rows` as sampling sees its logits [V] (the module's first
    paragraph): a new array where the row has edits or a mask, else the row itself."""
    edits, masked = rows.edits, rows.masked
    if edits is not None and edits.count(r):
        tokens, repeat, add = edits.row(r)
        logits = np.array(logits, np.float32)
        x = logits[tokens]
        logits[tokens] = np.maximum(np.where(x > 0, x / repeat, x * repeat) + add, BANNED)
    if masked is not None and masked[r]:
        bits = np.unpackbits(np.ascontiguousarray(rows.masks[r]).view(np.uint8),
                             bitorder="little")
        allowed = np.zeros(len(logits), bool)
        n = min(len(bits), len(logits))
        allowed[:n] = bits[:n]
        logits = np.where(allowed, logits, BANNED).astype(np.float32)
    return logits


def edit_logits(logits, rows):
    """The logits [R, V] of SamplingRows `rows` as sampling sees them (edit_row of each row;
    the logits themselves where no row has edits or a mask)."""
    if rows.edits is None and rows.masked is None:
        return logits
    return np.stack([edit_row(logits[r], rows, r) for r in range(len(logits))])


def choice_args(rows, r):
    """choose()'s arguments after the logits for row r of SamplingRows `rows`."""
    return (float(rows.temperature[r]), int(rows.top_k[r]), float(rows.top_p[r]),
            float(rows.min_p[r]), draw_bits(rows.seed[r], rows.step[r]))


def draw_rows(rows, count):
    """uint32 [count, choice.DRAW_WORDS]: the draw's parameters of SamplingRows `rows` as
    choice.draw reads them; rows past its own, greedy rows and forced rows draw nothing."""
    out = np.zeros((count, choice.DRAW_WORDS), np.uint32)
    R = len(rows.temperature)
    draws = rows.temperature > 0
    if rows.forced is not None:
        draws &= rows.forced < 0
    if not draws.any():
        return out
    t = np.where(draws, rows.temperature, 1).astype(np.float64)
    top_p, min_p = rows.top_p.astype(np.float64), rows.min_p.astype(np.float64)
    cut = top_p < 1.0
    out[:R, 0] = np.minimum(STEPS / (t * math.log(2)), float(HIGHEST)).astype(np.float32).view(
        np.uint32)                                      # step_scale, each row's
    out[:R, 1] = np.maximum(rows.top_k, 0)
    out[:R, 2] = np.where(cut, np.floor(np.clip(top_p, 0, 1) * 2.0 ** 32), 0).astype(np.uint32)
    out[:R, 3] = [min_p_step(float(m)) if m > 0 else Q_LAST for m in min_p]
    out[:R, 4] = draw_bits(rows.seed, rows.step)
    out[:R, choice.FLAGS] = np.where(draws, choice.DRAWS | np.where(cut, choice.TOP_P_CUT, 0), 0)
    out[~np.concatenate([draws, np.zeros(count - R, bool)])] = 0
    return out


def token_of(logits, rows, r):
    """Row r's token from its edited logits [V]: its forced token (SamplingRows.forced), or the
    one choose_counted draws."""
    if rows.forced is not None and rows.forced[r] >= 0:
        return int(rows.forced[r])
    return choose_counted(logits, *choice_args(rows, r))


def sample_row(logits, rows, r, k):
    """sample()'s row r of SamplingRows `rows` alone, from its edited logits [V]: (token, its
    log probability, the k best ids and theirs)."""
    token = token_of(logits, rows, r)
    logprobs = log_softmax(np.asarray(logits, np.float32))
    top = best(logprobs, k) if k else np.zeros(0, np.int64)
    return token, logprobs[token], top, logprobs[top]


def sample(logits, rows):
    """StepOutput for edited logits [R, V] (edit_logits) under SamplingRows `rows` (token_of
    each row)."""
    logits = np.asarray(logits, np.float32)
    n_rows = logits.shape[0]
    tokens = np.array([token_of(logits[r], rows, r) for r in range(n_rows)], dtype=np.int32)
    k = rows.n_logprobs
    if not (rows.logprobs or k):        # nobody reports them: left out (batch.SamplingRows)
        return StepOutput(tokens=tokens, logprobs=np.zeros(n_rows, np.float32),
                          top_ids=np.zeros((n_rows, 0), np.int32),
                          top_logprobs=np.zeros((n_rows, 0), np.float32))
    logprobs = log_softmax(logits)
    chosen = logprobs[np.arange(n_rows), tokens].astype(np.float32)
    if k:
        top = np.array([best(row, k) for row in logprobs], np.int32).reshape(n_rows, k)
        top_lp = np.take_along_axis(logprobs, top, axis=-1).astype(np.float32)
    else:
        top = np.zeros((n_rows, 0), np.int32)
        top_lp = np.zeros((n_rows, 0), np.float32)
    return StepOutput(tokens=tokens, logprobs=chosen, top_ids=top, top_logprobs=top_lp)
