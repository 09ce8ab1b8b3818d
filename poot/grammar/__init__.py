"""Constrained decoding: grammars compiled to the tokens a sequence may sample next.

expr.py describes languages; schema.py (JSON Schema) and regex.py (patterns, and whole outputs
by a regular expression) write them;
automaton.py compiles one to a deterministic pushdown automaton; tokens.py reads a vocabulary
through it: `TokenGrammar.start()` is a sequence's constraint (`allowed()` a packed bitmask of
the vocabulary, `advance(token)`), which rides on SamplingParams into the engine. `compiled`
keeps what it compiles by a key (a schema's JSON text, say), so a second request with the same
schema compiles nothing and finds its masks cached.
"""
import threading
from collections import OrderedDict

from .automaton import AmbiguousGrammar, Automaton, GrammarError, GrammarTooLarge
from .regex import RegexUnsupported, regex_grammar
from .schema import SchemaUnsupported, json_object_grammar, schema_grammar
from .tokens import ConstraintViolated, Matcher, TokenGrammar, Vocabulary

__all__ = ["AmbiguousGrammar", "Automaton", "ConstraintViolated", "GrammarError",
           "GrammarTooLarge", "Matcher", "RegexUnsupported", "SchemaUnsupported", "TokenGrammar",
           "Vocabulary", "compiled", "json_object_grammar", "regex_grammar", "schema_grammar"]

CACHED_GRAMMARS = 64
_compiled = OrderedDict()
_lock = threading.Lock()


def compiled(key, build, tokenizer):
    """The TokenGrammar of `build()` (a Grammar) over the tokenizer's vocabulary, compiled
    once per (key, tokenizer); raises GrammarError as `build` or compiling does. Requests that
    ask for one key together wait for one compilation: each grammar keeps its own masks, so
    two of one schema would each compute them."""
    vocab = Vocabulary.of(tokenizer)
    name = (key, id(vocab))
    while True:
        with _lock:
            got = _compiled.get(name)
            if isinstance(got, TokenGrammar) and got.vocab is vocab:
                _compiled.move_to_end(name)
                return got
            if not isinstance(got, threading.Event):
                building = _compiled[name] = threading.Event()
                break
        got.wait()              # another request compiles it; then it is there (or it failed)
    try:
        got = TokenGrammar(Automaton(build()), vocab)
    except BaseException:
        with _lock:
            del _compiled[name]
        building.set()
        raise
    with _lock:
        _compiled[name] = got
        while len(_compiled) > CACHED_GRAMMARS:
            old, entry = next(iter(_compiled.items()))
            if isinstance(entry, threading.Event):
                break           # still compiling: kept until it is there
            del _compiled[old]
    building.set()
    return got
