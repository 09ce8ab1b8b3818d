"""The paged KV cache's bookkeeping: which fixed-size blocks are free and which a sequence holds.

The cache itself (the key/value arrays) lives in the runner; this module only hands out block
ids. A sequence's block table is the list of block ids it holds, in position order: position p
lives in block table[p // block_size] at offset p % block_size.
"""


def blocks_for(num_tokens, block_size):
    """How many blocks hold num_tokens positions."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list over block ids 0..num_blocks-1; every block is either free or held once."""

    def __init__(self, num_blocks, block_size):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, "
                             f"got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low ids first, which keeps tests' block tables readable.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._held = set()

    @property
    def num_free(self):
        return len(self._free)

    @property
    def num_used(self):
        return len(self._held)

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
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.pop()
            self._held.add(block)
            table.append(block)
        return True

    def release(self, table):
        """Give back every block of `table` and empty it."""
        for block in table:
            if block not in self._held:
                raise ValueError(f"block {block} released but not held")
            self._held.remove(block)
            self._free.append(block)
        table.clear()
