"""The paged KV cache's bookkeeping: which fixed-size blocks are free, which sequences hold
which, and which keep a prompt prefix for later requests.

The cache itself (the key/value arrays) lives in the runner; this module only hands out block
ids. A sequence's block table is the list of block ids it holds, in position order: position p
lives in block table[p // block_size] at offset p % block_size.

Prefix caching: a full block whose keys and values are computed is keyed by a hash of its
tokens and of the key of the block before it (so a key names the whole prefix up to the block's
end). A later sequence whose tokens start the same way takes those blocks instead of computing
them again (`match`); several sequences then hold one block, read-only, since only full blocks
are shared and a sequence writes only past them. (`share` holds blocks once more the same way,
without a key: the choices of one prompt read its full blocks.) A keyed block no sequence holds
stays cached until a block is needed and none is free: then the least recently used is taken
back, so the cache never holds blocks the plan promised to the sequences.

Sliding-window layers (Gemma's) need only a sequence's last `window` positions, so where a model
has them their keys and values live apart, in a `Ring` of blocks per sequence: logical block b
of a window layer lives in ring slot b mod the ring's length, each sequence's ring its own
(block tables of their own, `Ring.table`). A step writes a chunk's keys before it reads them, so
a ring holds the window and one chunk (less one position): then no write of a step reaches a
slot that a token of the step still reads. Global layers keep the shared blocks above, at full
context. Window-layer keys of a prefix are overwritten as its ring wraps, so such a model shares
no blocks between sequences (no prefix cache, no fork's hold): those blocks would be valid for
global layers only, and a sequence taking them would still compute its window layers whole.
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def blocks_for(num_tokens, block_size):
    """How many blocks hold num_tokens positions."""
    return -(-num_tokens // block_size)


def prefix_keys(tokens, block_size, n_blocks, known=()):
    """The keys of the first n_blocks full blocks of `tokens`, continuing the `known` ones."""
    keys = list(known[:n_blocks])
    for i in range(len(keys), n_blocks):
        block = np.asarray(tokens[i * block_size:(i + 1) * block_size], np.int64).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else b"") + block,
                                    digest_size=16).digest())
    return keys


@dataclass(frozen=True)
class Ring:
    """The window layers' cache: `rings` rings (one a running sequence) of `length` blocks,
    enough for the last `window` positions and a step's `chunk` of one sequence's tokens."""
    window: int
    block_size: int
    chunk: int          # the most tokens of one sequence a step computes
    rings: int          # sequences holding a ring at once: the most that run

    @property
    def length(self):
        """Blocks a ring. Position p lives in slot p mod (length * block_size), and a step of
        a sequence reads and writes the window - 1 positions before its chunk and the chunk:
        so many consecutive positions never share a slot. (Decoding alone, ceil(window /
        block_size) blocks would do: a ring indexed modulo needs no extra block for a window
        that starts inside one.)"""
        return blocks_for(self.window + self.chunk - 1, self.block_size)

    @property
    def num_blocks(self):
        return self.rings * self.length

    def table(self, ring, width):
        """Ring `ring`'s block table of `width` logical blocks: block b at slot b mod length."""
        return ring * self.length + np.arange(width, dtype=np.int32) % self.length


def ring_for(window, block_size, rings, chunk, context):
    """The Ring of a model whose sliding-window layers see `window` positions (0: it has
    none), serving `rings` sequences of up to `context` tokens in chunks of `chunk`; None where
    it has none or where a ring would hold no fewer blocks than a whole context (the window
    layers then keep the shared blocks as the others)."""
    if not window:
        return None
    ring = Ring(window, block_size, chunk, rings)
    return ring if ring.length < blocks_for(context, block_size) else None


def ring_tensors(graph):
    """The names of a step graph's cache tensors that its window layers keep in a ring (read
    and written through the step input `window_tables`)."""
    return {t.name for op in graph.ops if op.kind == "store_kv"
            and op.inputs[6].name == "window_tables" for t in op.inputs[2:4]}


class RingPool:
    """Which rings are free; a running sequence holds one (scheduler.py)."""

    def __init__(self, ring):
        self.ring = ring
        self._free = list(range(ring.rings - 1, -1, -1))

    @property
    def num_free(self):
        return len(self._free)

    def take(self):
        if not self._free:
            raise RuntimeError("no ring free: more sequences run than the runner has rings")
        return self._free.pop()

    def give(self, ring):
        if ring in self._free or not 0 <= ring < self.ring.rings:
            raise ValueError(f"ring {ring} given back but not held")
        self._free.append(ring)


class BlockAllocator:
    """Block ids 0..num_blocks-1, each free, held by one or more sequences, or cached (keyed,
    held by none). `caching=False`: no block is ever keyed or matched."""

    def __init__(self, num_blocks, block_size, caching=True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, "
                             f"got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._refs = {}                 # held block -> how many sequences hold it
        self.forget()

    def forget(self):
        """Back to as made: every block free, no prefix kept, the counts zero. Only while no
        sequence holds a block."""
        if self._refs:
            raise ValueError(f"{len(self._refs)} blocks are held: nothing is forgotten")
        # Popping from the end hands out low ids first, which keeps tests' block tables readable.
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._key_of, self._block_of = {}, {}       # keyed block <-> its prefix key
        self._cached = OrderedDict()    # keyed blocks no sequence holds, least recent first
        self.hit_tokens = self.query_tokens = self.evictions = 0

    @property
    def num_free(self):
        """Blocks that can be handed out: free, or cached and taken back for it."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self):
        return len(self._refs)

    @property
    def num_cached(self):
        return len(self._cached)

    @property
    def capacity_tokens(self):
        return self.num_blocks * self.block_size

    def grow(self, table, num_tokens):
        """Extend the block table `table` (a list, changed in place) to hold num_tokens positions.

        Returns False, and takes nothing, when too few blocks are free.
        """
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return True

    def _evict(self):
        """The least recently used cached block, its key forgotten."""
        block, _ = self._cached.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.evictions += 1
        return block

    def share(self, table):
        """Hold every block of `table` once more: another sequence reads them too (the choices of
        one prompt share its full blocks, scheduler.py). Each hold is released on its own."""
        for block in table:
            if block not in self._refs:
                raise ValueError(f"block {block} shared but not held")
            self._refs[block] += 1

    def release(self, table):
        """Give back every block of `table` and empty it: a block no sequence holds any more is
        cached if keyed, else free."""
        for block in table:
            if block not in self._refs:
                raise ValueError(f"block {block} released but not held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        table.clear()

    def match(self, tokens, keys=()):
        """The blocks of the longest cached prefix of `tokens` (whole blocks, and never all of
        its tokens: the last one must run to give the next token's logits), now held once more;
        `keys`: prefix_keys already known. Returns (blocks, the keys computed)."""
        n = (len(tokens) - 1) // self.block_size if self.caching else 0
        keys = prefix_keys(tokens, self.block_size, n, keys)
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._cached.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            blocks.append(block)
        self.query_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks, keys

    def register(self, table, tokens, num_computed, keys=(), start=0):
        """Keys the full blocks of `table` whose keys and values are computed (its first
        num_computed positions) from the block of position `start` on (those before it were
        full when `start` positions were computed, and keyed then), so later prompts may take
        them; returns the keys computed."""
        if not self.caching:
            return keys
        full = num_computed // self.block_size
        keys = prefix_keys(tokens, self.block_size, full, keys)
        for i in range(start // self.block_size, full):
            block, key = table[i], keys[i]
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block], self._block_of[key] = key, block
        return keys
