"""JSON Schema to a Grammar of JSON texts that are valid instances of the schema.

Supported (drafts 2020-12 and 7 as OpenAI's and pydantic's schemas use them): `type` (one or a
list), `enum`, `const`; objects: `properties` (written in their order), `required`,
`additionalProperties` (false, true or a schema) and `unevaluatedProperties: false`; arrays:
`items`, `prefixItems` (or draft 7's list `items` with `additionalItems`), `minItems`,
`maxItems`, `uniqueItems: false`; strings: `minLength`, `maxLength`, `pattern` (regex.py's
subset) or `format` (regex.FORMATS: date, time, date-time, uuid, ipv4, ipv6, email, hostname,
uri); integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`; numbers: those
bounds where they are whole numbers; `anyOf`, `oneOf`; `allOf` of one schema; `$ref` to "#" or
a JSON pointer in the document (`$defs`, `definitions`), recursion included. Annotations
(`title`, `description`, `default`, `examples`, ...) are ignored. Any other keyword (or
value) is refused with SchemaUnsupported, which names it and where it stands: a schema is
constrained as written or not at all.

The texts are a subset of the valid ones, chosen so that every one validates: an object holds
only the properties `properties` names (and required names it does not), in that order; a
schema with no `type` takes the types its keywords speak of; `oneOf` is read as `anyOf`, so its
alternatives must not overlap. Between tokens there is at most MAX_WS of whitespace; numbers
have at most 16 digits before and after the point (and a bounded number none after an `e`);
strings are written as JSON writes them (escapes included; surrogates only in pairs).
"""
import json
import math

from .automaton import GrammarError
from .expr import (EMPTY, Grammar, Joined, Ref, Repeat, alt, byte_range, byte_set,
                   code_points, optional, seq, subtract, text)
from .regex import FORMATS, RegexUnsupported, lower, parse

MAX_WS = 12
MAX_DIGITS = 16
ANY = "json-value"

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id",
               "deprecated", "readOnly", "writeOnly", "discriminator"}
OBJECT_KEYS = {"properties", "required", "additionalProperties", "unevaluatedProperties"}
ARRAY_KEYS = {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"}
STRING_KEYS = {"minLength", "maxLength", "pattern", "format"}
NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
SUPPORTED = (ANNOTATIONS | OBJECT_KEYS | ARRAY_KEYS | STRING_KEYS | NUMBER_KEYS
             | {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
                "definitions"})
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")

WS = Repeat(byte_set(b" \t\n"), 0, MAX_WS)
SEP = seq(WS, text(","), WS)
DIGIT = byte_range(0x30, 0x39)
HEX = byte_set(b"0123456789abcdefABCDEF")
# One character of a JSON string: unescaped (not '"', '\\' nor a control character), or an
# escape (\\u of a lone surrogate aside). ASCII apart from the rest (UTF-8 of two bytes or more,
# and escapes): bounded strings call the rest as a rule of its own (SchemaCompiler._string).
PLAIN_ASCII = byte_set(set(range(0x20, 0x80)) - {0x22, 0x5C})
CHAR_REST = alt(
    code_points([(0x80, 0x10FFFF)]),
    seq(text("\\"), alt(byte_set(b'"\\/bfnrt'), seq(
        text("u"), alt(seq(byte_set(b"0123456789abcefABCEF"), HEX),
                       seq(byte_set(b"dD"), byte_range(0x30, 0x37))), HEX, HEX))),
    # a character past U+FFFF as its surrogate pair, high then low
    seq(text("\\u"), byte_set(b"dD"), byte_set(b"89abAB"), HEX, HEX,
        text("\\u"), byte_set(b"dD"), byte_set(b"cdefCDEF"), HEX, HEX))
CHAR = alt(PLAIN_ASCII, CHAR_REST)
STRING = seq(text('"'), Repeat(CHAR, 0, None), text('"'))
CHAR_RULE = "json-char"
SHORT_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r",
                 0x22: '\\"', 0x5C: "\\\\"}


class SchemaUnsupported(GrammarError):
    """A keyword (or a value of one) outside the supported subset, or a malformed schema."""

    def __init__(self, path, keyword, why):
        super().__init__(f"{path}: '{keyword}' {why}")
        self.path, self.keyword = path, keyword


def schema_grammar(schema):
    """The Grammar of the JSON texts valid under `schema`."""
    compiled = SchemaCompiler(schema)
    return Grammar(dict(compiled.rules, root=compiled.expr), "root", compiled.called)


def json_object_grammar():
    """Any JSON object (response_format json_object)."""
    return Grammar({"root": _object_of(Ref(ANY)), ANY: _any_value()}, "root")


def _any_value():
    return alt(_object_of(Ref(ANY)), seq(text("["), WS, _list_of(Ref(ANY)), WS, text("]")),
               STRING, _number(None, None, False, False), text("true"), text("false"),
               text("null"))


def _object_of(value):
    pair = seq(STRING, WS, text(":"), WS, value)
    return seq(text("{"), WS, _list_of(pair, sep=SEP), WS, text("}"))


def _list_of(item, sep=SEP):
    return optional(seq(item, Repeat(seq(sep, item), 0, None)))


class SchemaCompiler:
    """One schema document: `expr` is its root value, `rules` what it refers to (named
    `prefix` + the JSON pointer, so several documents can share a grammar)."""

    def __init__(self, schema, prefix=""):
        self.document, self.prefix = schema, prefix
        self.rules = {}
        self.called = frozenset()      # rules the Grammar should call, not copy
        self.expr = self.value(schema, "#")

    def value(self, schema, path):
        if schema is True or schema == {}:
            return self.any()
        if schema is False:
            raise SchemaUnsupported(path, "false", "admits no value")
        if not isinstance(schema, dict):
            raise SchemaUnsupported(path, type(schema).__name__, "is no schema (an object or "
                                    "a boolean)")
        for key in schema:
            if key not in SUPPORTED and not key.startswith("x-"):
                raise SchemaUnsupported(path, key, "is not supported")
        if "$ref" in schema:
            self.only(schema, path, "$ref")
            return self.ref(schema["$ref"], path)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaUnsupported(path, "allOf", "is supported with one schema only")
            self.only(schema, path, "allOf")
            return self.value(parts[0], f"{path}/allOf/0")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                self.only(schema, path, key)
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaUnsupported(path, key, "must be a non-empty array of schemas")
                return alt(*(self.value(s, f"{path}/{key}/{i}") for i, s in enumerate(options)))
        types = self.types(schema, path)
        if "const" in schema or "enum" in schema:
            return self.values(schema, path, types)
        if types is None:
            return self.any()
        return alt(*(getattr(self, "_" + t)(schema, path) for t in types))

    def only(self, schema, path, keyword):
        """Refuse keywords that constrain beside `keyword` (its siblings would be an
        intersection, which is not supported)."""
        for key in schema:
            if key != keyword and key not in ANNOTATIONS | {"$defs", "definitions"} \
                    and not key.startswith("x-"):
                raise SchemaUnsupported(path, key, f"beside '{keyword}' is not supported")

    def types(self, schema, path):
        """The types the schema asks for (its keywords' kinds where `type` is missing;
        None: any)."""
        declared = schema.get("type")
        if declared is None:
            kinds = []
            for keys, kind in ((OBJECT_KEYS, "object"), (ARRAY_KEYS, "array"),
                               (STRING_KEYS, "string"), (NUMBER_KEYS, "number")):
                if keys & set(schema):
                    kinds.append(kind)
            return kinds or None
        declared = declared if isinstance(declared, list) else [declared]
        if not declared or any(t not in TYPES for t in declared):
            raise SchemaUnsupported(path, "type", f"must be one of {', '.join(TYPES)} (or a "
                                    f"list of them), got {schema['type']!r:.60}")
        return list(dict.fromkeys(declared))

    def any(self):
        self.rules.setdefault(ANY, _any_value())
        return Ref(ANY)

    def ref(self, target, path):
        if not isinstance(target, str) or not target.startswith("#"):
            raise SchemaUnsupported(path, "$ref", f"{target!r:.80}: only references within "
                                    "the document ('#...') are supported")
        name = self.prefix + target
        if name not in self.rules:
            self.rules[name] = None                 # recursion meets the name, not a loop
            self.rules[name] = self.value(self.resolve(target, path), target)
        return Ref(name)

    def resolve(self, target, path):
        node = self.document
        for part in target[1:].split("/")[1:] if target != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaUnsupported(path, "$ref", f"{target!r:.80} points at nothing")
        return node

    def values(self, schema, path, types):
        """const or enum: their values, as JSON writes them (those of the declared types)."""
        if "const" in schema:
            options = [schema["const"]]
        else:
            options = schema["enum"]
            if not isinstance(options, list) or not options:
                raise SchemaUnsupported(path, "enum", "must be a non-empty array")
        kept = [v for v in options if types is None or any(_is(v, t) for t in types)]
        if not kept:
            raise SchemaUnsupported(path, "enum" if "enum" in schema else "const",
                                    "holds no value of the schema's type")
        return alt(*(text(json.dumps(v, ensure_ascii=False)) for v in kept))

    # ---- by type -----------------------------------------------------------------------------

    def _object(self, schema, path):
        props = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if not isinstance(props, dict):
            raise SchemaUnsupported(path, "properties", "must be an object")
        if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
            raise SchemaUnsupported(path, "required", "must be an array of strings")
        if schema.get("unevaluatedProperties", False) not in (False, True):
            raise SchemaUnsupported(path, "unevaluatedProperties", "is supported as a "
                                    "boolean only")
        closed = extra is False or schema.get("unevaluatedProperties") is False
        members = [(self.member(name, sub, f"{path}/properties/{_pointer(name)}"),
                    name not in required) for name, sub in props.items()]
        for name in dict.fromkeys(r for r in required if r not in props):
            if closed:
                raise SchemaUnsupported(path, "required", f"names {name!r}, which "
                                        "'properties' lacks and additional properties refuse")
            members.append((self.member(name, extra if isinstance(extra, dict) else True,
                                        f"{path}/additionalProperties"), False))
        if members:
            body = Joined(tuple(members), SEP)
        elif closed:
            body = EMPTY
        else:
            value = self.value(extra if isinstance(extra, dict) else True,
                               f"{path}/additionalProperties")
            return _object_of(value)
        return seq(text("{"), WS, body, WS, text("}"))

    def member(self, name, schema, path):
        return seq(text(json.dumps(name, ensure_ascii=False)), WS, text(":"), WS,
                   self.value(schema, path))

    def _array(self, schema, path):
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        if isinstance(items, list):                 # draft 7's tuple form
            prefix, items = items, schema.get("additionalItems", True)
        if not isinstance(prefix, list):
            raise SchemaUnsupported(path, "prefixItems", "must be an array of schemas")
        if schema.get("uniqueItems", False) is not False:
            raise SchemaUnsupported(path, "uniqueItems", "is supported as false only")
        lo = _count(schema, "minItems", path, 0)
        hi = _count(schema, "maxItems", path, None)
        if items is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and lo > hi:
            raise SchemaUnsupported(path, "minItems", "asks for more items than the array "
                                    "may hold")
        exprs = [self.value(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)]
        item = None if items is False else self.value(items, f"{path}/items")
        return seq(text("["), WS, _elements(exprs, item, lo, hi), WS, text("]"))

    def _string(self, schema, path):
        lo = _count(schema, "minLength", path, 0)
        hi = _count(schema, "maxLength", path, None)
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if hi is not None and lo > hi:
            raise SchemaUnsupported(path, "minLength", "is over maxLength")
        if pattern is not None and fmt is not None:
            raise SchemaUnsupported(path, "format", "beside 'pattern' is not supported")
        if (pattern is not None or fmt is not None) and (lo or hi is not None):
            raise SchemaUnsupported(path, "pattern" if pattern is not None else "format",
                                    "beside minLength or maxLength is not supported")
        if fmt is not None:
            if fmt not in FORMATS:
                raise SchemaUnsupported(path, "format", f"{fmt!r:.40} is not supported "
                                        f"(supported: {', '.join(FORMATS)})")
            pattern = FORMATS[fmt]
        if pattern is None and (lo or hi is not None):
            # Characters beyond ASCII are a machine of their own: copied for each place a
            # character may take, their ~30 states (UTF-8, escapes) would multiply the string's
            # length. ASCII, the common case, stays one edge to the next place.
            self.rules[CHAR_RULE] = CHAR_REST
            self.called |= {CHAR_RULE}
            char = alt(PLAIN_ASCII, Ref(CHAR_RULE))
            return seq(text('"'), Repeat(char, lo, hi), text('"'))
        if pattern is None:
            return STRING
        if not isinstance(pattern, str):
            raise SchemaUnsupported(path, "pattern", "must be a string")
        try:
            content = lower(parse(pattern), json_char)
        except RegexUnsupported as exc:
            raise SchemaUnsupported(path, "pattern", f"{exc}") from None
        return seq(text('"'), content, text('"'))

    def _integer(self, schema, path):
        lo, hi = _bounds(schema, path, whole=True)
        if lo is not None and hi is not None and lo > hi:
            raise SchemaUnsupported(path, "minimum", "leaves no integer")
        return _integer(lo, hi)

    def _number(self, schema, path):
        lo, hi = _bounds(schema, path, whole=False)
        lo_open = "exclusiveMinimum" in schema and lo == schema["exclusiveMinimum"]
        hi_open = "exclusiveMaximum" in schema and hi == schema["exclusiveMaximum"]
        if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_open or hi_open)):
            raise SchemaUnsupported(path, "minimum", "leaves no number")
        return _number(lo, hi, lo_open, hi_open)

    def _boolean(self, schema, path):
        return alt(text("true"), text("false"))

    def _null(self, schema, path):
        return text("null")


def json_char(ranges):
    """One character of `ranges` as a JSON string holds it: itself where JSON allows that,
    else its short escape or \\u00XX."""
    parts = []
    plain = subtract(ranges, [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)])
    if plain:
        parts.append(code_points(plain))
    for lo, hi in ranges:
        for cp in range(lo, min(hi, 0x5C) + 1):
            if cp < 0x20 or cp in (0x22, 0x5C):
                parts.append(text(SHORT_ESCAPES.get(cp, f"\\u{cp:04x}")))
    return alt(*parts)


def _is(value, kind):
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                or isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"object": dict, "array": list, "string": str, "boolean": bool,
                              "null": type(None)}[kind])


def _pointer(name):
    return name.replace("~", "~0").replace("/", "~1")


def _count(schema, key, path, default):
    value = schema.get(key, default)
    if value is not default and not (isinstance(value, int) and not isinstance(value, bool)
                                      and value >= 0):
        raise SchemaUnsupported(path, key, "must be a non-negative integer")
    return value


def _elements(prefix, item, lo, hi):
    """Array elements: prefix[i] at position i, `item` after; lo to hi of them (hi None: no
    bound), separated."""
    k = len(prefix)

    def part(i, first):
        if hi is not None and i >= hi:
            return EMPTY
        lead = EMPTY if first else SEP
        if i >= k:                                  # every further element is `item`
            need = max(lo - i, 0)
            room = None if hi is None else hi - i
            if not first:
                return Repeat(seq(SEP, item), need, room)
            rest = Repeat(seq(SEP, item), max(need - 1, 0), None if room is None else room - 1)
            return seq(item, rest) if need else optional(seq(item, rest))
        one = seq(lead, prefix[i], part(i + 1, False))
        return one if i < lo else optional(one)

    return part(0, True)


def _bounds(schema, path, whole):
    """(lo, hi) from the four bound keywords: ints for integers (an exclusive bound moved in
    by one), whole numbers as ints for numbers (others refused); None where unbounded."""
    lo = hi = None
    for key, is_lo, exclusive in (("minimum", True, False), ("exclusiveMinimum", True, True),
                                  ("maximum", False, False), ("exclusiveMaximum", False, True)):
        if key not in schema:
            continue
        value = schema[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SchemaUnsupported(path, key, "must be a number (draft 4's boolean "
                                    "exclusive bounds are not supported)")
        if whole:
            bound = (math.floor(value) + 1 if exclusive else math.ceil(value)) if is_lo else \
                (math.ceil(value) - 1 if exclusive else math.floor(value))
        else:
            if not float(value).is_integer():
                raise SchemaUnsupported(path, key, f"{value}: bounds of a number are "
                                        "supported where they are whole numbers")
            bound = int(value)
        if is_lo:
            lo = bound if lo is None else max(lo, bound)
        else:
            hi = bound if hi is None else min(hi, bound)
    return lo, hi


# ---- numbers -----------------------------------------------------------------------------------

def _digits(n):
    return Repeat(DIGIT, n, n)


def _same_length(x, y):
    """Digit strings of len(x) from x to y (as strings of equal length)."""
    if x == y:
        return text(x)
    n = len(x) - 1
    if x[1:] == "0" * n and y[1:] == "9" * n:      # every digit string in between
        return seq(byte_range(ord(x[0]), ord(y[0])), _digits(n))
    if x[0] == y[0]:
        return seq(text(x[0]), _same_length(x[1:], y[1:]))
    parts = [seq(text(x[0]), _same_length(x[1:], "9" * n))]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        parts.append(seq(byte_range(ord(x[0]) + 1, ord(y[0]) - 1), _digits(n)))
    parts.append(seq(text(y[0]), _same_length("0" * n, y[1:])))
    return alt(*parts)


def _natural(a, b):
    """Non-negative integers a..b (b None: up to MAX_DIGITS digits), without leading zeros."""
    longest = len(str(b)) if b is not None else max(len(str(a)), MAX_DIGITS)
    parts = []
    for n in range(len(str(a)), longest + 1):
        lo = max(a, 10 ** (n - 1) if n > 1 else 0)
        hi = 10 ** n - 1 if b is None else min(b, 10 ** n - 1)
        if lo <= hi:
            parts.append(_same_length(str(lo), str(hi)))
    return alt(*parts) if parts else None


def _integer(lo, hi):
    parts = []
    if hi is None or hi >= 0:
        parts.append(_natural(0 if lo is None else max(lo, 0), hi))
    if lo is None or lo < 0:
        least = 1 if hi is None or hi >= 0 else -hi
        parts.append(seq(text("-"), _natural(least, None if lo is None else -lo)))
    return alt(*(p for p in parts if p is not None))


FRACTION = seq(text("."), Repeat(DIGIT, 1, MAX_DIGITS))
ZERO_FRACTION = seq(text("."), Repeat(text("0"), 1, MAX_DIGITS))
# zeros, then the first digit that is not (where it is, is never in doubt: the DFA stays small)
NONZERO_FRACTION = seq(text("."), Repeat(text("0"), 0, MAX_DIGITS - 1), byte_range(0x31, 0x39),
                       Repeat(DIGIT, 0, MAX_DIGITS - 1))


def _number(lo, hi, lo_open, hi_open):
    """Numbers from lo to hi (whole numbers; None: unbounded; *_open: that end excluded); an
    unbounded one may carry an exponent."""
    if lo is None and hi is None:
        exponent = seq(byte_set(b"eE"), optional(byte_set(b"+-")), Repeat(DIGIT, 1, 2))
        return seq(optional(text("-")), _natural(0, None), optional(FRACTION),
                   optional(exponent))
    parts = []
    if hi is None or hi >= 0:
        low, open_ = (0, False) if lo is None or lo < 0 else (lo, lo_open)
        parts.append(_unsigned(low, open_, hi, hi_open))
    if lo is None or lo < 0:
        # -w for w from max(-hi, 0) to -lo; the ends swap
        low, open_ = (0, False) if hi is None or hi > 0 else (-hi, hi_open)
        parts.append(seq(text("-"), _unsigned(low, open_, None if lo is None else -lo,
                                              lo_open)))
    return alt(*(p for p in parts if p is not None))


def _unsigned(a, a_open, b, b_open):
    """Non-negative decimals w (digits, then maybe a fraction) with a <= w <= b (a < w where
    a_open, w < b where b_open; b None: unbounded), for whole a and b: whole parts strictly
    inside take any fraction, the ends only some."""
    parts = []
    low = a + 1 if a_open else a
    high = None if b is None else b - 1
    if high is None or low <= high:
        inside = _natural(low, high)
        if inside is not None:
            parts.append(seq(inside, optional(FRACTION)))
    if a_open and (b is None or a < b):
        parts.append(seq(text(str(a)), NONZERO_FRACTION))
    if b is not None and not b_open and b >= a and not (a_open and a == b):
        parts.append(seq(text(str(b)), optional(ZERO_FRACTION)))
    return alt(*parts) if parts else None
