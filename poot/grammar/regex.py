"""Regular expressions (the ECMA-262 subset JSON Schema's `pattern` uses) as grammar expressions.

`parse` reads a pattern into a small tree whose leaves are sets of code points; `lower` turns
the tree into an Expr, each character spelled by a function the caller gives (raw UTF-8, or as
a JSON string writes it). Supported: literals and escapes (\\d \\w \\s and their negations,
\\t \\n \\r \\f \\v \\0 \\xHH \\uHHHH \\u{H...}, escaped punctuation), `.`, classes with ranges and
negation, groups (capturing, (?:...), (?<name>...)), alternation, the quantifiers * + ? {n}
{n,} {n,m} (lazy ones match the same strings), and ^ and $ at the ends of the pattern or of its
top-level alternatives. Backreferences, lookaround, word boundaries and flags are refused with
RegexUnsupported.

A JSON Schema pattern is not anchored: where ^ or $ is missing, any text may come before or
after (`search`); a pattern that constrains a whole output (`regex_grammar`) is. Validators read patterns in other dialects than ECMA-262 (Python's `re` in
jsonschema: its \\d, \\w and \\s take Unicode's digits, letters and spaces, its `.` takes \\r),
so a class takes only the characters both dialects put in it, and a negated one only those
both leave out: what the pattern writes, either reads. FORMATS are patterns for the `format`
values poot constrains.
"""
import functools
import unicodedata
from dataclasses import dataclass

from .expr import (MAX_CODE_POINT, Grammar, Repeat, alt, code_points, complement, merge_ranges,
                   seq, subtract)

MAX_REPEAT = 1000


class RegexUnsupported(ValueError):
    pass


@dataclass(frozen=True)
class CharSet:
    ranges: tuple


@dataclass(frozen=True)
class Concat:
    items: tuple


@dataclass(frozen=True)
class Either:
    items: tuple


@dataclass(frozen=True)
class Times:
    item: object
    min: int
    max: int | None


DIGITS = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
         (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
         (0xFEFF, 0xFEFF))
LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
ANY = ((0, MAX_CODE_POINT),)


@functools.lru_cache(maxsize=None)
def _python_class(name):
    """The code points Python's re puts in \\d, \\w or \\s (of a str pattern)."""
    test = {"d": lambda c: unicodedata.category(c) == "Nd",
            "w": lambda c: c.isalnum() or c == "_", "s": str.isspace}[name]
    ranges, start = [], None
    for cp in range(MAX_CODE_POINT + 2):
        inside = cp <= MAX_CODE_POINT and test(chr(cp))
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return tuple(ranges)


def _class_escape(c):
    """(narrow, wide) of \\d \\w \\s \\D \\W \\S: the code points both dialects put in the class,
    and those either does."""
    ecma = {"d": DIGITS, "w": WORD, "s": SPACE}[c.lower()]
    python = _python_class(c.lower())
    narrow = tuple(subtract(ecma, complement(python)))
    wide = tuple(merge_ranges(ecma + python))
    if c.islower():
        return narrow, wide
    return tuple(complement(wide)), tuple(complement(narrow))
CONTROL_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
SYNTAX = set("^$\\.*+?()[]{}|/-")

# Patterns (anchored at both ends) of the string formats poot constrains. Each is a subset of
# the format's strings that Python's own parsers read (no 29 February: no leap-year rule).
_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
        r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_DATE = r"[1-9][0-9]{3}-" + _DAY
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
FORMATS = {
    "date": "^" + _DATE + "$",
    "time": "^" + _TIME + "$",
    "date-time": "^" + _DATE + "T" + _TIME + "$",
    "uuid": r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
    "ipv4": "^" + _OCTET + r"(?:\." + _OCTET + "){3}$",
    "ipv6": r"^[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){7}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@" + _LABEL + r"(?:\." + _LABEL + "){1,4}$",
    "hostname": "^" + _LABEL + r"(?:\." + _LABEL + "){0,8}$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]{0,15}:[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]{1,200}$",
}


def parse(pattern, search=True):
    """The tree of a whole pattern: where `search`, with any text allowed where an end has no
    anchor (JSON Schema's reading); otherwise the pattern is the whole text."""
    parser = _Parser(pattern)
    alternatives = parser.alternatives(top=True)
    if parser.at < len(pattern):
        raise RegexUnsupported(f"unbalanced ')' at {parser.at} in pattern {pattern!r}")
    anything = (Times(CharSet(ANY), 0, None),) if search else ()
    out = []
    for head, items, tail in alternatives:
        out.append(Concat((() if head else anything) + tuple(items) + (() if tail else anything)))
    return out[0] if len(out) == 1 else Either(tuple(out))


def regex_grammar(pattern):
    """The Grammar of texts (UTF-8) the whole of which `pattern` matches."""
    return Grammar({"root": lower(parse(pattern, search=False), code_points)}, "root")


def lower(node, char):
    """The Expr of a tree; `char(ranges)` spells one character out of `ranges`."""
    if isinstance(node, CharSet):
        return char(node.ranges)
    if isinstance(node, Concat):
        return seq(*(lower(item, char) for item in node.items))
    if isinstance(node, Either):
        return alt(*(lower(item, char) for item in node.items))
    return Repeat(lower(node.item, char), node.min, node.max)


class _Parser:
    def __init__(self, pattern):
        self.p, self.at = pattern, 0

    def peek(self):
        return self.p[self.at] if self.at < len(self.p) else None

    def take(self):
        c = self.peek()
        if c is None:
            raise RegexUnsupported(f"pattern {self.p!r} ends early")
        self.at += 1
        return c

    def refuse(self, what):
        raise RegexUnsupported(f"{what} (at {self.at} in pattern {self.p!r}) is not supported")

    def alternatives(self, top=False):
        """[(anchored at the start, items, anchored at the end)] up to ')' or the end."""
        out = []
        while True:
            head = top and self.peek() == "^"
            if head:
                self.at += 1
            items, tail = self.sequence(top)
            out.append((head, items, tail))
            if self.peek() != "|":
                return out
            self.at += 1

    def sequence(self, top):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$":
                self.at += 1
                if not top or self.peek() not in (None, "|"):
                    self.refuse("'$' inside the pattern")
                return items, True
            if self.peek() == "^":
                self.refuse("'^' inside the pattern")
            items.append(self.quantified(self.atom()))
        return items, False

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.at):
                self.at += 2
            elif self.p.startswith("?<", self.at) and self.p[self.at + 2:self.at + 3] not in "=!":
                end = self.p.find(">", self.at)
                if end < 0:
                    self.refuse("an unterminated group name")
                self.at = end + 1
            elif self.peek() == "?":
                self.refuse("lookaround or a group flag")
            inner = self.alternatives()
            if self.peek() != ")":
                self.refuse("an unclosed '('")
            self.at += 1
            items = [Concat(tuple(items)) for _, items, _ in inner]
            return items[0] if len(items) == 1 else Either(tuple(items))
        if c == "[":
            return self.char_class()
        if c == ".":
            return CharSet(tuple(complement(LINE_TERMINATORS)))
        if c == "\\":
            return CharSet(self.escape(in_class=False)[0])
        if c in "*+?{":
            if c == "{" and not self._is_quantifier():
                return CharSet(((ord(c), ord(c)),))
            self.refuse(f"a quantifier {c!r} with nothing before it")
        return CharSet(((ord(c), ord(c)),))

    def _is_quantifier(self):
        rest = self.p[self.at:]
        close = rest.find("}")
        body = rest[:close] if close >= 0 else ""
        lo, _, hi = body.partition(",")
        return close > 0 and lo.isdigit() and (hi == "" or hi.isdigit())

    def quantified(self, node):
        c = self.peek()
        if c == "*":
            lo, hi = 0, None
        elif c == "+":
            lo, hi = 1, None
        elif c == "?":
            lo, hi = 0, 1
        elif c == "{" and self._is_quantifier_here():
            close = self.p.index("}", self.at)
            body = self.p[self.at + 1:close]
            lo_text, comma, hi_text = body.partition(",")
            lo = int(lo_text)
            hi = lo if not comma else (int(hi_text) if hi_text else None)
            if hi is not None and hi < lo:
                self.refuse(f"the quantifier {{{body}}} (its maximum under its minimum)")
            if max(lo, hi or 0) > MAX_REPEAT:
                self.refuse(f"a repetition over {MAX_REPEAT} times")
            self.at = close
        else:
            return node
        self.at += 1
        if self.peek() == "?":              # lazy: the same strings
            self.at += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._is_quantifier_here()):
            self.refuse("a quantifier on a quantifier")
        return Times(node, lo, hi)

    def _is_quantifier_here(self):
        self.at += 1
        try:
            return self._is_quantifier()
        finally:
            self.at -= 1

    def char_class(self):
        """A class as (narrow) CharSet: a negated class leaves out what either dialect puts
        in its members."""
        negate = self.peek() == "^"
        if negate:
            self.at += 1
        narrow, wide = [], []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                lo = self.escape(in_class=True)
            elif c == "[":
                self.refuse("a nested class or set operation")
            else:
                lo = (((ord(c), ord(c)),),) * 2
            if self.peek() == "-" and self.p[self.at + 1:self.at + 2] not in ("]", ""):
                self.at += 1
                c2 = self.take()
                hi = self.escape(in_class=True) if c2 == "\\" else (((ord(c2), ord(c2)),),) * 2
                ends = [r[0] for r in lo[0] + hi[0]]
                if len(lo[0]) != 1 or len(hi[0]) != 1 or any(a != b for a, b in
                                                             lo[0] + hi[0]):
                    self.refuse("a range whose end is a class")
                if ends[1] < ends[0]:
                    self.refuse("a range out of order")
                narrow.append((ends[0], ends[1]))
                wide.append((ends[0], ends[1]))
            else:
                narrow.extend(lo[0])
                wide.extend(lo[1])
        return CharSet(tuple(complement(wide) if negate else merge_ranges(narrow)))

    def escape(self, in_class):
        """(narrow, wide) code point ranges of an escape (alike but for class escapes)."""
        c = self.take()
        if c.lower() in "dws":
            return _class_escape(c)
        return (self._char_escape(c, in_class),) * 2

    def _char_escape(self, c, in_class):
        if c in CONTROL_ESCAPES:
            if c == "0" and (self.peek() or "").isdigit():
                self.refuse("an octal escape")
            return ((CONTROL_ESCAPES[c],) * 2,)
        if c == "x":
            return self._hex(2)
        if c == "u":
            if self.peek() == "{":
                close = self.p.find("}", self.at)
                digits = self.p[self.at + 1:close] if close > 0 else ""
                if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits) \
                        or int(digits, 16) > MAX_CODE_POINT:
                    self.refuse("a malformed \\u{...} escape")
                self.at = close + 1
                return ((int(digits, 16),) * 2,)
            return self._hex(4)
        if c == "b" and in_class:
            return ((0x08, 0x08),)
        if c in "bB":
            self.refuse("a word boundary")
        if c.isdigit() or c == "k":
            self.refuse("a backreference")
        if c in "pP":
            self.refuse("a Unicode property escape")
        if c == "c":
            self.refuse("a control-letter escape")
        if c in SYNTAX or not c.isalnum():
            return ((ord(c), ord(c)),)
        self.refuse(f"the escape \\{c}")

    def _hex(self, n):
        digits = self.p[self.at:self.at + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            self.refuse("a malformed hexadecimal escape")
        self.at += n
        return ((int(digits, 16),) * 2,)
