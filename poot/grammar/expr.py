"""Grammars as poot writes them: expressions over bytes and special tokens, in named rules.

An expression is a tree of `Chars` (one byte of a set), `Token` (one special token of the
vocabulary, by its text), `Seq`, `Alt`, `Repeat` (min to max times), `Joined` (items in order
with a separator between those present; optional items may be left out) and `Ref` (a rule by
name). A `Grammar` is its rules and the name of the root. `text` spells literal text in UTF-8
and `code_points` a set of Unicode characters (as the byte sequences UTF-8 gives them).

This module only describes languages; automaton.py compiles them, schema.py and regex.py write
them from JSON Schema and regular expressions.
"""
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


class Expr:
    """A language of byte strings."""


@dataclass(frozen=True)
class Chars(Expr):
    """One byte out of a set: bit b of `bits` set where byte b belongs."""
    bits: int


@dataclass(frozen=True)
class Token(Expr):
    """The special token whose text is `text` (a control token: no bytes spell it)."""
    text: str


@dataclass(frozen=True)
class Seq(Expr):
    items: tuple


@dataclass(frozen=True)
class Alt(Expr):
    items: tuple


@dataclass(frozen=True)
class Repeat(Expr):
    """`item` at least `min` and at most `max` times (None: no bound)."""
    item: Expr
    min: int = 0
    max: int | None = None


@dataclass(frozen=True)
class Joined(Expr):
    """`items` ((expr, optional) pairs) in this order, `sep` between each two present: a JSON
    object's members. Written as Seq and Alt it would grow with the square of the items."""
    items: tuple
    sep: Expr


@dataclass(frozen=True)
class Ref(Expr):
    name: str


EMPTY = Seq(())
NOTHING = Alt(())       # matches no string at all


@dataclass
class Grammar:
    """Rules by name and the root's name. A rule is copied in wherever it is referred to,
    unless it is recursive or named in `called`: those get a machine of their own, entered by
    a call (so a rule repeated many times, a character of a string of bounded length say, is
    not copied as many times)."""
    rules: dict                         # name -> Expr
    root: str
    called: frozenset = frozenset()


def seq(*items):
    flat = []
    for item in items:
        flat.extend(item.items if isinstance(item, Seq) else (item,))
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items):
    unique = list(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else Alt(tuple(unique))     # none: NOTHING


def optional(item):
    return Repeat(item, 0, 1)


def byte_set(data):
    """One of the bytes of `data` (bytes, or an iterable of ints)."""
    bits = 0
    for b in data:
        bits |= 1 << b
    return Chars(bits)


def byte_range(lo, hi):
    return Chars(((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1))


def text(s):
    """Exactly the UTF-8 bytes of `s` (a str) or `s` (bytes)."""
    data = s.encode("utf-8") if isinstance(s, str) else s
    return seq(*(Chars(1 << b) for b in data)) if data else EMPTY


def code_points(ranges):
    """One character out of `ranges` ((lo, hi) code points, inclusive), as its UTF-8 bytes;
    surrogates are no characters and are left out."""
    sequences = [s for lo, hi in ranges for s in _utf8_sequences(lo, min(hi, MAX_CODE_POINT))]
    return alt(*(seq(*(byte_range(a, b) for a, b in s)) for s in sequences)) if sequences \
        else NOTHING


def _utf8_sequences(lo, hi):
    """Lists of byte ranges [(lo, hi), ...], each product of which is UTF-8 for a run of the
    code points lo..hi: split where the encoded length changes, then until every byte after
    the first spans a whole range of continuation bytes or one value."""
    if lo > hi:
        return []
    if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
        return _utf8_sequences(lo, SURROGATES[0] - 1) + _utf8_sequences(SURROGATES[1] + 1, hi)
    for border in (0x7F, 0x7FF, 0xFFFF):
        if lo <= border < hi:
            return _utf8_sequences(lo, border) + _utf8_sequences(border + 1, hi)
    n = len(chr(lo).encode("utf-8"))
    for i in range(1, n):
        low = (1 << (6 * i)) - 1               # the bits the last i bytes carry
        if lo & ~low != hi & ~low:
            if lo & low:
                return _utf8_sequences(lo, lo | low) + _utf8_sequences((lo | low) + 1, hi)
            if hi & low != low:
                return _utf8_sequences(lo, (hi & ~low) - 1) + _utf8_sequences(hi & ~low, hi)
    return [list(zip(chr(lo).encode("utf-8"), chr(hi).encode("utf-8")))]


def complement(ranges):
    """The code points (surrogates aside) outside `ranges`."""
    out, at = [], 0
    for lo, hi in merge_ranges(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= MAX_CODE_POINT:
        out.append((at, MAX_CODE_POINT))
    return out


def merge_ranges(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract(ranges, removed):
    """The code points of `ranges` that are not in `removed`."""
    keep = complement(removed)
    out = []
    for lo, hi in merge_ranges(ranges):
        for klo, khi in keep:
            a, b = max(lo, klo), min(hi, khi)
            if a <= b:
                out.append((a, b))
    return out
