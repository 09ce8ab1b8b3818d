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
    once per (key, tokenizer); raises GrammarError as `build` or compiling does."""
    vocab = Vocabulary.of(tokenizer)
    with _lock:
        got = _compiled.get((key, id(vocab)))
        if got is not None and got.vocab is vocab:
            _compiled.move_to_end((key, id(vocab)))
            return got
    got = TokenGrammar(Automaton(build()), vocab)
    with _lock:
        _compiled[(key, id(vocab))] = got
        while len(_compiled) > CACHED_GRAMMARS:
            _compiled.popitem(last=False)
    return got
