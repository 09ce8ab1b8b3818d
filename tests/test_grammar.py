"""Constrained decoding (poot.grammar): JSON Schema and patterns compiled to automata, and the
token masks read from them over real vocabularies.

The oracles are independent of the compiler: `jsonschema` validates what constrained generation
writes, Python's `re` decides which strings a pattern matches, and a token-by-token walk of the
automaton (no numpy, no caches) decides which tokens a mask must hold.
"""
import datetime
import ipaddress
import itertools
import json
import random
import re
import uuid

import numpy as np
import pytest

import poot
from poot.grammar import (AmbiguousGrammar, Automaton, ConstraintViolated, GrammarError,
                          GrammarTooLarge,
                          SchemaUnsupported, TokenGrammar, Vocabulary, compiled,
                          json_object_grammar, regex_grammar, schema_grammar)
from poot.grammar.expr import Grammar, Ref, Token, code_points, seq, text
from poot.grammar.regex import FORMATS, RegexUnsupported, lower, parse
from poot.grammar.tokens import unpack
from poot.text.tokenizer import CONTROL, NORMAL
from tests.models import default_model, tiny_model

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A byte-level vocabulary of 320 tokens (every byte, some merges)."""
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny"))).tokenizer


@pytest.fixture(scope="module")
def smol():
    """The default model's vocabulary: 49,152 byte-level BPE tokens."""
    return poot.load(default_model()).tokenizer


def accepts(automaton, data):
    """Whether the automaton reads `data` (bytes) to an end."""
    stack = (automaton.start,)
    for b in data:
        stack = automaton.step(stack, int(automaton.class_of[b]))
        if stack is None:
            return False
    return automaton.can_end(stack)


def token_walk(grammar, stack):
    """The mask of `stack` found the slow way: every token stepped through alone."""
    A, vocab = grammar.automaton, grammar.vocab
    allowed = np.zeros(vocab.size, bool)
    for t, symbols in enumerate(vocab.spelled):
        at = stack if symbols else None
        for s in symbols:
            at = A.step(at, grammar._class_list[s])
            if at is None:
                break
        allowed[t] = at is not None
    if A.can_end(stack):
        allowed[vocab.eos_ids] = True
    return allowed


STRUCTURE = set(b'"{}[],:0123456789')


def generate(grammar, tokenizer, rng, max_steps=400, check=None, nest=False):
    """Constrained sampling from random logits that favour short, structural tokens (so that
    strings and containers end; `nest`: containers open rather than close): (text, whether an
    end-of-sequence token ended it). `check` is called with each stack before its mask is
    used."""
    matcher = grammar.start()
    out = []
    spelled = [set(tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)]
    bonus = np.array([3.0 * bool(STRUCTURE & set(tokenizer.token_bytes(t)[:2]))
                      - 0.3 * len(tokenizer.token_bytes(t)) for t in range(tokenizer.vocab_size)])
    if nest:
        bonus += [3.0 * bool(b & set(b"{[")) - 3.0 * bool(b & set(b"}]")) for b in spelled]
    bonus[list(tokenizer.eos_ids)] = 2.0
    for _ in range(max_steps):
        if check is not None:
            check(matcher.stack)
        allowed = unpack(matcher.allowed(), tokenizer.vocab_size)
        assert allowed.any()
        logits = rng.standard_normal(tokenizer.vocab_size) * 2 + bonus
        logits[~allowed] = -np.inf
        token = int(np.argmax(logits))
        matcher.advance(token)
        if token in tokenizer.eos_ids:
            return tokenizer.decode(out), True
        out.append(token)
    return tokenizer.decode(out), False


# ---- the fuzz: random schemas, constrained generation, jsonschema as the oracle ---------------

NAMES = ["id", "name", "a", "b_c", "Zürich", 'say "hi"', "a/b", "x~y", "données", "n2", ""]
PATTERNS = [r"^[a-z]{2,5}$", r"^\d{3}-\d{4}$", r"ab+c", r"^(foo|bar)[0-9]?$",
            r'^[^"\\]{1,8}$', r"x", r"^\w+@\w+\.com$", r"^[A-Z][a-z]*( [A-Z][a-z]*)?$",
            r"^\u00e9+$", r"^\s?[.]{2}$"]
FORMAT_NAMES = sorted(FORMATS)


def random_schema(rng, depth=0):
    leaf = depth >= 3
    kind = rng.choice(["string", "integer", "number", "boolean", "null", "enum", "const",
                       "pattern", "format", "types"]
                      + ([] if leaf else ["object"] * 3 + ["array"] * 2 + ["anyOf", "any"]))
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.5:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.5:
            s["maxLength"] = rng.randint(s.get("minLength", 0), 6)
        return s
    if kind in ("integer", "number"):
        s = {"type": kind}
        lo, hi = sorted(rng.sample(range(-120, 120), 2))
        for key, value in (("minimum", lo), ("maximum", hi), ("exclusiveMinimum", lo - 1),
                           ("exclusiveMaximum", hi + 1)):
            if rng.random() < 0.35:
                s[key] = value if kind == "number" or rng.random() < 0.7 else value + 0.5
        return s
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["red", "gréen", 'q"uote', 3, -1.5, True, None,
                                    {"k": [1, 2]}, [], "back\\slash"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, False, None, {"nested": "yes"}])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMAT_NAMES)}
    if kind == "types":
        return {"type": rng.sample(["string", "integer", "boolean", "null"], 2)}
    if kind == "object":
        names = rng.sample(NAMES, rng.randint(0, 4))
        s = {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}}
        s["required"] = [n for n in names if rng.random() < 0.6]
        if rng.random() < 0.5:
            s["additionalProperties"] = False
        elif not names and rng.random() < 0.5:
            s["additionalProperties"] = random_schema(rng, depth + 1)
        return s
    if kind == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            s["prefixItems"] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.5:
            s["maxItems"] = rng.randint(s.get("minItems", 0), 4)
        return s
    if kind == "anyOf":          # alternatives of different types, so oneOf holds as well
        types = rng.sample(["string", "integer", "boolean", "null", "array"], rng.randint(2, 3))
        options = [{"type": t} if t != "array" else random_schema(rng, 3) | {"type": "array"}
                   for t in types]
        for i, t in enumerate(types):
            if t == "array":
                options[i] = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
        return {rng.choice(["anyOf", "oneOf"]): options}
    return {}


def random_document(rng):
    """A schema with $defs, one of them recursive, referred to from inside."""
    node = {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["value", "next"], "additionalProperties": False}
    root = random_schema(rng)
    if rng.random() < 0.4:
        return {"type": "object", "$defs": {"node": node, "leaf": random_schema(rng, 2)},
                "properties": {"list": {"$ref": "#/$defs/node"}, "leaf": {"$ref": "#/$defs/leaf"},
                               "rest": root}, "required": ["list", "leaf"]}
    return root


def check_formats(schema, value):
    """The formats jsonschema checks only with packages poot does not need, checked here."""
    if isinstance(schema, dict):
        fmt = schema.get("format")
        if fmt and isinstance(value, str):
            if fmt == "date-time":
                datetime.datetime.fromisoformat(value)
            elif fmt == "time":
                datetime.time.fromisoformat(value)
            elif fmt == "uuid":
                uuid.UUID(value)
            elif fmt == "ipv6":
                ipaddress.IPv6Address(value)
            elif fmt == "hostname":
                assert all(0 < len(label) < 64 for label in value.split("."))
            elif fmt == "uri":
                assert re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", value)


@pytest.mark.parametrize("vocab", ["tiny", "smol"])
def test_constrained_output_validates_against_random_schemas(request, vocab):
    tokenizer = request.getfixturevalue(vocab)
    rng = random.Random(20 if vocab == "tiny" else 21)
    np_rng = np.random.default_rng(0)
    validator = jsonschema.Draft202012Validator
    schemas = completed = 0
    for case in range(120 if vocab == "tiny" else 60):
        schema = random_document(rng)
        try:
            grammar = compiled(("fuzz", json.dumps(schema, sort_keys=True)),
                               lambda: schema_grammar(schema), tokenizer)
        except SchemaUnsupported as exc:        # a bound of a number that is not whole
            assert "whole numbers" in str(exc), (schema, exc)
            continue
        schemas += 1
        for _ in range(2):
            out, ended = generate(grammar, tokenizer, np_rng)
            if not ended:
                continue
            completed += 1
            value = json.loads(out)
            validator(schema, format_checker=validator.FORMAT_CHECKER).validate(value)
            for sub, got in _pairs(schema, value):
                check_formats(sub, got)
    print(f"{vocab}: {schemas} schemas, {completed} outputs complete, all valid")
    assert schemas >= 40 and completed >= schemas


def _pairs(schema, value):
    """(schema, value) pairs down the properties and items, for the format checks."""
    yield schema, value
    if isinstance(schema, dict) and isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield from _pairs(sub, value[name])
    if isinstance(schema, dict) and isinstance(value, list) and isinstance(
            schema.get("items"), dict):
        for item in value[len(schema.get("prefixItems", [])):]:
            yield from _pairs(schema["items"], item)


# ---- masks --------------------------------------------------------------------------------------

RECURSIVE = {"$defs": {"tree": {"type": "object", "properties": {
    "label": {"type": "string", "maxLength": 4},
    "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 3}},
    "required": ["label", "children"], "additionalProperties": False}},
    "$ref": "#/$defs/tree"}


@pytest.mark.parametrize("which", ["json_object", "recursive", "flat"])
def test_masks_hold_exactly_the_tokens_the_automaton_reads(tiny, smol, which):
    """Every mask along random generations equals the token-by-token walk, for stacks a few
    rules deep (json_object and recursive schemas call rules) and one-state stacks."""
    build = {"json_object": json_object_grammar, "recursive": lambda: schema_grammar(RECURSIVE),
             "flat": lambda: schema_grammar({"type": "object", "properties": {
                 "n": {"type": "number"}, "s": {"type": "string", "pattern": "^a+b?$"}}})}[which]
    for tokenizer, every in ((tiny, 1), (smol, 25)):
        grammar = compiled(("masks", which), build, tokenizer)
        seen, depths = 0, set()

        def check(stack):
            nonlocal seen
            seen += 1
            if seen % every == 0:
                depths.add(len(stack))
                want = token_walk(grammar, stack)
                assert (unpack(grammar.mask(stack), tokenizer.vocab_size) == want).all()
        for seed in range(3):
            generate(grammar, tokenizer, np.random.default_rng(seed), 120, check, nest=True)
        if which != "flat":
            assert max(depths) >= 3, depths


class RandomVocabulary:
    """A tokenizer's vocabulary, as Vocabulary reads one: every byte, then random tokens
    joined from JSON's structure, letters, digits, escapes and multi-byte characters (some
    split inside a character), and an end-of-sequence control token."""

    PIECES = [b'"', b"\\", b'\\"', b"{", b"}", b"[", b"]", b",", b":", b" ", b"\n", b"-", b".",
              b"e", b"0", b"7", b"12", b"a", b"bc", b"name", b"x", b"true", b"null",
              "é".encode(), "€".encode(), "€".encode()[:2], "€".encode()[2:], b"\x01",
              b"\xff"]

    def __init__(self, size, seed):
        rng = random.Random(seed)
        spelled = {bytes([b]) for b in range(256)}
        self.extra = []
        while len(self.extra) < size:
            token = b"".join(rng.choice(self.PIECES) for _ in range(rng.randint(2, 6)))
            if token not in spelled:
                spelled.add(token)
                self.extra.append(token)
        self.vocab_size = 257 + size
        self.tokens = [chr(b) for b in range(256)] + ["<eos>"] + [
            t.decode("latin-1") for t in self.extra]
        self.token_types = [NORMAL] * 256 + [CONTROL] + [NORMAL] * size
        self.eos_ids = [256]

    def token_bytes(self, i):
        return bytes([i]) if i < 256 else self.extra[i - 257]


ROWS = {"type": "array", "minItems": 6, "items": {
    "type": "object", "required": ["name", "score", "tag"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 5}, "score": {"type": "integer"},
                   "tag": {"enum": ["red", "green"]}, "note": {"type": "string"}}}}


TEXT = {"type": "object", "required": ["title", "body"], "additionalProperties": False,
        "properties": {"title": {"type": "string", "maxLength": 40}, "body": {"type": "string"}}}


@pytest.mark.parametrize("which", ["rows", "text", "json_object", "recursive"])
def test_masks_of_places_alike_and_strings_read_whole_equal_the_token_walk(tiny, which):
    """Masks along random walks (each token drawn from the slow walk's own mask) equal the
    token-by-token walk, for vocabularies of random tokens and the tiny one: places that share
    a kept mask (the rows' items) and string states whose tokens are read whole included."""
    build = {"json_object": json_object_grammar, "recursive": lambda: schema_grammar(RECURSIVE),
             "rows": lambda: schema_grammar(ROWS), "text": lambda: schema_grammar(TEXT)}[which]
    for tokenizer in (tiny, RandomVocabulary(3000, 1), RandomVocabulary(1500, 2)):
        grammar = TokenGrammar(Automaton(build()), Vocabulary.of(tokenizer))
        rng = np.random.default_rng(len(which))
        compared = 0
        for _ in range(4):
            matcher = grammar.start()
            for _ in range(60):
                want = token_walk(grammar, matcher.stack)
                assert (unpack(grammar.mask(matcher.stack), tokenizer.vocab_size) == want).all()
                compared += 1
                choices = np.flatnonzero(want)
                token = int(rng.choice(choices[~np.isin(choices, tokenizer.eos_ids)]
                                       if len(choices) > 1 else choices))
                matcher.advance(token)
                if matcher.ended:
                    break
        assert compared >= 100


def test_a_mask_is_computed_once_per_stack_and_a_schema_once(smol):
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    first = compiled(("again", json.dumps(schema)), lambda: schema_grammar(schema), smol)
    again = compiled(("again", json.dumps(schema)), lambda: 1 / 0, smol)   # not rebuilt
    assert again is first
    stack = first.start().stack
    assert first.mask(stack) is first.mask(stack)


def test_requests_asking_for_one_schema_together_share_one_compilation(tiny):
    """Concurrent first requests with one schema wait for one compilation (each grammar keeps
    its own masks); a compilation that fails fails every one of them."""
    import threading
    import time
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    builds, got, errors = [], [], []

    def build():
        builds.append(1)
        time.sleep(0.2)
        return schema_grammar(schema)

    def bad():
        time.sleep(0.1)
        return schema_grammar({"type": "object", "not": {}})

    def ask(key, make):
        try:
            got.append(compiled(key, make, tiny))
        except GrammarError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(("together", 1), build)) for _ in range(8)]
    threads += [threading.Thread(target=ask, args=(("together", 2), bad)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(got) == 8 and all(g is got[0] for g in got)
    assert len(errors) == 3


def test_the_end_of_sequence_token_comes_only_where_the_grammar_may_end(tiny):
    grammar = TokenGrammar(Automaton(schema_grammar({"type": "array", "items": {
        "type": "integer"}, "minItems": 1})), Vocabulary.of(tiny))
    matcher = grammar.start()
    eos = min(tiny.eos_ids)
    for token in tiny.encode("[1, 2", add_special=False):
        assert not unpack(matcher.allowed(), tiny.vocab_size)[eos]
        matcher.advance(token)
    with pytest.raises(ConstraintViolated):
        matcher.advance(eos)
    matcher.advance(tiny.encode("]", add_special=False)[0])
    allowed = unpack(matcher.allowed(), tiny.vocab_size)
    assert allowed[eos] and allowed.sum() == len(tiny.eos_ids)     # nothing after the array
    matcher.advance(eos)
    assert matcher.can_end()
    with pytest.raises(ConstraintViolated):
        grammar.start().advance(tiny.encode("x", add_special=False)[0])


class Spelled:
    """A tokenizer as Vocabulary reads one: two control tokens and the printable ASCII bytes."""
    tokens = ["<|call|>", "<|end|>"] + [chr(c) for c in range(33, 127)]
    token_types = [CONTROL, CONTROL] + [NORMAL] * 94
    vocab_size = len(tokens)
    eos_ids = {1}

    def token_bytes(self, i):
        return self.tokens[i].encode()


def test_a_special_token_is_read_as_one_symbol():
    """Token("<|call|>") is the control token of that text, never its spelling in bytes."""
    tok = Spelled()
    grammar = TokenGrammar(Automaton(Grammar({"r": seq(Token("<|call|>"), text("{x}"))}, "r")),
                           Vocabulary.of(tok))
    matcher = grammar.start()
    assert np.flatnonzero(unpack(matcher.allowed(), tok.vocab_size)).tolist() == [0]
    matcher.advance(0)
    assert np.flatnonzero(unpack(matcher.allowed(), tok.vocab_size)).tolist() == [
        tok.tokens.index("{")]


# ---- the compiler's languages, string by string -----------------------------------------------

def _strings(alphabet, longest):
    for n in range(longest + 1):
        for chars in itertools.product(alphabet, repeat=n):
            yield "".join(chars)


@pytest.mark.parametrize("pattern", [r"^a+b?$", r"ab", r"^(ab|ba)*$", r"^[^a]{1,2}$",
                                     r"^a{2,3}$|^b$", r"a.b", r"^\d-?\d$", r"^[a-c-]$",
                                     r"^(?:a|b)(?<n>a)?$", r"b$", r"^\x61[\u0062]*$"])
def test_a_pattern_matches_what_python_re_matches(pattern):
    """Every string over a small alphabet up to 5 characters: the automaton of the pattern
    (as raw UTF-8) reads it exactly when re.search finds the pattern in it (with ECMA-262's
    '$', which a final newline does not satisfy: Python's \\Z)."""
    automaton = Automaton(Grammar({"r": lower(parse(pattern), code_points)}, "r"))
    compiled_re = re.compile(pattern.replace("$", r"\Z").replace("(?<", "(?P<"))
    for s in _strings("ab1-\n", 5):
        assert accepts(automaton, s.encode()) == bool(compiled_re.search(s)), (pattern, s)


def test_a_regex_grammar_is_the_whole_text():
    for pattern in (r"a+b?", r"^(ab|ba)*$", r"[^a]{1,2}|b1"):
        automaton = Automaton(regex_grammar(pattern))
        for s in _strings("ab1-\n", 4):
            assert accepts(automaton, s.encode()) == bool(re.fullmatch(pattern, s)), (pattern, s)


@pytest.mark.parametrize("pattern, what", [
    (r"(a)\1", "backreference"), (r"a(?=b)", "lookaround"), (r"\bword", "word boundary"),
    (r"a{2000}", "repetition"), (r"a**", "quantifier on a quantifier"), (r"(a", "'('"),
    (r"\p{L}", "Unicode property"), (r"a^b", "'^' inside")])
def test_unsupported_patterns_are_named(pattern, what):
    with pytest.raises(RegexUnsupported, match=re.escape(what)):
        parse(pattern)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -12, "maximum": 130},
    {"type": "integer", "exclusiveMinimum": 7},
    {"type": "integer", "maximum": -3.5},
    {"type": "integer", "minimum": 99, "exclusiveMaximum": 1001}])
def test_integer_bounds_hold_exactly(schema):
    automaton = Automaton(schema_grammar(schema))
    validator = jsonschema.Draft202012Validator(schema)
    for s in _strings("0123456789-", 4):
        want = bool(re.fullmatch(r"-?(0|[1-9][0-9]*)", s)) and s != "-0" \
            and validator.is_valid(int(s))
        assert accepts(automaton, s.encode()) == want, s


@pytest.mark.parametrize("schema", [
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": -2, "exclusiveMaximum": 3},
    {"type": "number", "minimum": -1},
    {"type": "number", "exclusiveMaximum": 0}])
def test_number_bounds_hold_exactly(schema):
    automaton = Automaton(schema_grammar(schema))
    validator = jsonschema.Draft202012Validator(schema)
    for s in _strings("0123.-", 5):
        want = bool(re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", s)) \
            and validator.is_valid(float(s))
        if want and s.startswith("-") and float(s) == 0:
            continue        # a negative zero: valid, but the grammar need not write it
        assert accepts(automaton, s.encode()) == want, s


def test_strings_count_characters_and_write_escapes():
    automaton = Automaton(schema_grammar({"type": "string", "minLength": 2, "maxLength": 3}))
    for value in ["ab", "é中😀", '"\\', "\n\t", "\u0001x", "a\u2028"]:
        assert accepts(automaton, json.dumps(value).encode())
        assert accepts(automaton, json.dumps(value, ensure_ascii=False).encode())
    for bad in [b'"a"', b'"abcd"', b'"a\nb"', b'"\\ud800x"', b'"\\x"', b'"\xff\xfe"',
                b'"\xed\xa0\x80x"']:
        assert not accepts(automaton, bad), bad


def test_formats_give_values_python_reads():
    rng = np.random.default_rng(5)
    for fmt in FORMATS:
        automaton = Automaton(Grammar({"r": lower(parse(FORMATS[fmt]), code_points)}, "r"))
        for _ in range(30):
            data, stack = b"", (automaton.start,)
            while not (automaton.can_end(stack) and rng.random() < 0.3):
                options = [b for b in range(32, 127) if automaton.step(
                    stack, int(automaton.class_of[b])) is not None]
                if not options:
                    break
                b = int(rng.choice(options))
                data += bytes([b])
                stack = automaton.step(stack, int(automaton.class_of[b]))
            check_formats({"format": fmt}, data.decode())
            if fmt in ("date", "ipv4", "email", "uuid"):
                assert jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(data.decode(),
                                                                                fmt), data


# ---- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {}, "then": {}}, "if"),
    ({"type": "number", "multipleOf": 3}, "multipleOf"),
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "string", "format": "duration"}, "format"),
    ({"type": "string", "pattern": "(a)\\1"}, "pattern"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "pattern"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "allOf"),
    ({"type": "object", "anyOf": [{"required": ["a"]}]}, "type"),
    ({"$ref": "https://example.com/schema"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "type"),
    ({"type": "object", "properties": {"a": {"minProperties": 1}}}, "minProperties"),
    ({"type": "object", "required": ["b"], "additionalProperties": False}, "required"),
    ({"enum": []}, "enum"),
    (False, "false")])
def test_keywords_outside_the_subset_are_refused_by_name(schema, keyword):
    with pytest.raises(SchemaUnsupported) as info:
        Automaton(schema_grammar(schema))
    assert info.value.keyword == keyword, str(info.value)
    assert f"'{keyword}'" in str(info.value)


def test_recursion_that_is_ambiguous_or_empty_is_refused():
    ambiguous = {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
                 "anyOf": [{"$ref": "#/$defs/a"}, {"type": "array", "maxItems": 1}]}
    with pytest.raises(AmbiguousGrammar, match="begins like another"):
        Automaton(schema_grammar(ambiguous))
    with pytest.raises(Exception, match="left recursion"):
        Automaton(Grammar({"r": seq(Ref("r"), text("a"))}, "r"))


def test_a_schema_too_large_to_constrain_is_refused():
    with pytest.raises(GrammarTooLarge):
        Automaton(schema_grammar({"type": "array", "items": {"type": "string", "maxLength": 50},
                                  "minItems": 3000, "maxItems": 3000}))
