"""Which tokens of a vocabulary a grammar allows next, and one sequence's progress through it.

`Vocabulary.of(tokenizer)` spells every token once as symbols (its bytes; a control token as a
symbol of its own; a token that spells nothing is never allowed), all in one flat array.
`TokenGrammar` binds an Automaton to a vocabulary; `start()` gives a `Matcher`, the constraint
of one sequence: `allowed()` is the packed bitmask of the tokens that may come next (bit t % 32
of word t // 32, end-of-sequence tokens where the grammar may end), `advance(token)` reads one.

A mask is read from the stack's top state for every token at once: numpy reads the
vocabulary's trie a depth at a time, down the prefixes still read only (a prefix many tokens
share is read once), each prefix with its own small stack for the rules it enters and leaves
within itself; a prefix at a state that reads every byte below it back to itself (inside a
string, say) is read whole. A token that reads to its end is allowed, one that finds no way on
is not; one that ends the top state's rule partway is read on, from there, by the state below,
and so down the stack. Masks are kept by the blocks of the stack's states (states that no
token can tell apart: Automaton.alike), the top state's reading per block, in a cache bounded
in bytes: a place seen before, or one alike to it (the same place in another item of an
array), costs a lookup. Compiling grammars is automaton.py's.
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
    """A tokenizer's tokens as symbol strings (and their trie). Build it with `of`."""

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
        self.lengths = np.array([len(s) for s in self.spelled], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.flat = np.array([s for spelled in self.spelled for s in spelled], np.int32)
        self.tokens = np.flatnonzero(self.lengths)      # those that spell something
        self.eos_ids = sorted(t for t in tokenizer.eos_ids if 0 <= t < n)
        self._trie()

    def _trie(self):
        """The tokens' prefixes as a trie, numbered by depth (node 0 is the empty prefix) and
        within a depth by parent: `parent` and `symbol` per node, `levels[d]` the first node of
        depth d, a node's children `child_lo[x]:child_hi[x]`, `node` per token its whole
        spelling's node. `order` is the tokens in their spellings' order, so that the tokens a
        node begins are `order[sub_lo[x]:sub_hi[x]]`, the first `own[x]` of them spelling the
        node itself; `below[:, x]` is the bit set (words) of the bytes under the node, and a
        last bit for any control symbol. Tokens share their prefixes' reading, so reading the
        trie reads a third of the symbols that reading every token would."""
        parent, symbol, levels = [-1], [-1], [0, 1]
        node = np.zeros(self.size, np.int64)
        at = {t: 0 for t in self.tokens.tolist()}      # token -> its node so far
        depth = 0
        while at:
            children = {}
            for t, p in at.items():
                key = (p, self.spelled[t][depth])
                child = children.get(key)
                if child is None:
                    child = children[key] = len(parent)
                    parent.append(p)
                    symbol.append(key[1])
                at[t] = child
            depth += 1
            levels.append(len(parent))
            for t in [t for t in at if self.lengths[t] == depth]:
                node[t] = at.pop(t)
        parent, symbol = np.array(parent, np.int64), np.array(symbol, np.int32)
        n = len(parent)
        renamed = np.arange(n)
        for d in range(1, len(levels) - 1):
            lo, hi = levels[d], levels[d + 1]
            renamed[lo + np.argsort(renamed[parent[lo:hi]], kind="stable")] = np.arange(lo, hi)
        self.parent = np.full(n, -1, np.int64)
        self.parent[renamed[1:]] = renamed[parent[1:]]
        self.symbol = np.zeros(n, np.int32)
        self.symbol[renamed] = symbol
        self.levels, self.node = levels, renamed[node]
        self.child_lo = np.searchsorted(self.parent, np.arange(n), "left")
        self.child_hi = np.searchsorted(self.parent, np.arange(n), "right")
        self.order = np.array(sorted(self.tokens.tolist(), key=self.spelled.__getitem__),
                              np.int64)
        ends = self.node[self.order]
        self.own = np.bincount(ends, minlength=n)
        self.sub_lo = np.full(n, len(self.order), np.int64)
        self.sub_hi = np.zeros(n, np.int64)
        np.minimum.at(self.sub_lo, ends, np.arange(len(self.order)))
        np.maximum.at(self.sub_hi, ends, np.arange(1, len(self.order) + 1))
        below = np.zeros((n, N_BYTES // 64 + 1), np.uint64)     # bytes; then any control
        for d in range(len(levels) - 2, 1, -1):     # each depth's nodes into their parents
            lo, hi = levels[d], levels[d + 1]
            up = self.parent[lo:hi]
            np.minimum.at(self.sub_lo, up, self.sub_lo[lo:hi])
            np.maximum.at(self.sub_hi, up, self.sub_hi[lo:hi])
            under = below[lo:hi].copy()
            sym = np.minimum(self.symbol[lo:hi], N_BYTES)
            under[np.arange(hi - lo), sym // 64] |= np.uint64(1) << (sym % 64).astype(np.uint64)
            first = np.flatnonzero(np.append(True, up[1:] != up[:-1]))
            below[up[first]] |= np.bitwise_or.reduceat(under, first, axis=0)
        self.sub_lo[0], self.sub_hi[0] = 0, len(self.order)
        self.below = below.T.copy()                     # [word, node]

    def bits(self, token_ids):
        """The packed bitmask holding `token_ids`."""
        mask = np.zeros(self.words * 32, bool)
        mask[np.asarray(token_ids, np.int64)] = True
        return pack(mask)


def _ranges(lo, hi):
    """The indices lo[i]:hi[i] of every i, one after another."""
    count = hi - lo
    return np.repeat(lo - np.cumsum(count) + count, count) + np.arange(count.sum())


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
        # A token takes at most (rules + 1) moves a symbol (calls, then a shift; pops need
        # no reach of their own): states alike that far read every token alike, so masks are
        # kept by the blocks of a stack's states, shared by the places that look the same.
        reach = int(vocab.lengths.max(initial=0)) * (len(automaton.rule_names) + 1) + 1
        self._block = automaton.alike(reach).tolist()
        # per state, the bit set of the bytes it reads back to itself: a prefix that reaches it
        # with only such bytes below is read whole, every token it begins allowed
        A, words = automaton, len(vocab.below)
        loops = A.shift == np.arange(len(A.accepting))[:, None]
        loops = np.pad(loops[:, self.class_of[:N_BYTES]], ((0, 0), (0, 64 * words - N_BYTES)))
        self.loops = np.ascontiguousarray(np.packbits(loops, axis=1, bitorder="little")).view(
            np.uint64).T.copy()
        self.looping = loops.any(axis=1)

    def key(self, stack):
        """What the masks of `stack` are kept by: its states' blocks (see Automaton.alike)."""
        block = self._block
        return (self.serial, tuple([block[s] for s in stack]))

    def start(self):
        return Matcher(self)

    # ---- masks -------------------------------------------------------------------------------

    def mask(self, stack):
        """The packed bitmask of the tokens allowed after `stack` (end-of-sequence included
        where the grammar may end there)."""
        key = self.key(stack)
        got = _CACHE.get(key)
        if got is not None:
            return got
        allowed, escapes, deep = self.frame(stack[-1])
        extra, deep = [], [(len(stack), *deep)]
        for level in range(len(stack) - 2, -1, -1):
            if not len(escapes[0]):
                break
            read, escapes, over = self._walk(stack[level], *escapes)
            extra.append(read)
            deep.append((level + 1, *over))
        # tokens that entered more rules than TOKEN_STACK: read one by one
        extra.append([t for height, tokens, offsets in deep for t, j in zip(tokens, offsets)
                      if self.reads(stack[:height], int(t), int(j))])
        extra = np.concatenate([np.asarray(e, np.int64) for e in extra])
        can_end = self.automaton.can_end(stack)
        if extra.size or can_end:
            mask = unpack(allowed, self.vocab.words * 32)
            mask[extra] = True
            allowed = pack(mask) | (self.eos_bits if can_end else 0)
        if not allowed.any():
            raise ConstraintViolated("no token of the vocabulary continues the grammar here")
        _CACHE.put(key, allowed, allowed.nbytes)
        return allowed

    def frame(self, s):
        """For a stack whose top is state s: (the packed mask of the tokens read within its
        rule, (tokens, offsets) of those that end it before their offset-th symbol, (tokens,
        offsets) of those that enter more than TOKEN_STACK rules)."""
        key = (self.serial, "frame", self._block[s])
        got = _CACHE.get(key)
        if got is None:
            v = self.vocab
            read, escapes, deep = self._walk_trie(s)
            mask = np.zeros(v.words * 32, bool)
            mask[read] = True
            got = (pack(mask), escapes, deep)
            _CACHE.put(key, got, got[0].nbytes + 16 * (len(escapes[0]) + len(deep[0])))
        return got

    def _walk_trie(self, s):
        """_walk of every token from its start, read over the vocabulary's trie from the root
        down the prefixes still read: a prefix's outcome is that of every token it begins,
        once it has one, and a prefix at a state that reads all the bytes below it back to
        itself is read whole."""
        v = self.vocab
        n = len(v.parent)
        state, depth = np.empty(n, np.int32), np.empty(n, np.int32)
        stack = np.empty((n, TOKEN_STACK), np.int32)
        state[0], depth[0] = s, 0
        read, ends, escapes, deep = [], [], [], []     # prefixes, and where their tokens end
        alive, d = np.zeros(1, np.int64), 0
        while alive.size and d + 2 < len(v.levels):     # a prefix of the deepest has no child
            d += 1
            if len(alive) == v.levels[d] - v.levels[d - 1]:     # the whole depth read on
                nodes = np.arange(v.levels[d], v.levels[d + 1])
                parents = v.parent[nodes]
            else:
                nodes = _ranges(v.child_lo[alive], v.child_hi[alive])
                parents = np.repeat(alive, v.child_hi[alive] - v.child_lo[alive])
            state[nodes], depth[nodes] = state[parents], depth[parents]
            nested = depth[nodes] > 0
            if nested.any():
                stack[nodes[nested]] = stack[parents[nested]]
            moved, escaped, deeper = self._step(nodes, self.class_of[v.symbol[nodes]], state,
                                                depth, stack)
            if len(escaped):
                escapes += [escaped, np.full(len(escaped), d - 1, np.int64)]
            deep.append(deeper)
            end = v.sub_lo[moved] + v.own[moved]        # the prefix's own tokens alone
            looping = np.flatnonzero(self.looping[state[moved]])
            if len(looping):
                whole = np.ones(len(looping), bool)
                for below, loops in zip(v.below, self.loops):
                    whole &= (below[moved[looping]] & ~loops[state[moved[looping]]]) == 0
                looping = looping[whole]
                end[looping] = v.sub_hi[moved[looping]]
                keep = np.ones(len(moved), bool)
                keep[looping] = False
                alive = moved[keep]
            else:
                alive = moved
            read.append(moved)
            ends.append(end)
        read = np.concatenate(read)
        read = v.order[_ranges(v.sub_lo[read], np.concatenate(ends))]
        gone = np.concatenate(escapes[0::2] or [read[:0]])      # each token it begins, at
        escaped = (v.order[_ranges(v.sub_lo[gone], v.sub_hi[gone])],      # its symbol `at`
                   np.repeat(np.concatenate(escapes[1::2] or [read[:0]]),
                             v.sub_hi[gone] - v.sub_lo[gone]))
        deep = np.concatenate(deep)
        deep = v.order[_ranges(v.sub_lo[deep], v.sub_hi[deep])]
        return read, escaped, (deep, np.zeros(len(deep), np.int64))

    def _step(self, items, classes, state, depth, stack):
        """Reads one class for each of `items` (indices into state, depth and stack, which it
        updates): (those that read it, those that end the walk's first rule first, those that
        would enter more than TOKEN_STACK rules); the others found no way on."""
        A = self.automaton
        shift, accepting = A.shift, A.accepting
        call_state, call_return = A.call_state, A.call_return
        read, escaped, deeper = [], [], []
        todo, c = items, classes
        while todo.size:
            st = state[todo]
            nxt = shift[st, c]
            moved = nxt >= 0
            state[todo[moved]] = nxt[moved]
            read.append(todo[moved])
            rest = ~moved
            todo, c, st = todo[rest], c[rest], st[rest]
            if not todo.size:
                break
            callee = call_state[st, c]
            d = depth[todo]
            calling = callee >= 0
            push = calling & (d < TOKEN_STACK)
            tp = todo[push]
            stack[tp, d[push]] = call_return[st[push], c[push]]
            depth[tp] += 1
            state[tp] = callee[push]
            deeper.append(todo[calling & ~push])
            popping = ~calling & accepting[st]
            inner = popping & (d > 0)
            ti = todo[inner]
            depth[ti] -= 1
            state[ti] = stack[ti, depth[ti]]
            escaped.append(todo[popping & (d == 0)])
            again = push | inner
            todo, c = todo[again], c[again]
        empty = items[:0]
        return (np.concatenate(read or [empty]), np.concatenate(escaped or [empty]),
                np.concatenate(deeper or [empty]))

    def _walk(self, s, tokens, offsets):
        """Reads `tokens` from their `offsets` on, from state s: (the tokens read to their end,
        (tokens, offsets) of those that end s's rule before their offset-th symbol, (tokens,
        their given offsets) of those that enter more than TOKEN_STACK rules)."""
        v = self.vocab
        n = len(tokens)
        where = v.starts[tokens] + offsets            # each token's next symbol in v.flat
        end = v.starts[tokens] + v.lengths[tokens]
        state = np.full(n, s, np.int32)
        depth = np.zeros(n, np.int32)
        stack = np.zeros((n, TOKEN_STACK), np.int32)
        alive = np.arange(n)
        done, escaped, deep = [], [], []
        while alive.size:
            finished = where[alive] >= end[alive]
            done.append(alive[finished])
            alive = alive[~finished]
            if not alive.size:
                break
            alive, gone, deeper = self._step(alive, self.class_of[v.flat[where[alive]]], state,
                                             depth, stack)
            alive.sort()
            escaped.append(gone)
            deep.append(deeper)
            where[alive] += 1
        empty = np.zeros(0, np.int64)
        done, escaped = np.concatenate(done or [empty]), np.concatenate(escaped or [empty])
        deep = np.concatenate(deep or [empty])
        return (tokens[done], (tokens[escaped], where[escaped] - v.starts[tokens[escaped]]),
                (tokens[deep], offsets[deep]))

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

    def ready(self):
        """Whether allowed() answers at once: its mask is kept (or it cannot be made)."""
        return self.ended or self.failed is not None or \
            _CACHE.get(self.grammar.key(self.stack)) is not None

    def allowed(self):
        if self.ended:
            return self.grammar.eos_bits
        try:
            return self.grammar.mask(self.stack)
        except Exception as exc:        # kept, so that a mask thread's failure fails it too
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
        self.stack = g.automaton.settle(stack)

    def can_end(self):
        return self.ended or self.grammar.automaton.can_end(self.stack)
