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
    of the tokens holding that value. A float sort of 128k logits takes a fraction of a
    millisecond where the stable argsort takes ~10."""
    if temperature <= 0:
        return int(np.argmax(logits))
    values = np.sort(logits)[::-1]
    if np.isnan(values[0]):                         # NaN sorts differently: the definition
        return choose(logits, temperature, top_k, top_p, min_p, u)
    if top_k > 0:
        values = values[:top_k]
    at = _draw(values, temperature, top_p, min_p, u)
    value = values[at]
    ties = np.flatnonzero(logits == value)
    return int(ties[at - int(np.count_nonzero(values > value))])


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
    keep = values.shape[1]
    full = ids[:, -1] < vocab                       # chunks that may hold more than their keep
    floor = values[full, -1].max() if full.any() else -np.inf
    real = ids < vocab
    values, ids = values[real], ids[real]
    order = np.lexsort((ids, -values))              # highest value first, lower id on ties
    if temperature <= 0:
        return int(ids[order[0]])
    known = int(np.count_nonzero(values > floor))   # the sorted order's first `known` are right
    if top_k > 0:
        if top_k > max(keep, known):
            return None
        return int(ids[choose_in(order[:top_k], values, temperature, top_p, min_p, u)])
    if known == 0:                                  # ties at the floor from the best value on
        return None
    scaled = values[order[:known]].astype(np.float64) / temperature
    weights = np.exp(scaled - scaled[0])
    total = float(np.sum(np.asarray(sums, np.float64)
                         * np.exp((np.asarray(maxima, np.float64) - values[order[0]])
                                  / temperature)))
    bounds = (total * (1 - SUM_MARGIN), total * (1 + SUM_MARGIN))
    cdf = np.cumsum(weights)
    kept = None
    if top_p < 1.0:
        at = {int(np.searchsorted(cdf, top_p * t)) for t in bounds}
        if len(at) > 1 or max(at) >= known:
            return None
        kept = at.pop() + 1
    if min_p > 0.0:
        passing = int(np.count_nonzero(weights[:kept] >= min_p * weights[0]))
        if kept is None and passing == known:
            return None
        kept = passing
    if kept is not None:
        index = min(int(np.searchsorted(cdf[:kept], u * cdf[kept - 1], side="right")), kept - 1)
        return int(ids[order[index]])
    at = {int(np.searchsorted(cdf, u * t, side="right")) for t in bounds}
    if len(at) > 1 or max(at) >= known:
        return None
    return int(ids[order[at.pop()]])


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
    real = ids < vocab
    values, ids = values[real].astype(np.float64), ids[real]
    if not np.any(ids == token):
        return None
    order = np.lexsort((ids, -values))[:n]          # best() of the row: lower id on ties
    peak = values.max()
    total = np.sum(np.asarray(sums, np.float64) * np.exp(np.asarray(maxima, np.float64) - peak))
    norm = peak + np.log(total)
    return token, values[ids == token][0] - norm, ids[order], values[order] - norm


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
