"""Choosing the next token from logits: the numpy definition every runner must match.

Per row, the logits are first edited (`edit_logits`). A row with edits (SamplingRows.edits:
its repetition penalty, then its frequency and presence penalties, then its logit_bias and
min_tokens' bans, folded into one edit a token by engine/logit_controls.py) has each edited
token's logit x become (x / repeat if x > 0 else x * repeat) + add, never below BANNED (a ban
adds -inf); then a constrained row (SamplingRows.masks) has every token its mask leaves out
become BANNED. All that follows sees the edited logits, on every runner (the device runners
edit them in place, before their greedy choice and candidates): log probabilities too, so
`logprobs` report how likely each token was under the row's edited logits (where a request has
no edits, the model's raw logits), before the temperature and the cuts, which shape only the
choice. Temperature 0 takes the argmax (lowest id on ties). Otherwise the logits are divided by
the temperature, sorted (highest first, lower id first on ties), cut to the top k, then to the
smallest prefix whose probability reaches top_p, then to tokens with probability at least
min_p times the highest; the survivors are renormalised and one is drawn by inverse CDF with
the row's uniform number u(seed, step). The draw depends only on (seed, step), so a seeded
request gives the same tokens alone or batched, on any backend that follows this definition. A forced
row (SamplingRows.forced) samples nothing: its token is the one given, scored as a chosen one
(a forced row has no edits: it scores the model's own logits).

`choose` is that choice as written; `sample` takes each row's token from `choose_sorted`,
which gives the same token from a plain sort of the values instead of a stable argsort of the
ids, and the top log probabilities from a partial sort (`best`). `choose_among` takes it from a
row's candidates alone (a device's best few of each chunk of the row, with each chunk's sum),
where they decide it. `sample`, `sample_row` and the candidates take edited logits: the
reference runner edits with `edit_logits` first, a device runner reads back rows it edited.
"""
import numpy as np

from ..kernels.ops import LOWEST
from .batch import StepOutput

_MASK64 = (1 << 64) - 1
# The logit of a banned token: the lowest finite float32. Not -inf: a device's chunk of a row
# whose tokens are all banned still sums exp(0)s rather than NaNs (choice.top_candidates), and
# every log probability stays a number; under any token that is not banned its probability is
# exactly 0 (the exponential underflows).
BANNED = np.float32(LOWEST)


def splitmix64(x):
    """The splitmix64 finaliser on Python ints (64-bit wrap-around)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed, step):
    """A number in [0, 1) that is a pure function of (seed, step): 53 bits of splitmix64."""
    return (splitmix64(splitmix64(int(seed)) ^ int(step)) >> 11) * (1.0 / (1 << 53))


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def choose(logits, temperature, top_k, top_p, min_p, u):
    """The token of one row (logits float32 [V])."""
    if temperature <= 0:
        return int(np.argmax(logits))
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    return choose_in(order, logits, temperature, top_p, min_p, u)


def best(values, n):
    """The first n of np.argsort(-values, kind="stable") (highest first, lower index first on
    ties) without sorting the rest: a partition finds the n-th value, ties at it go by index."""
    if n >= len(values):
        return np.argsort(-values, kind="stable")
    edge = -np.partition(-values, n - 1)[n - 1]
    above = np.flatnonzero(values > edge)
    index = np.concatenate([above, np.flatnonzero(values == edge)[:n - len(above)]])
    return index[np.lexsort((index, -values[index]))]


def choose_sorted(logits, temperature, top_k, top_p, min_p, u):
    """choose()'s token without its stable argsort: the cuts and the draw depend only on the
    sorted values (equal values weigh the same), so they run on a plain sort of the values, and
    the position drawn becomes a token as the stable order would place it: the j-th lowest id
    of the tokens holding that value. A top-k cut sorts only the best k; a whole row is sorted
    only where its binned sums cannot place the cuts and the draw (_binned_draw)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    if np.isnan(logits.max()):                      # NaN sorts differently: the definition
        return choose(logits, temperature, top_k, top_p, min_p, u)
    values = None
    if 0 < top_k < len(logits):                     # only the best k need sorting
        values = np.sort(np.partition(logits, len(logits) - top_k)[len(logits) - top_k:])[::-1]
        at = _draw(values, temperature, top_p, min_p, u)
    else:
        at, value = _binned_draw(logits, temperature, top_p, min_p, u)
        if at is None:
            values = np.sort(logits)[::-1]
            at = _draw(values, temperature, top_p, min_p, u)
    if values is not None:
        value = values[at]
    ties = np.flatnonzero(logits == value)
    return int(ties[at - int(np.count_nonzero(logits > value))])


BINS = 1024             # _binned_draw's bins of a row's values, spread over ...
BINNED_SPAN = 40.0      # ... this many units of logit / temperature below the highest
BINNED_MARGIN = 1e-10   # how near a cut or draw may come to a sum's rounding before a full sort


def _binned_draw(logits, temperature, top_p, min_p, u):
    """_draw()'s position on a whole row (no top-k cut) and the logit there, without sorting
    the row: each token's weight exp(x / temperature - highest) is summed into bins of the
    value (highest first, equal values together), and only the bins where the top-p cut and the
    draw fall are sorted. Sums taken in another order round differently, so (None, None) where
    a cut or the draw lies within BINNED_MARGIN of the total: the caller sorts the row."""
    x = logits.astype(np.float64) / temperature
    top = x.max()
    if not np.isfinite(top):
        return None, None
    weight = np.exp(x - top)                    # the definition's float64 weights, summed
    total = weight.sum()                        # in another order
    below = np.maximum(x - top, -BINNED_SPAN).astype(np.float32)
    bins = np.minimum(below * np.float32(-BINS / BINNED_SPAN), BINS - 1).astype(np.int32).astype(
        np.intp)                            # (numpy casts floats to intp slowly)
    ends = np.cumsum(np.bincount(bins, weights=weight, minlength=BINS))
    eps = BINNED_MARGIN * total

    def walk(mass):
        """The first position in sorted order whose cumulative weight passes `mass`, its logit
        and the weight through it; Nones where that lies within the margin of a sum."""
        b = int(np.searchsorted(ends, mass, side="right"))
        if b >= BINS:
            return None, None, None
        inside = np.sort(logits[bins == b])[::-1]
        before = ends[b - 1] if b else 0.0
        cum = before + np.cumsum(np.exp(inside.astype(np.float64) / temperature - top))
        j = int(np.searchsorted(cum, mass, side="right"))
        if j == len(inside) or cum[j] - mass <= eps or mass - (cum[j - 1] if j else before) <= eps:
            return None, None, None
        return int(np.count_nonzero(bins < b)) + j, inside[j], cum[j]

    cut, cut_mass = len(x), total
    if top_p < 1.0:             # the first position whose cumulative share reaches top_p
        at, _, cut_mass = walk(top_p * total)
        if at is None:
            return None, None
        cut = at + 1
    if min_p > 0.0:             # the tokens weighing at least min_p of the highest one
        if (np.count_nonzero(weight >= min_p * (1 - BINNED_MARGIN))
                != np.count_nonzero(weight >= min_p * (1 + BINNED_MARGIN))):
            return None, None
        kept = weight >= min_p
        if np.count_nonzero(kept) < cut:
            cut, cut_mass = int(np.count_nonzero(kept)), weight[kept].sum()
    at, value, _ = walk(u * cut_mass)
    if at is None or at >= cut:
        return None, None
    return at, value


def choose_in(order, logits, temperature, top_p, min_p, u):
    """The rest of choose() over tokens in its order, cut to its top-k: the temperature, the
    top-p and min-p cuts, the draw."""
    return int(order[_draw(logits[order], temperature, top_p, min_p, u)])


def _draw(values, temperature, top_p, min_p, u):
    """The position drawn among `values` (sorted, highest first): the temperature, the top-p
    and min-p cuts, then the inverse CDF at u."""
    scaled = values.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        probs = probs[:keep]
    if min_p > 0.0:
        probs = probs[probs >= min_p * probs[0]]
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)


SUM_MARGIN = 1e-4      # how far a device's float32 sums may be from the exact one, relatively


def choose_among(values, ids, maxima, sums, vocab, temperature, top_k, top_p, min_p, u):
    """choose()'s token of a row from a device's candidates (choice.top_candidates): for each chunk
    of the row, values and ids [chunks, keep] of its best `keep` (ids past the vocabulary are
    padding), its largest logit (maxima) and sum of exp((logit - largest) / temperature) (sums,
    within SUM_MARGIN). None where they cannot decide it: the caller reads the whole row.

    Every logit above `floor`, the highest keep-th candidate of a chunk whose candidates are all
    real, is a candidate, so the row's sorted order is known down to it. A top-k cut within that
    order, or no longer than `keep` (a row's best k are among its chunks' best k), is exact from
    the candidates with choose()'s arithmetic. Otherwise the row's total mass comes from the
    sums, and a top-p cut or the draw over the whole mass is taken only where every total within
    the margin gives the same answer; a min-p cut and a draw inside a known cut need no total."""
    token = choose_among_rows(values[None], ids[None], np.asarray(maxima)[None],
                              np.asarray(sums)[None], vocab, *(np.array([a]) for a in (
                                  temperature, top_k, top_p, min_p, u)))[0]
    return None if token < 0 else int(token)


RANKED_FIRST = 16       # the best candidates of each row choose_among ranks first
UNDECIDED, MORE = -1, -2


def choose_among_rows(values, ids, maxima, sums, vocab, temperature, top_k, top_p, min_p, u):
    """choose_among of R rows at once (values, ids [R, chunks, keep], maxima, sums [R, chunks],
    the rest [R]): their tokens, -1 where a row's candidates cannot decide it. Each row's order
    is ranked only as far as its cuts and draw read it: its first RANKED_FIRST, then four times
    more for the rows whose answer lies past them."""
    R, _, keep = values.shape
    tokens = np.full(R, UNDECIDED, np.int64)
    nan = np.isnan(sums).any(axis=1)            # a NaN logit: the definition's order, from the row
    full = ids[:, :, -1] < vocab                # chunks that may hold more than their keep
    floor = np.where(full, values[:, :, -1], -np.inf).max(axis=1)
    greedy = (temperature <= 0) & ~nan          # chunks are in id order, each best first
    rows = np.flatnonzero(greedy)
    tokens[rows] = ids[rows, np.argmax(values[rows, :, 0], axis=1), 0]
    for r in np.flatnonzero(~(greedy | nan) & (top_k > 0)):    # a top-k cut: the definition's
        k = int(top_k[r])
        if k > keep and k > _known(values, ids, floor, vocab, [r], keep)[0][0]:
            continue
        ranked, ranked_ids = _ranked_rows(values[r:r + 1, :, :k], ids[r:r + 1, :, :k], k)
        real = ranked_ids[0] < vocab
        tokens[r] = ranked_ids[0][real][_draw(ranked[0][real], temperature[r], top_p[r],
                                              min_p[r], u[r])]
    rows = np.flatnonzero(~(greedy | nan) & (top_k <= 0))
    peak = values[rows, :, 0].max(axis=1).astype(np.float64)
    total = np.sum(np.asarray(sums[rows], np.float64) * np.exp(
        (np.asarray(maxima[rows], np.float64) - peak[:, None]) / temperature[rows, None]), axis=1)
    bounds = np.stack([total * (1 - SUM_MARGIN), total * (1 + SUM_MARGIN)], axis=1)
    n = RANKED_FIRST
    while len(rows):            # the rows whose answer lies past the order ranked so far
        width = min(n, keep)
        known, whole = _known(values, ids, floor, vocab, rows, width)
        known = np.where(whole, known, np.maximum(known, n + 1))    # more past n where not all
        some = known > 0                        # none known: ties at the floor from the best on
        rows, bounds, known = rows[some], bounds[some], known[some]
        if not len(rows):
            break
        limit = np.minimum(known, n)
        ranked, ranked_ids = _ranked_rows(values[rows, :, :width], ids[rows, :, :width],
                                          int(limit.max()))
        at = _positions(ranked, temperature[rows], bounds, top_p[rows], min_p[rows], u[rows],
                        limit, known <= n)
        picked = at >= 0
        tokens[rows[picked]] = ranked_ids[picked, at[picked]]
        again = at == MORE
        rows, bounds = rows[again], bounds[again]
        if n == RANKED_FIRST:
            rows, bounds = _reachable(rows, bounds, values, ids, floor, vocab, temperature, top_p,
                                      min_p, u)
        n *= 4
    return tokens


def _reachable(rows, bounds, values, ids, floor, vocab, temperature, top_p, min_p, u):
    """The rows (and their bounds) whose top-p cut, min-p cut or draw may lie among their
    candidates above the floor: for the rest, whose reach certainly passes the mass (or, min-p
    alone, the lowest value) of those, ranking every candidate would only find so. The margin
    covers the float32 sum here against the exact one that decides the rows kept."""
    t = temperature[rows, None, None].astype(np.float32)
    peak = values[rows, :, 0].max(axis=1)
    above = (values[rows] > floor[rows, None, None]) & (ids[rows] < vocab)
    weights = np.exp((np.where(above, values[rows], -np.inf) - peak[:, None, None]) / t)
    mass = weights.sum(axis=(1, 2), dtype=np.float64)
    lowest = np.where(above, weights, np.float32(np.inf)).min(axis=(1, 2))
    cut, floor_only = top_p[rows] < 1.0, (top_p[rows] >= 1.0) & (min_p[rows] > 0.0)
    reach = np.where(cut, top_p[rows], u[rows]) * bounds[:, 1]
    past = np.where(floor_only, lowest > min_p[rows] * (1 + REACH_MARGIN),
                    mass < reach * (1 - REACH_MARGIN))
    return rows[~past], bounds[~past]


REACH_MARGIN = 1e-5


def _known(values, ids, floor, vocab, rows, width):
    """For `rows`: how many of their candidates above the floor (the first of the row's
    order, all known) lie in each chunk's first `width`, and whether that is all of them (no
    chunk's width-th is above it)."""
    above = (values[rows, :, :width] > floor[rows, None, None]) & \
        (ids[rows, :, :width] < vocab)
    return above.sum(axis=(1, 2)), (width == values.shape[2]) | ~above[:, :, -1].any(axis=1)


def _positions(values, temperature, bounds, top_p, min_p, u, limit, whole):
    """choose_among's position of each row among its first `limit` candidates in order (values
    [R, n], sorted, highest first; limit <= n): the top-p cut at the totals `bounds` [R, 2]
    allow, the min-p cut, the draw. UNDECIDED where those totals give different answers or the
    answer lies past the known order (`whole`: limit is all of it), MORE where it lies past
    limit and more is known. A count over the first limit is min(count over n, limit): the
    cumulative weights rise, the weights fall."""
    scaled = values.astype(np.float64) / temperature[:, None]
    weights = np.exp(scaled - scaled[:, :1])
    cdf = np.cumsum(weights, axis=1)
    columns = np.arange(values.shape[1])

    def count(below):
        return np.minimum(below.sum(axis=1), limit)

    past = np.where(whole, UNDECIDED, MORE)
    out = np.full(len(values), UNDECIDED, np.int64)
    settled = np.zeros(len(values), bool)
    kept = np.where(top_p < 1.0, 0, -1)
    cut = top_p < 1.0
    if cut.any():
        lo, hi = (count(cdf < (top_p * bounds[:, j])[:, None]) for j in (0, 1))
        beyond, open_ = cut & (np.maximum(lo, hi) >= limit), cut & (lo != hi)
        out = np.where(beyond, past, out)
        settled |= beyond | open_
        kept = np.where(cut, lo + 1, kept)
    floor = min_p > 0.0
    if floor.any():
        within = columns[None, :] < np.where(kept > 0, kept, limit)[:, None]
        passing = count(within & (weights >= min_p[:, None] * weights[:, :1]))
        beyond = floor & ~settled & (kept < 0) & (passing == limit)
        out = np.where(beyond, past, out)
        settled |= beyond
        kept = np.where(floor, passing, kept)
    has_kept = ~settled & (kept > 0)
    if has_kept.any():
        last = cdf[np.arange(len(cdf)), np.clip(kept, 1, len(columns)) - 1]    # settled: any
        within = columns[None, :] < kept[:, None]
        drawn = np.minimum((within & (cdf <= (u * last)[:, None])).sum(axis=1), kept - 1)
        out = np.where(has_kept, drawn, out)
    free = ~settled & (kept < 0)
    if free.any():
        lo, hi = (count(cdf <= (u * bounds[:, j])[:, None]) for j in (0, 1))
        drawn = np.where(np.maximum(lo, hi) >= limit, past, np.where(lo != hi, UNDECIDED, lo))
        out = np.where(free, drawn, out)
    return out


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


def logprobs_among(values, ids, maxima, sums, vocab, temperature, top_k, top_p, min_p, u, n,
                   forced=-1):
    """sample()'s row from a device's candidates (choose_among's arguments, sums at temperature
    1): (token, its log probability, the n best ids and theirs), the log probabilities those of
    the (edited) logits, log(sum of exp) from the chunks' sums. None where choose_among cannot
    decide the token, where the row samples at another temperature (its sums would be
    another's), or where n is more than a chunk keeps (a row's best n are among its chunks' best
    n). A forced row's token is `forced` (>= 0): None where it is no candidate (its logit is
    not known)."""
    if n > values.shape[1]:
        return None
    if forced >= 0:
        token = forced
    elif temperature > 0 and temperature != 1.0:
        return None
    else:
        token = choose_among(values, ids, maxima, sums, vocab, temperature, top_k, top_p, min_p,
                             u)
    if token is None:
        return None
    mine = ids == token
    if not np.any(mine):
        return None
    best_values, best_ids = _ranked_rows(values[None, :, :n], ids[None, :, :n], n)  # best()'s
    real = best_ids[0] < vocab
    best_values, best_ids = best_values[0][real], best_ids[0][real]
    peak = np.float64(values[:, 0].max())
    total = np.sum(np.asarray(sums, np.float64) * np.exp(np.asarray(maxima, np.float64) - peak))
    norm = peak + np.log(total)
    return token, np.float64(values[mine][0]) - norm, best_ids, best_values.astype(np.float64) - norm


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
            float(rows.min_p[r]), uniform(rows.seed[r], rows.step[r]))


def choice_arrays(rows, R):
    """choice_args of the first R rows of SamplingRows `rows`, each an array [R]."""
    return (rows.temperature[:R].astype(np.float64), rows.top_k[:R].astype(np.int64),
            rows.top_p[:R].astype(np.float64), rows.min_p[:R].astype(np.float64),
            np.array([uniform(rows.seed[r], rows.step[r]) for r in range(R)], np.float64))


def token_of(logits, rows, r):
    """Row r's token from its edited logits [V]: its forced token (SamplingRows.forced), or the
    one choose_sorted draws."""
    if rows.forced is not None and rows.forced[r] >= 0:
        return int(rows.forced[r])
    return choose_sorted(logits, *choice_args(rows, r))


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
