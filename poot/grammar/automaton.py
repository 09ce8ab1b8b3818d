"""A Grammar compiled to a deterministic pushdown automaton over symbols, and its one step.

Symbols are the 256 byte values and, from 256 on, the grammar's special tokens (`specials`, in
order). Symbols that every expression treats alike share a class; tables are indexed by class.

A rule that lies on no cycle of references is copied into the rules that use it, so only the
root, the recursive rules and those the grammar names `called` keep a machine of their own: a
DFA (subset construction over an
NFA built from the rule's expression) whose edges read a class or call a rule. The DFAs share
one numbering of states. A matcher's state is a stack of states, the one being read on top and
under it the states to return to. Reading a class at the top state either moves along the
state's edge (shift), or enters a rule called there whose first classes hold it (pushing the
state after the call), or, where the state may end its rule, returns to the state below and
reads it there (pop). At most one of these ever applies: a grammar where two could (a called
rule and an edge, or an end and an edge, starting alike) is refused as AmbiguousGrammar, so
every prefix has one stack and the masks of tokens.py can be computed without search.

Not here: which tokens a state allows (tokens.py), where grammars come from (schema.py).
"""
import numpy as np

from .expr import Alt, Chars, Joined, Ref, Repeat, Seq, Token

MAX_NFA_STATES = 400_000
MAX_DFA_STATES = 60_000
N_BYTES = 256


class GrammarError(ValueError):
    """A grammar poot cannot compile; the message says why, for a person."""


class GrammarTooLarge(GrammarError):
    pass


class AmbiguousGrammar(GrammarError):
    pass


class Automaton:
    """The compiled grammar. `shift[s, c]`: the state after reading class c at s (-1: none);
    `call_state[s, c]` and `call_return[s, c]`: the state a call begins at (where c begins the
    called rule) and the state pushed under it; `accepting[s]`: s may end its rule. The last
    class, `dead`, is read nowhere (special tokens the grammar does not name)."""

    def __init__(self, grammar):
        self.specials = []
        builder = _Builder(grammar, self.specials)
        self.classes, self.class_of = _classes(builder.masks(), N_BYTES + len(self.specials))
        self.dead = len(self.classes)
        self.rule_names = builder.called
        dfas = [_determinise(builder, r, self.classes) for r in range(len(builder.called))]
        self._tables(dfas)
        self._check_and_link(dfas)
        self.start = self.rule_start[0]
        self._trim()
        # states with nothing left to read but their rule's end: a stack is left without them
        self._done = (self.accepting & (self.shift < 0).all(axis=1)
                      & (self.call_state < 0).all(axis=1)).tolist()
        # Python lists for the per-token step (numpy scalars are slow one at a time)
        self._shift = self.shift.tolist()
        self._call_state = self.call_state.tolist()
        self._call_return = self.call_return.tolist()
        self._accepting = self.accepting.tolist()

    # ---- building ----------------------------------------------------------------------------

    def _tables(self, dfas):
        offsets = np.cumsum([0] + [len(d.accepting) for d in dfas])
        S = int(offsets[-1])
        if S > MAX_DFA_STATES:
            raise GrammarTooLarge(f"the grammar needs {S} automaton states (at most "
                                  f"{MAX_DFA_STATES}): ask for fewer repetitions or shorter "
                                  "bounded strings and arrays")
        C = self.dead + 1
        self.shift = np.full((S, C), -1, np.int32)
        self.accepting = np.zeros(S, bool)
        self.rule_of = np.zeros(S, np.int32)
        self.rule_start = [int(o) for o in offsets[:-1]]
        self.calls = [[] for _ in range(S)]          # state -> [(rule, return state)]
        for r, dfa in enumerate(dfas):
            base = int(offsets[r])
            for i, (moves, calls) in enumerate(zip(dfa.moves, dfa.calls)):
                for c, t in moves.items():
                    self.shift[base + i, c] = base + t
                self.calls[base + i] = [(rule, base + t) for rule, t in calls.items()]
            self.accepting[base:base + len(dfa.accepting)] = dfa.accepting
            self.rule_of[base:base + len(dfa.accepting)] = r

    def _check_and_link(self, dfas):
        """FIRST and FOLLOW of the called rules, the refusals that keep the automaton
        deterministic, and the call tables."""
        R, S = len(dfas), len(self.accepting)
        names = self.rule_names
        called = {rule for calls in self.calls for rule, _ in calls}
        for r in called:
            if self.accepting[self.rule_start[r]]:
                raise GrammarError(f"the recursive rule {names[r]!r} matches the empty string")
        # left recursion: a rule that calls, before reading anything, a rule that calls it back
        enters = {r: {rule for rule, _ in self.calls[self.rule_start[r]]} for r in range(R)}
        for r in range(R):
            seen, todo = set(), list(enters[r])
            while todo:
                q = todo.pop()
                if q == r:
                    raise GrammarError(f"the rule {names[r]!r} refers to itself before "
                                       "reading anything (left recursion)")
                if q not in seen:
                    seen.add(q)
                    todo.extend(enters[q])
        first = [set() for _ in range(R)]
        changed = True
        while changed:
            changed = False
            for r in range(R):
                got = self._first_at(self.rule_start[r], first)
                if not got <= first[r]:
                    first[r] |= got
                    changed = True
        follow = [set() for _ in range(R)]
        changed = True
        while changed:
            changed = False
            for s in range(S):
                for rule, t in self.calls[s]:
                    got = self._first_at(t, first)
                    if self.accepting[t]:
                        got |= follow[self.rule_of[t]]
                    if not got <= follow[rule]:
                        follow[rule] |= got
                        changed = True
        self.call_state = np.full(self.shift.shape, -1, np.int32)
        self.call_return = np.full(self.shift.shape, -1, np.int32)
        for s in range(S):
            shifts = set(np.flatnonzero(self.shift[s] >= 0).tolist())
            taken = set(shifts)
            for rule, t in self.calls[s]:
                clash = taken & first[rule]
                if clash:
                    raise AmbiguousGrammar(
                        f"in rule {names[self.rule_of[s]]!r}, the recursive rule "
                        f"{names[rule]!r} begins like another choice at the same place "
                        f"({self._describe(clash)})")
                taken |= first[rule]
                for c in first[rule]:
                    self.call_state[s, c] = self.rule_start[rule]
                    self.call_return[s, c] = t
            if self.accepting[s]:
                clash = taken & follow[self.rule_of[s]]
                if clash:
                    raise AmbiguousGrammar(
                        f"the recursive rule {names[self.rule_of[s]]!r} may end where it may "
                        f"also go on, and what follows it begins alike ({self._describe(clash)})")

    def _first_at(self, s, first):
        got = set(np.flatnonzero(self.shift[s] >= 0).tolist())
        for rule, _ in self.calls[s]:
            got |= first[rule]
        return got

    def _describe(self, classes):
        symbols = []
        for c in sorted(classes)[:3]:
            bits = self.classes[c]
            sym = (bits & -bits).bit_length() - 1
            symbols.append(self.specials[sym - N_BYTES] if sym >= N_BYTES else repr(chr(sym)))
        return "both may begin with " + " or ".join(symbols)

    def _trim(self):
        """Edges into states from which no end can be reached are removed, so that a prefix the
        automaton reads can always be completed. A call edge is a way on where the called rule
        can end (its start is live): found by walking back from the ends, until the rules that
        can end stop growing."""
        S = len(self.accepting)
        sources, targets = np.nonzero(self.shift >= 0)
        back = [[] for _ in range(S)]                   # state -> states with an edge to it
        for a, b in zip(sources.tolist(), self.shift[sources, targets].tolist()):
            back[b].append(a)
        returns = [[] for _ in range(S)]                # return state -> (rule, calling state)
        for a, calls in enumerate(self.calls):
            for rule, b in calls:
                returns[b].append((rule, a))
        ending = set()
        while True:
            live = self.accepting.copy()
            todo = np.flatnonzero(live).tolist()
            while todo:
                b = todo.pop()
                for a in back[b] + [a for rule, a in returns[b] if rule in ending]:
                    if not live[a]:
                        live[a] = True
                        todo.append(a)
            grown = {r for r, start in enumerate(self.rule_start) if live[start]}
            if grown == ending:
                break
            ending = grown
        if not live[self.start]:
            raise GrammarError("the grammar matches nothing")
        dead_targets = (self.shift >= 0) & ~live[np.maximum(self.shift, 0)]
        self.shift[dead_targets] = -1
        dead_calls = (self.call_state >= 0) & ~(live[np.maximum(self.call_return, 0)]
                                                & live[np.maximum(self.call_state, 0)])
        self.call_state[dead_calls] = -1
        self.call_return[dead_calls] = -1

    # ---- running -----------------------------------------------------------------------------

    def step(self, stack, c):
        """The stack after reading class c (a tuple of states, top last), or None."""
        shift, call_state, accepting = self._shift, self._call_state, self._accepting
        while True:
            s = stack[-1]
            t = shift[s][c]
            if t >= 0:
                return stack[:-1] + (t,)
            t = call_state[s][c]
            if t >= 0:
                stack = stack[:-1] + (self._call_return[s][c], t)
            elif accepting[s] and len(stack) > 1:
                stack = stack[:-1]
            else:
                return None

    def settle(self, stack):
        """The stack with the called rules that can only end ended: one stack per place in the
        text, whatever token boundary led there (so masks are found once per place)."""
        while len(stack) > 1 and self._done[stack[-1]]:
            stack = stack[:-1]
        return stack

    def can_end(self, stack):
        return all(self._accepting[s] for s in stack)

    def alike(self, steps):
        """Block ids of the states (an int64 array): two states share one when no run of up to
        `steps` moves (shifts, calls and pops) from them tells them apart, so that stacks of
        states alike read every string of that reach alike. Moore's refinement from the
        accepting states, each round recomputing only the blocks that hold a state with a move
        into a state whose block changed; it ends early where nothing changes."""
        S = len(self.accepting)
        moves = np.concatenate([self.shift, self.call_state, self.call_return], axis=1)
        moves = moves[:, (moves >= 0).any(axis=0)]
        sources, columns = np.nonzero(moves >= 0)
        targets = moves[sources, columns]
        by_target = np.argsort(targets, kind="stable")
        into = sources[by_target]                       # the states with a move into t, by t
        into_at = np.searchsorted(targets[by_target], np.arange(S + 1))
        weights = np.random.default_rng(0).integers(1, 1 << 62, moves.shape[1], np.uint64)
        block = self.accepting.astype(np.int64)
        blocks = 2
        todo = np.arange(S)
        for _ in range(steps):
            old = block[todo]
            rows = np.append(block, -1)[moves[todo]]   # -1: no such move
            key = (rows.astype(np.uint64) * weights).sum(axis=1)    # a hash, checked below
            order = np.lexsort((key, old))
            todo, old, rows, key = todo[order], old[order], rows[order], key[order]
            starts = np.ones(len(todo), bool)
            starts[1:] = (key[1:] != key[:-1]) | (old[1:] != old[:-1])
            group = np.cumsum(starts) - 1
            if not (rows == rows[np.flatnonzero(starts)][group]).all():    # a hash collision
                _, group = np.unique(np.column_stack([old, rows]), axis=0, return_inverse=True)
                order = np.argsort(group.ravel(), kind="stable")
                todo, old, group = todo[order], old[order], group.ravel()[order]
                starts = np.ones(len(todo), bool)
                starts[1:] = group[1:] != group[:-1]
            # a block's first group keeps its id; the others take new ones
            group_block = old[starts]
            parted = np.append(False, group_block[1:] == group_block[:-1])
            new_id = blocks + np.cumsum(parted) - 1
            moved = parted[group]
            if not moved.any():
                break
            changed = todo[moved]
            block[changed] = new_id[group[moved]]
            blocks += int(parted.sum())
            lo, n = into_at[changed], into_at[changed + 1] - into_at[changed]
            touched = np.zeros(blocks, bool)
            touched[block[into[np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())]]] = True
            todo = np.flatnonzero(touched[block])
        return block


# ---- NFA ---------------------------------------------------------------------------------------

class _Builder:
    """Thompson NFAs of the called rules (the root first, then the recursive rules and those
    the grammar names), every other rule copied in where it is referred to."""

    def __init__(self, grammar, specials):
        self.rules, self.specials = grammar.rules, specials
        if grammar.root not in self.rules:
            raise GrammarError(f"the root rule {grammar.root!r} is not defined")
        called = _recursive_rules(self.rules) | set(grammar.called)
        self.called = [grammar.root] + sorted(called - {grammar.root})
        self.index = {name: i for i, name in enumerate(self.called)}
        self.eps, self.edges, self.calls = [], [], []
        self.starts, self.ends = [], []
        for name in self.called:
            a, b = self.state(), self.state()
            self.starts.append(a)
            self.ends.append(b)
            self.build(self.rules[name], a, b, (name,))

    def state(self):
        if len(self.eps) >= MAX_NFA_STATES:
            raise GrammarTooLarge(f"the grammar needs over {MAX_NFA_STATES} automaton states: "
                                  "ask for fewer repetitions or shorter bounded strings and "
                                  "arrays")
        self.eps.append([])
        self.edges.append([])
        self.calls.append([])
        return len(self.eps) - 1

    def masks(self):
        return {bits for edges in self.edges for bits, _ in edges}

    def build(self, expr, a, b, inlining):
        """Connects state a to state b by `expr`; `inlining`: the rules being copied in."""
        if isinstance(expr, Chars):
            if expr.bits:
                self.edges[a].append((expr.bits, b))
        elif isinstance(expr, Token):
            if expr.text not in self.specials:
                self.specials.append(expr.text)
            self.edges[a].append((1 << (N_BYTES + self.specials.index(expr.text)), b))
        elif isinstance(expr, Seq):
            at = a
            for item in expr.items[:-1]:
                nxt = self.state()
                self.build(item, at, nxt, inlining)
                at = nxt
            if expr.items:
                self.build(expr.items[-1], at, b, inlining)
            else:
                self.eps[a].append(b)
        elif isinstance(expr, Alt):
            for item in expr.items:
                x, y = self.state(), self.state()
                self.eps[a].append(x)
                self.build(item, x, y, inlining)
                self.eps[y].append(b)
        elif isinstance(expr, Repeat):
            self.repeat(expr, a, b, inlining)
        elif isinstance(expr, Joined):
            self.joined(expr, a, b, inlining)
        elif isinstance(expr, Ref):
            if expr.name in self.index:
                self.calls[a].append((self.index[expr.name], b))
            elif expr.name not in self.rules:
                raise GrammarError(f"the rule {expr.name!r} is not defined")
            else:
                self.build(self.rules[expr.name], a, b, inlining + (expr.name,))
        else:
            raise TypeError(f"not an expression: {expr!r}")

    def repeat(self, expr, a, b, inlining):
        at = a
        for _ in range(expr.min):
            nxt = self.state()
            self.build(expr.item, at, nxt, inlining)
            at = nxt
        if expr.max is None:
            loop, back = self.state(), self.state()
            self.eps[at].append(loop)
            self.build(expr.item, loop, back, inlining)
            self.eps[back].append(loop)
            self.eps[loop].append(b)
            return
        for _ in range(expr.max - expr.min):
            nxt = self.state()
            self.eps[at].append(b)
            self.build(expr.item, at, nxt, inlining)
            at = nxt
        self.eps[at].append(b)

    def joined(self, expr, a, b, inlining):
        """Two chains of states: before item i with nothing written yet (none_i), and with
        something written, so the next item needs the separator first (some_i)."""
        n = len(expr.items)
        none = [a] + [self.state() for _ in range(n - 1)] + [b]
        some = [self.state() for _ in range(n)] + [b]
        for i, (item, optional) in enumerate(expr.items):
            self.build(item, none[i], some[i + 1], inlining)
            mid = self.state()
            self.build(expr.sep, some[i], mid, inlining)
            self.build(item, mid, some[i + 1], inlining)
            if optional:
                self.eps[none[i]].append(none[i + 1])
                self.eps[some[i]].append(some[i + 1])
        if n == 0:
            self.eps[a].append(b)


def _recursive_rules(rules):
    """The rules that reach themselves through references (Tarjan's strongly connected
    components, iteratively)."""
    refs = {name: _refs(expr) for name, expr in rules.items()}
    index, low, on_stack, stack, out = {}, {}, set(), [], set()
    counter = 0
    for root in rules:
        if root in index:
            continue
        work = [(root, iter(refs[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        component.append(x)
                        if x == node:
                            break
                    if len(component) > 1 or node in refs[node]:
                        out.update(component)
            elif child not in rules:
                continue
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(refs[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _refs(expr):
    found, todo = [], [expr]
    while todo:
        e = todo.pop()
        if isinstance(e, Ref):
            found.append(e.name)
        elif isinstance(e, (Seq, Alt)):
            todo.extend(e.items)
        elif isinstance(e, Repeat):
            todo.append(e.item)
        elif isinstance(e, Joined):
            todo.extend(item for item, _ in e.items)
            todo.append(e.sep)
    return list(dict.fromkeys(found))


# ---- classes and DFAs --------------------------------------------------------------------------

def _classes(masks, n_symbols):
    """The coarsest partition of the symbols that every mask is a union of: (class bit sets,
    symbol -> class array); symbols no mask holds form no class (they map to the dead one)."""
    used = 0
    for m in masks:
        used |= m
    classes = [used] if used else []
    for m in masks:
        split = []
        for c in classes:
            inside = c & m
            if inside and inside != c:
                split += [inside, c & ~m]
            else:
                split.append(c)
        classes = split
    class_of = np.full(n_symbols, len(classes), np.int32)
    for i, c in enumerate(classes):
        while c:
            low = c & -c
            class_of[low.bit_length() - 1] = i
            c ^= low
    return classes, class_of


class _DFA:
    def __init__(self):
        self.moves, self.calls, self.accepting = [], [], []


def _determinise(nfa, rule, classes):
    """Subset construction of one called rule's NFA; edges by class and by called rule."""
    of_mask = {}

    def classes_of(bits):
        got = of_mask.get(bits)
        if got is None:
            got = of_mask[bits] = [i for i, c in enumerate(classes) if c & bits]
        return got

    closures = {}

    def closure(state):
        got = closures.get(state)
        if got is None:
            seen, todo = {state}, [state]
            while todo:
                for t in nfa.eps[todo.pop()]:
                    if t not in seen:
                        seen.add(t)
                        todo.append(t)
            got = closures[state] = frozenset(seen)
        return got

    def union(states):
        out = set()
        for s in states:
            out |= closure(s)
        return frozenset(out)

    dfa = _DFA()
    start = closure(nfa.starts[rule])
    ids, todo = {start: 0}, [start]
    end = nfa.ends[rule]

    def id_of(states):
        key = union(states)
        got = ids.get(key)
        if got is None:
            if len(ids) >= MAX_DFA_STATES:
                raise GrammarTooLarge(f"the grammar needs over {MAX_DFA_STATES} automaton "
                                      "states: ask for fewer repetitions or shorter bounded "
                                      "strings and arrays")
            got = ids[key] = len(ids)
            todo.append(key)
        return got

    while len(dfa.moves) < len(todo):
        current = todo[len(dfa.moves)]
        moves, calls = {}, {}
        for s in current:
            for bits, t in nfa.edges[s]:
                for c in classes_of(bits):
                    moves.setdefault(c, set()).add(t)
            for r, t in nfa.calls[s]:
                calls.setdefault(r, set()).add(t)
        dfa.moves.append({c: id_of(targets) for c, targets in moves.items()})
        dfa.calls.append({r: id_of(targets) for r, targets in calls.items()})
        dfa.accepting.append(end in current)
    return dfa
