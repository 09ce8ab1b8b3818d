"""Soft-capping and the sliding window, the parts of Gemma's attention and logits the other
families lack, written once for every kernel that needs them.

`capped` is the cap of one value (the attention kernels cap their scores with it), `softcap`
the kernel that caps a step's logits (the graph IR's `softcap` op), `window_start`,
`first_key` and `sees` the keys tokens of a sliding-window layer see, and `suffix` the part of
an attention kernel's name that says which of these it has (none: the name and the code are
those of the plain kernel).
"""
from functools import cache

from .lang import F32, I32, KernelBuilder

WG = 256


def capped(k, x, cap):
    """tanh(x / cap) * cap, as cap - 2 cap / (1 + exp(2 x / cap)): the same value from exp,
    which every target computes to near float precision (PTX's tanh is approximate); an exp
    that overflows gives cap, one that underflows -cap."""
    return cap - (2.0 * cap) / (1.0 + k.exp(x * (2.0 / cap)))


def window_start(k, position, window):
    """The first position a token at `position` attends to in a layer of this `window`."""
    return k.max(position - (window - 1), 0)


def first_key(k, positions, window):
    """The first key any of the tokens at `positions` sees in a layer of this `window`."""
    least = positions[0]
    for p in positions[1:]:
        least = k.min(least, p)
    return window_start(k, least, window)


def sees(j, position, window):
    """Whether a token at `position` sees key j: causally, and within its window if any."""
    inside = j <= position
    return inside & (j > position - window) if window else inside


def suffix(window=0, softcap=0.0):
    """The name part of an attention kernel with a window and a cap (empty without either)."""
    cap = f"{softcap:g}".replace(".", "p").replace("-", "m").replace("+", "")
    return (f"_w{window}" if window else "") + (f"_cap{cap}" if softcap else "")


@cache
def softcap(cap):
    """out[i] = tanh(x[i] / cap) * cap (Gemma 2's final logits); grid (ceil(n / WG))."""
    k = KernelBuilder("softcap" + suffix(softcap=cap), (WG,))
    x, out = k.buffer("x", F32), k.buffer("out", F32, "w")
    n = k.scalar("n", I32)
    i = k.block_id() * WG + k.thread_id()
    with k.if_(i < n):
        out[i] = capped(k, x[i], cap)
    return k.build()
