"""Which tokens of a vocabulary a grammar allows next, and one sequence's progress through it.

`Vocabulary.of(tokenizer)` spells every token once as symbols (its bytes; a control token as a
symbol of its own; a token that spells nothing is never allowed) and orders the tokens longest
first, so that the j-th symbols of all tokens longer than j are one contiguous array.
`TokenGrammar` binds an Automaton to a vocabulary; `start()` gives a `Matcher`, the constraint
of one sequence: `allowed()` is the packed bitmask of the tokens that may come next (bit t % 32
of word t // 32, end-of-sequence tokens where the grammar may end), `advance(token)` reads one.

A mask comes from the stack's top state alone, computed once per state for every token at
once: numpy reads the tokens' symbols position by position, each token with its own small stack
for the rules it enters and leaves within itself. A token that reads to its end is allowed, one
that finds no way on is not; one that ends the top state's rule partway (its rest is read by
the states below) is finished one by one for the stack at hand. Masks are kept per state and
per stack in a cache bounded in bytes, so a state seen before costs a lookup.
"""
import threading
import weakref
from collections import OrderedDict
from itertools import count

import numpy as np

from poot.text.tokenizer import CONTROL, UNKNOWN, UNUSED

from .automaton import N_BYTES

TOKEN_STACK = 8                 # rules one token may enter within itself, read at once
CACHE_BYTES = 256 << 20         # masks kept, over every grammar


class ConstraintViolated(RuntimeError):
    """A token the constraint did not allow was read (the runner ignored the mask), or no
    token of the vocabulary continues the grammar."""


class Vocabulary:
    """A tokenizer's tokens as symbol strings, longest first. Build it with `of`."""

    _made = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer):
        """The tokenizer's Vocabulary, built once."""
        with cls._lock:
            made = cls._made.get(tokenizer)
            if made is None:
                made = cls._made[tokenizer] = cls(tokenizer)
            return made

    def __init__(self, tokenizer):
        n = self.size = tokenizer.vocab_size
        self.words = -(-n // 32)
        self.control = {}               # control token text -> its symbol
        self.spelled = []               # per token id: its symbols (a tuple)
        for i in range(n):
            kind = tokenizer.token_types[i]
            if kind == CONTROL:
                symbol = self.control.setdefault(tokenizer.tokens[i],
                                                 N_BYTES + len(self.control))
                self.spelled.append((symbol,))
            elif kind in (UNKNOWN, UNUSED):
                self.spelled.append(())
            else:
                self.spelled.append(tuple(tokenizer.token_bytes(i)))
        lengths = np.array([len(s) for s in self.spelled], np.int64)
        order = np.argsort(-lengths, kind="stable")
        self.order = order[lengths[order] > 0]
        longest = int(lengths.max(initial=0))
        # count[j]: how many tokens are longer than j (they are order[:count[j]])
        self.count = [int(np.count_nonzero(lengths > j)) for j in range(longest)]
        flat = np.array([s for t in self.order for s in self.spelled[t]], np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths[self.order])[:-1]]).astype(np.int64)
        self.columns = [flat[starts[:self.count[j]] + j] for j in range(longest)]
        self.eos_ids = sorted(t for t in tokenizer.eos_ids if 0 <= t < n)

    def bits(self, token_ids):
        """The packed bitmask holding `token_ids`."""
        mask = np.zeros(self.words * 32, bool)
        mask[np.asarray(token_ids, np.int64)] = True
        return pack(mask)


def pack(mask):
    """bool [32 * words] -> uint32 [words], bit t % 32 of word t // 32 for token t."""
    return np.packbits(mask, bitorder="little").view(np.uint32)


def unpack(bits, size):
    """uint32 [words] -> bool [size]: tokens past the mask's words are not allowed."""
    mask = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), bitorder="little")
    out = np.zeros(size, bool)
    n = min(size, len(mask))
    out[:n] = mask[:n]
    return out


class _Cache:
    """Least recently used masks within a byte budget, shared by every TokenGrammar."""

    def __init__(self, max_bytes):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.entries.move_to_end(key)
            return entry[0]

    def put(self, key, value, nbytes):
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = (value, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes and len(self.entries) > 1:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.bytes -= dropped


_CACHE = _Cache(CACHE_BYTES)
_serials = count()


class TokenGrammar:
    """An Automaton read token by token over a Vocabulary (immutable; shared by requests)."""

    def __init__(self, automaton, vocab):
        self.automaton, self.vocab = automaton, vocab
        self.serial = next(_serials)
        self.class_of = np.full(N_BYTES + len(vocab.control), automaton.dead, np.int32)
        self.class_of[:N_BYTES] = automaton.class_of[:N_BYTES]
        for i, name in enumerate(automaton.specials):
            symbol = vocab.control.get(name)
            if symbol is not None:
                self.class_of[symbol] = automaton.class_of[N_BYTES + i]
        self._class_list = self.class_of.tolist()
        self.eos_bits = vocab.bits(vocab.eos_ids)

    def start(self):
        return Matcher(self)

    # ---- masks -------------------------------------------------------------------------------

    def mask(self, stack):
        """The packed bitmask of the tokens allowed after `stack` (end-of-sequence included
        where the grammar may end there)."""
        key = (self.serial, stack)
        got = _CACHE.get(key)
        if got is not None:
            return got
        allowed, escapes, restarts = self.frame(stack[-1])
        extra = [t for t in restarts if self.reads(stack, t, 0)]
        if len(stack) > 1:
            below = stack[:-1]
            extra += [t for t, j in escapes if self.reads(below, t, j)]
        if extra or self.automaton.can_end(stack):
            allowed = allowed.copy()
            for t in extra:
                allowed[t >> 5] |= np.uint32(1 << (t & 31))
            if self.automaton.can_end(stack):
                allowed |= self.eos_bits
        if not allowed.any():
            raise ConstraintViolated("no token of the vocabulary continues the grammar here")
        _CACHE.put(key, allowed, allowed.nbytes)
        return allowed

    def frame(self, s):
        """For a stack whose top is state s: (the packed mask of tokens read within the top
        rule, [(token, j)] of tokens that end it before their j-th symbol, [tokens] that
        enter more rules than TOKEN_STACK)."""
        key = (self.serial, "frame", s)
        got = _CACHE.get(key)
        if got is None:
            got = self._walk(s)
            _CACHE.put(key, got, got[0].nbytes + 16 * len(got[1]))
        return got

    def _walk(self, s):
        A, v = self.automaton, self.vocab
        shift, accepting = A.shift, A.accepting
        call_state, call_return = A.call_state, A.call_return
        n = len(v.order)
        state = np.full(n, s, np.int32)             # by position in v.order
        depth = np.zeros(n, np.int32)
        stack = np.zeros((n, TOKEN_STACK), np.int32)
        alive = np.arange(n)
        done, escapes, restarts = [], [], []
        for j, column in enumerate(v.columns):
            finished = alive >= v.count[j]          # tokens no longer than j: read entirely
            done.append(alive[finished])
            alive = alive[~finished]
            if not alive.size:
                break
            classes = self.class_of[column[alive]]
            keep = np.ones(alive.size, bool)
            todo = np.arange(alive.size)
            while todo.size:
                t, c = alive[todo], classes[todo]
                st = state[t]
                nxt = shift[st, c]
                moved = nxt >= 0
                state[t[moved]] = nxt[moved]
                rest = ~moved
                todo, t, c, st = todo[rest], t[rest], c[rest], st[rest]
                if not todo.size:
                    break
                callee = call_state[st, c]
                d = depth[t]
                calling = callee >= 0
                push = calling & (d < TOKEN_STACK)
                tp = t[push]
                stack[tp, d[push]] = call_return[st[push], c[push]]
                depth[tp] += 1
                state[tp] = callee[push]
                over = calling & ~push
                restarts.append(t[over])
                popping = ~calling & accepting[st]
                inner = popping & (d > 0)
                ti = t[inner]
                depth[ti] -= 1
                state[ti] = stack[ti, depth[ti]]
                outer = popping & (d == 0)
                escapes.extend((int(p), j) for p in t[outer])
                keep[todo[over | outer | (~calling & ~accepting[st])]] = False
                todo = todo[push | inner]
            alive = alive[keep]
        done.append(alive)
        mask = np.zeros(v.words * 32, bool)
        mask[v.order[np.concatenate(done)]] = True
        order = v.order.tolist()
        restarted = [order[p] for p in np.concatenate(restarts or [np.zeros(0, np.int64)])]
        return pack(mask), [(order[p], j) for p, j in escapes], restarted

    def reads(self, stack, token, j):
        """Whether the token's symbols from the j-th on can be read after `stack`."""
        step, class_of = self.automaton.step, self._class_list
        for symbol in self.vocab.spelled[token][j:]:
            stack = step(stack, class_of[symbol])
            if stack is None:
                return False
        return True


class Matcher:
    """One sequence's progress through a TokenGrammar: the engine's constraint of a row."""

    def __init__(self, grammar):
        self.grammar = grammar
        self.stack = (grammar.automaton.start,)
        self.ended = False          # an end-of-sequence token was read
        self.failed = None          # why allowed() failed: advance() raises it

    def allowed(self):
        if self.ended:
            return self.grammar.eos_bits
        try:
            return self.grammar.mask(self.stack)
        except ConstraintViolated as exc:
            self.failed = exc
            raise

    def advance(self, token):
        g = self.grammar
        if self.failed is not None:
            raise self.failed
        if token in g.vocab.eos_ids:
            if not (self.ended or g.automaton.can_end(self.stack)):
                raise ConstraintViolated(f"end-of-sequence token {token} before the grammar "
                                         "can end")
            self.ended = True
            return
        spelled = g.vocab.spelled[token] if 0 <= token < g.vocab.size else ()
        stack = None if self.ended or not spelled else self.stack
        for symbol in spelled:
            if stack is None:
                break
            stack = g.automaton.step(stack, g._class_list[symbol])
        if stack is None:
            raise ConstraintViolated(f"token {token} does not continue the grammar")
        self.stack = stack

    def can_end(self):
        return self.ended or self.grammar.automaton.can_end(self.stack)
