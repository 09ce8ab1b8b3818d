"""Choosing the next token from logits: the numpy definition every runner must match.

Per row: log probabilities of the raw logits are what `logprobs` report. Temperature 0 takes the
argmax (lowest id on ties). Otherwise the logits are divided by the temperature, sorted (highest
first, lower id first on ties), cut to the top k, then to the smallest prefix whose probability
reaches top_p, then to tokens with probability at least min_p times the highest; the survivors
are renormalised and one is drawn by inverse CDF with the row's uniform number u(seed, step). The
draw depends only on (seed, step), so a seeded request gives the same tokens alone or batched,
on any backend that follows this definition.
"""
import numpy as np

from .batch import StepOutput

_MASK64 = (1 << 64) - 1


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
    scaled = logits[order].astype(np.float64) / temperature
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        probs = probs[:keep]
    if min_p > 0.0:
        probs = probs[probs >= min_p * probs[0]]
    cdf = np.cumsum(probs)
    index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)
    return int(order[index])


def sample(logits, rows):
    """StepOutput for logits [R, V] under SamplingRows `rows`."""
    logits = np.asarray(logits, np.float32)
    n_rows = logits.shape[0]
    logprobs = log_softmax(logits)
    tokens = np.array([
        choose(logits[r], float(rows.temperature[r]), int(rows.top_k[r]), float(rows.top_p[r]),
               float(rows.min_p[r]), uniform(rows.seed[r], rows.step[r]))
        for r in range(n_rows)], dtype=np.int32)
    chosen = logprobs[np.arange(n_rows), tokens].astype(np.float32)
    k = rows.n_logprobs
    if k:
        top = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k].astype(np.int32)
        top_lp = np.take_along_axis(logprobs, top, axis=-1).astype(np.float32)
    else:
        top = np.zeros((n_rows, 0), np.int32)
        top_lp = np.zeros((n_rows, 0), np.float32)
    return StepOutput(tokens=tokens, logprobs=chosen, top_ids=top, top_logprobs=top_lp)
