"""What one engine step asks of a runner, and what the runner gives back.

A runner has `block_size` and `num_blocks` (its paged KV cache), `vocab_size`, `max_context`,
optionally `max_tokens` and `max_seqs` (the largest step it was built for; the scheduler keeps
within them), and `step(StepBatch) -> StepOutput`.

A step is a flat list of tokens from any number of sequences (prefill chunks and decode tokens
mixed), the paged-KV bookkeeping that places them, and the rows whose next token is sampled.
Everything is a small numpy array so a device runner can copy it to the device as it is and one
recorded step can serve every batch of the same shape. This module holds data only.
"""
from dataclasses import dataclass

import numpy as np

# StepBatch's block tables as a runner uploads them, in order (window_tables only where a graph
# reads it: a ring's)
TABLES = ("window_tables", "block_tables")


@dataclass
class LogitEdits:
    """Per row r, edits of its logits at tokens[row_start[r]:row_start[r + 1]] (each token at
    most once a row): logit x becomes (x / repeat if x > 0 else x * repeat) + add, add -inf a
    ban (engine/sampling.py: edit_logits). Rows without edits have an empty range."""
    row_start: np.ndarray     # int32 [R + 1]
    tokens: np.ndarray        # int32 [E]
    repeat: np.ndarray        # float32 [E]
    add: np.ndarray           # float32 [E]

    @classmethod
    def of(cls, n_rows, rows):
        """The edits of `n_rows` rows from {row: (tokens, repeat, add)} of the rows that have
        some."""
        counts = np.zeros(n_rows + 1, np.int32)
        for r, (tokens, _, _) in rows.items():
            counts[r + 1] = len(tokens)
        order = sorted(rows)
        parts = [np.concatenate([rows[r][i] for r in order]) if order else np.zeros(0)
                 for i in range(3)]
        return cls(np.cumsum(counts, dtype=np.int32), parts[0].astype(np.int32),
                   parts[1].astype(np.float32), parts[2].astype(np.float32))

    def row(self, r):
        """(tokens, repeat, add) of row r."""
        at = slice(self.row_start[r], self.row_start[r + 1])
        return self.tokens[at], self.repeat[at], self.add[at]

    def count(self, r):
        return int(self.row_start[r + 1] - self.row_start[r])


@dataclass
class SamplingRows:
    """Per sampled row: the sampling parameters, as arrays (one entry per row).

    temperature 0 means greedy. top_k 0 means no top-k cut, top_p 1 and min_p 0 mean no cut.
    The random draw of a row is a pure function of (seed, step): see sampling.draw_bits.
    logprobs says whether any row reports log probabilities (the chosen token's, and the
    n_logprobs most likely alternatives); without it a runner may leave them out (zeros).
    reports says which rows do (None: every row, when logprobs); a runner may leave out the
    others' (zeros).
    hidden says which rows' final hidden states (the step graph's "last_hidden": what
    embeddings are made of) the runner reads back into StepOutput.hidden (None: no row's).
    masks, where a row is constrained (SamplingParams.constraint), holds per row the tokens it
    may sample: bit t % 32 of word t // 32 (words past the array, none); masked says which rows
    have one (the others' rows are all ones). None: no row of the step is constrained.
    forced, where a row scores a given token instead of sampling one (a prompt position whose
    next prompt token's log probability is asked), holds that token (-1: the row samples); the
    row's output is that token, its log probability and the best alternatives, as a sampled
    row's; such a row reports (logprobs set; reports, where given, true for it). None: every
    row samples.
    edits, where a row has penalties, a logit bias or a min_tokens ban, holds each such row's
    edits of its logits (LogitEdits). None: no row has any. Masks and edits are applied to the
    logits before everything else (engine/sampling.py: edit_logits).
    """
    temperature: np.ndarray   # float32 [R]
    top_k: np.ndarray         # int32 [R]
    top_p: np.ndarray         # float32 [R]
    min_p: np.ndarray         # float32 [R]
    seed: np.ndarray          # uint64 [R]
    step: np.ndarray          # int64 [R]: how many tokens this sequence has sampled before
    n_logprobs: int = 0
    logprobs: bool = False
    reports: np.ndarray | None = None   # bool [R]
    masks: np.ndarray | None = None     # uint32 [R, words]
    masked: np.ndarray | None = None    # bool [R]
    hidden: np.ndarray | None = None    # bool [R]: rows whose last_hidden the step reads back
    forced: np.ndarray | None = None    # int32 [R]
    edits: LogitEdits | None = None

    @classmethod
    def greedy(cls, rows):
        return cls(temperature=np.zeros(rows, np.float32), top_k=np.zeros(rows, np.int32),
                   top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                   seed=np.zeros(rows, np.uint64), step=np.zeros(rows, np.int64))


@dataclass
class StepBatch:
    """T tokens of S sequences; R of the tokens are sampled.

    tokens[t] sits at position positions[t] of the sequence in row seq_rows[t] of block_tables.
    Its key/value go to cache slot block_tables[row, pos // block_size] * block_size
    + pos % block_size, and it attends to positions 0..positions[t] of its own sequence (causal
    by position, so prefill chunks and decode tokens need no separate paths).
    sample_tokens[r] is the index into tokens whose logits row r samples from.
    block_tables holds a row's blocks in its first columns: as many columns as its longest
    sequence's blocks, or more (a runner's tables hold a context's; past a row's own, none
    is read). window_tables, where the model's sliding-window layers keep a ring
    (kvcache.Ring), are their block tables, of the same shape (None: those layers use
    block_tables).
    """
    tokens: np.ndarray        # int32 [T]
    positions: np.ndarray     # int32 [T]
    seq_rows: np.ndarray      # int32 [T]
    block_tables: np.ndarray  # int32 [S, blocks of its longest sequence or more]
    sample_tokens: np.ndarray  # int32 [R]
    sampling: SamplingRows
    window_tables: np.ndarray | None = None     # int32, block_tables' shape
    # a step launched before the last one landed (engine.py: ahead): per token, the row of
    # the last step whose token it is (the device puts it there), -1 where tokens has it
    feed: np.ndarray | None = None              # int32 [T]

    @property
    def num_tokens(self):
        return len(self.tokens)

    def one_position_each(self):
        """Whether each sequence's tokens in the step sit at one position (a decode step, its
        padded copies of a token included): then every key a token attends to but its own
        was stored by an earlier step."""
        first = np.zeros(len(self.block_tables), np.int64)
        first[self.seq_rows[::-1]] = self.positions[::-1]      # each row's first token's
        return bool(np.array_equal(first[self.seq_rows], self.positions))


@dataclass
class StepOutput:
    """The sampled token of each row, its log probability, and the top alternatives."""
    tokens: np.ndarray        # int32 [R]
    logprobs: np.ndarray      # float32 [R]: log p of the chosen token under the model
    top_ids: np.ndarray       # int32 [R, n_logprobs]
    top_logprobs: np.ndarray  # float32 [R, n_logprobs]
    hidden: dict | None = None  # row -> float32 [d_model], the rows SamplingRows.hidden asks
