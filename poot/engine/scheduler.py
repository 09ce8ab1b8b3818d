"""The scheduling policy of continuous batching: which sequences' tokens each step runs.

`Scheduler.schedule(lane)` packs into one step (`build` makes its `StepBatch`) one decode token
for every running sequence of the lane and prefill chunks up to a per-step token budget, so a
long prompt never stalls the others' decoding; newcomers join between steps. Priority is arrival order: when KV
blocks run out, the latest-arrived running sequence is preempted (its blocks freed) and later
resumed by recomputing its prompt and generated tokens. `computed` and `accept` take a step's
results back: each sampled sequence accepts its token, and one that finishes leaves and frees
its blocks. It holds no thread and runs nothing: the engine (engine.py) runs what it schedules,
and says which steps it has launched (`launched`) and which have landed (`computed`, or
`released` for a step that failed): a sequence whose step is in flight is never preempted.
`ahead` packs the step to launch while one is in flight, as `schedule` would once it has
landed, its sampled tokens the device's (engine.py launches it before that one lands).

The n choices of one prompt (a `Fork`) compute it once: the first prefills it, and once it has,
the fork holds the prompt's full blocks (all but the one with its last token) for the others;
each takes them (held once more, read-only, as prefix caching shares blocks) and computes only
the rest, 1 to block_size tokens, whose blocks are its own: copy on write, by recomputing less
than a block instead of copying one. This needs no prefix cache. A fork's hold is the first
thing given back when blocks run short; its waiting choices then compute the prompt themselves.

A row of a step is a token whose logits are read: the last token of a sequence's computed
tokens, to sample the next, and each prompt position whose next token's log probability the
sequence reports (SamplingParams.prompt_logprobs), its row forced to that token. A step has at
most max_seqs rows (what a runner's step buffers hold), so such a prompt's chunks are cut to the
rows the others leave; it takes no cached prefix, whose positions it must score.

A model with sliding-window layers (kvcache.Ring) keeps their keys in a ring per running
sequence: one is taken on admission and given back on finishing, aborting or preemption (there
are as many rings as sequences run at once); a sequence's chunk is cut to the ring's `chunk`,
and no blocks are shared (no prefix cache, no fork's hold: kvcache.py says why).

A constrained sequence whose next mask is not ready (`mask_ready`, engine/masks.py) sits out
decode steps until it is, so that no one else's step waits for it.

With lanes (a pipeline's, engine/group.py) each running sequence belongs to one: newcomers join
the lane whose turn it is, up to its share of the sequences there are.
"""
import logging

import numpy as np

from poot.engine.batch import LogitEdits, SamplingRows, StepBatch
from poot.engine.kvcache import BlockAllocator, RingPool
from poot.engine.request import MAX_LOGPROBS, SamplingParams
from poot.engine.logit_controls import LogitControls

log = logging.getLogger("poot.engine")

# a prompt position's row: its forced token's log probability and the k best, by k
PROMPT_ROWS = [SamplingParams(temperature=0, logprobs=k) for k in range(MAX_LOGPROBS + 1)]


class _Packing:
    """A step being packed: its (sequence, token count) pairs, and the token budget and rows
    left."""

    def __init__(self, budget, rows):
        self.plan, self.scheduled, self.budget, self.rows = [], set(), budget, rows

    def take(self, seq, n, start=None, rows=None):
        """seq's n tokens from `start` (its computed ones) join the step, with their rows
        (Sequence.rows unless given)."""
        self.plan.append((seq, n))
        self.scheduled.add(seq.seq_id)
        self.budget -= n
        self.rows -= seq.rows(seq.num_computed if start is None else start, n) \
            if rows is None else rows


class Scheduler:
    def __init__(self, num_blocks, block_size, max_seqs, step_tokens, table_width, vocab_size,
                 lanes=1, prefix_caching=True, ring=None):
        self.kv = BlockAllocator(num_blocks, block_size, prefix_caching and ring is None)
        self.ring = ring
        self.rings = None if ring is None else RingPool(ring)
        # the most tokens of one sequence a step computes (a ring holds no more than its chunk)
        self.seq_tokens = step_tokens if ring is None else min(step_tokens, ring.chunk)
        self.max_seqs, self.step_tokens = max_seqs, step_tokens
        self.table_width, self.vocab_size, self.lanes = table_width, vocab_size, lanes
        self.waiting = []   # by arrival (seq_id), preempted sequences included
        self.running = []   # by arrival
        # id -> how many steps of the sequence are launched and not landed (a step launched
        # ahead (`ahead`) is in flight beside the one it follows)
        self.in_flight = {}
        self.holds = []     # forks holding their prompt's blocks for their waiting choices
        self.zero_totals()
        # whether a decoding sequence's mask is ready (a threaded engine's MaskThread.ready:
        # a sequence whose mask is not sits out the step); by default every one is
        self.mask_ready = lambda seq: True

    def zero_totals(self):
        """The counts of tokens and preemptions (the engine's stats()), from zero."""
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0

    def add(self, seq):
        ends = tuple(seq.params.stop_token_ids) + (() if seq.params.ignore_eos
                                                   else tuple(seq.eos_ids))
        seq.controls = LogitControls.of(seq.params, seq.prompt, ends, self.vocab_size)
        self.waiting.append(seq)
        if seq.fork is None or seq.fork.first is seq:
            self.prompt_tokens_total += len(seq.prompt)

    def find(self, seq_id):
        return next((s for s in self.waiting + self.running if s.seq_id == seq_id), None)

    def remove(self, seq):
        """Takes a sequence out (finished, aborted or failed) and frees its blocks; False if it
        was not there."""
        for queue_ in (self.running, self.waiting):
            if seq in queue_:
                queue_.remove(seq)
                self.kv.release(seq.blocks)
                self._give_ring(seq)
                if not seq.admitted and seq.fork is not None and seq.fork.first is not seq:
                    self._admitted_one(seq.fork)        # it will take no hold
                return True
        return False

    def clear(self):
        """Every sequence gone and every block free (the engine has failed)."""
        self.waiting.clear()
        self.running.clear()
        self.in_flight.clear()
        self.holds.clear()
        self.kv = BlockAllocator(self.kv.num_blocks, self.kv.block_size, self.kv.caching)
        self.rings = None if self.ring is None else RingPool(self.ring)

    def schedule(self, lane=0, make_room=lambda: False):
        """The lane's next step: (sequence, token count) pairs, empty when it has nothing to
        run (`build` makes its batch). Where only sequences in flight hold the blocks a
        sequence needs, `make_room()` is asked to land their steps (True if it landed any)."""
        step = _Packing(self.step_tokens, self.max_seqs)

        def fit(seq, n):
            """Grow seq's blocks for n more tokens, preempting later arrivals; the n that fits."""
            while not self.kv.grow(seq.blocks, seq.num_computed + n):
                if self._preempt_latest(after=seq.seq_id,
                                        keep=step.scheduled | self.in_flight.keys()):
                    continue
                if self._drop_hold(but=seq.fork) or make_room():
                    continue
                room = (len(seq.blocks) + self.kv.num_free) * self.kv.block_size
                n = min(n, room - seq.num_computed)
                if n < 1:
                    return 0
            return n

        # a sequence that ended while its step was in flight leaves when the step lands
        mine = [s for s in self.running if s.lane == lane and s.finish_reason is None]
        # Decode first: every running sequence with one token to go gets its token.
        for seq in [s for s in mine if s.num_uncomputed == 1]:
            if seq in self.running and step.budget > 0 and self.mask_ready(seq) and fit(seq, 1):
                step.take(seq, 1)
        # Then prefill chunks of admitted sequences, then newcomers (and the preempted) in order.
        for seq in [s for s in mine if s.num_uncomputed > 1]:
            if seq not in self.running or step.budget < 1:
                continue
            n = fit(seq, self._within_rows(
                seq, min(seq.num_uncomputed, step.budget, self.seq_tokens), step.rows))
            if n:
                step.take(seq, n)
        self._admit(lane, step)
        return step.plan

    def _admit(self, lane, step):
        """Newcomers (and the preempted) join `step` in arrival order while its budget and rows
        last. One joins only if a block per running sequence stays free for their next tokens:
        admitting into a full cache would only preempt someone at the next step. With lanes,
        each takes its share of the sequences there are. A fork's choice waits (others pass
        it) until the fork's first has computed the prompt."""
        share = -(-min(self.max_seqs, len(self.running) + len(self.waiting)) // self.lanes)
        i = 0
        while i < len(self.waiting) and step.budget > 0 and len(self.running) < self.max_seqs \
                and sum(s.lane == lane for s in self.running) < share:
            seq = self.waiting[i]
            if seq.waits_for_fork:
                i += 1
                continue
            cached = self._start(seq)
            spare = self.kv.num_free - len(self.running)
            want = self._within_rows(
                seq, min(seq.num_uncomputed, step.budget, self.seq_tokens,
                         spare * self.kv.block_size), step.rows)
            if want < 1:
                self.kv.release(seq.blocks)
                seq.num_computed = 0
                if spare < 1 and self._drop_hold(but=seq.fork):
                    continue
                break
            if not seq.admitted:
                seq.admitted, seq.cached_tokens = True, cached
                if seq.fork is not None and seq.fork.first is not seq:
                    self._admitted_one(seq.fork)
            self.kv.grow(seq.blocks, seq.num_computed + want)
            self.waiting.pop(i)
            if self.rings is not None:
                seq.ring = self.rings.take()
            seq.lane = lane
            self._insert(self.running, seq)
            step.take(seq, want)

    def _start(self, seq):
        """Gives a newcomer the blocks it starts from: its fork's held ones (a choice after the
        first), else those of its longest cached prefix, except where it reports its prompt's log
        probabilities (it computes every position then). Returns how many of its tokens came
        from the prefix cache."""
        fork = seq.fork
        if fork is not None and fork.first is not seq and fork.blocks:
            seq.blocks = list(fork.blocks)
            self.kv.share(seq.blocks)
            seq.num_computed = len(seq.blocks) * self.kv.block_size
            return 0
        if seq.logprob_positions(0, len(seq.prompt)):
            seq.blocks, seq.num_computed = [], 0
            return 0
        seq.blocks, seq.keys = self.kv.match(seq.tokens, seq.keys)
        seq.num_computed = len(seq.blocks) * self.kv.block_size
        return seq.num_computed

    @staticmethod
    def _within_rows(seq, n, rows, start=None):
        """The most of seq's n tokens from `start` (its computed ones) whose rows
        (Sequence.rows) fit the `rows` left."""
        start = seq.num_computed if start is None else start
        scored = seq.logprob_positions(start, n)
        if len(scored) > rows:          # the positions that fit, and none sampled after them
            n = scored.start - start + rows
        if seq.rows(start, n) > rows:   # no row left to sample after the chunk
            n -= 1
        return n

    def _admitted_one(self, fork):
        """One of a fork's waiting choices has been admitted (or has gone): after the last, its
        hold is given back."""
        fork.waiting -= 1
        if fork.waiting == 0 and fork in self.holds:
            self.holds.remove(fork)
            self.kv.release(fork.blocks)

    def _drop_hold(self, but=None):
        """Gives back the latest fork's hold (other than `but`'s) where blocks run short: its
        waiting choices will compute the prompt themselves (from the prefix cache where it
        keeps it). True if there was one."""
        for fork in reversed(self.holds):
            if fork is not but:
                self.holds.remove(fork)
                self.kv.release(fork.blocks)
                return True
        return False

    def launched(self, plan):
        """A step of `plan` is in flight: its sequences' blocks are being written."""
        for seq, _ in plan:
            self.in_flight[seq.seq_id] = self.in_flight.get(seq.seq_id, 0) + 1

    def computed(self, plan):
        """A step of `plan` has landed: its tokens are in the cache, and its full blocks may
        serve later prompts."""
        for seq, n in plan:
            seq.num_computed += n
            seq.keys = self.kv.register(seq.blocks, seq.tokens, seq.num_computed, seq.keys,
                                        seq.num_computed - n)
            fork = seq.fork
            if fork is not None and fork.first is seq and not fork.primed \
                    and seq.num_computed >= len(seq.prompt):
                fork.primed = True
                if fork.waiting and self.ring is None:
                    fork.blocks = seq.blocks[:(len(seq.prompt) - 1) // self.kv.block_size]
                    self.kv.share(fork.blocks)
                    self.holds.append(fork)
        self.released(plan)

    def released(self, plan):
        """A step of `plan` has ended, landed or failed: its sequences are in flight no more
        (but in a step launched after it)."""
        for seq, _ in plan:
            left = self.in_flight.pop(seq.seq_id, 0) - 1
            if left > 0:
                self.in_flight[seq.seq_id] = left

    def accept(self, seq, token, context_limit):
        """A sampled sequence's new token (Sequence.take); a sequence it finishes leaves and
        frees its blocks, once no step of it is in flight (that step still writes them)."""
        seq.take(token, context_limit)
        self.generation_tokens_total += 1
        if seq.finish_reason is not None and seq.seq_id not in self.in_flight:
            self.remove(seq)

    def ahead(self, plan, context_limit, redo=()):
        """The step to launch while `plan`'s is in flight, before it lands (engine.py): what
        `schedule` would pack once it has landed, with the tokens its rows choose on the
        device, greedy or drawn, as inputs (build's `fed`). First a decode token for each of
        its sequences that samples there and is not ended by length; then the next chunk of
        each prompt it computes part of, from the tokens in flight on; then newcomers. Empty
        where some sequence of the plan does not choose so (it reports log probabilities or
        embeds), where a running sequence sits out the plan (it must be scheduled), where a
        model keeps window rings, or where a decode token's block is not free; a prompt whose
        chunk's blocks are not free sits this step out. A sequence a stop token ends computes
        one token more, which is dropped when it lands; so does one in `redo` (its row in the
        step in flight chooses nothing: Engine._choose_ahead). A constrained or edited
        sequence goes ahead too: its step's choice waits for its mask and edits, which follow
        the token the step in flight chooses (StepRunner.choose)."""
        if self.ring is not None or len(plan) > self.step_tokens:
            return []
        planned = {seq.seq_id for seq, _ in plan}
        if any(seq.seq_id not in planned for seq in self.running):
            return []
        step, chunks = _Packing(self.step_tokens, self.max_seqs), []
        for seq, n in plan:
            p = seq.params
            if seq.logprob_positions(seq.num_computed, n) or p.logprobs is not None or p.embed:
                return []
            if seq.finish_reason is not None or seq.seq_id in redo:     # no token follows
                continue
            if not seq.samples_after(seq.num_computed, n):
                chunks.append((seq, seq.num_computed + n))
                continue
            if seq.num_generated + 1 >= seq.max_tokens or len(seq.tokens) + 1 >= context_limit:
                continue
            if not self.kv.grow(seq.blocks, seq.num_computed + n + 1):
                return []
            step.take(seq, 1, rows=1)                # the device's token, its row sampling
        for seq, start in chunks:
            n = self._within_rows(seq, min(len(seq.tokens) - start, step.budget, self.seq_tokens),
                                  step.rows, start)
            if n > 0 and self.kv.grow(seq.blocks, start + n):
                step.take(seq, n, start)
        self._admit(0, step)
        return step.plan

    def end_at_prompt(self, seq):
        """A sequence of max_tokens 0 whose prompt is computed leaves; its Output."""
        output = seq.end_at_prompt()
        self.remove(seq)
        return output

    def _preempt_latest(self, after, keep):
        """Preempt the latest-arrived running sequence later than `after` and not in `keep`."""
        for seq in reversed(self.running):
            if seq.seq_id <= after:
                return False
            if seq.seq_id not in keep:
                self.running.remove(seq)
                self.kv.release(seq.blocks)
                self._give_ring(seq)
                seq.num_computed = 0
                self._insert(self.waiting, seq)
                self.preemptions_total += 1
                return True
        return False

    def _give_ring(self, seq):
        if seq.ring is not None:
            self.rings.give(seq.ring)
            seq.ring = None

    @staticmethod
    def _insert(queue_, seq):
        i = len(queue_)
        while i > 0 and queue_[i - 1].seq_id > seq.seq_id:
            i -= 1
        queue_.insert(i, seq)

    def build(self, plan, fed=None):
        """(StepBatch, its rows in order) of a plan: each row (sequence, position), position
        None where the row samples the sequence's next token, else the prompt position whose
        next token's log probability the row reports. Its block tables are as wide as its
        longest sequence's blocks (a runner's tables are wider: as wide as a context).
        `fed` (a plan of `ahead`): sequence id -> (tokens its step in flight computes, the
        row that samples its next token there, None where its prompt goes on): its tokens
        start after those in flight, and a sampled one's is the device's (StepBatch.feed),
        its row choosing at the step after the one in flight. A fed batch's rows get their
        masks and edits when that step has landed (Engine._choose_ahead)."""
        tokens, positions, seq_rows, sample_tokens, rows, steps, feed = [], [], [], [], [], [], []
        width = max([len(seq.blocks) for seq, _ in plan], default=1) or 1
        tables = np.zeros((len(plan), width), np.int32)
        windows = None if self.ring is None else np.zeros_like(tables)
        for row, (seq, n) in enumerate(plan):
            pending, last_row = (0, None) if fed is None else fed.get(seq.seq_id, (0, None))
            start = seq.num_computed + pending
            for p in seq.logprob_positions(start, n):
                sample_tokens.append(len(tokens) + p - start)
                rows.append((seq, p))
                steps.append(seq.num_generated)
            if last_row is None:
                tokens += seq.tokens[start:start + n]
                feed += [-1] * n
            else:                                   # the device's token, chosen in flight
                tokens.append(0)
                feed.append(last_row)
            positions += range(start, start + n)
            seq_rows += [row] * n
            tables[row, :len(seq.blocks)] = seq.blocks
            if windows is not None:
                windows[row] = self.ring.table(seq.ring, width)
            if last_row is not None or seq.samples_after(start, n):
                sample_tokens.append(len(tokens) - 1)
                rows.append((seq, None))
                steps.append(seq.num_generated + (last_row is not None))
        params = [seq.params if p is None else PROMPT_ROWS[seq.params.prompt_logprobs]
                  for seq, p in rows]
        sampling = self._sampling(params, [seq for seq, _ in rows], steps)
        if any(p is not None for _, p in rows):
            sampling.forced = np.array([-1 if p is None else seq.tokens[p + 1]
                                        for seq, p in rows], np.int32)
        if fed is None:
            self.choices(sampling, rows)
        if any(p is None and seq.params.embed for seq, p in rows):
            sampling.hidden = np.array([p is None and seq.params.embed for seq, p in rows], bool)
        batch = StepBatch(tokens=np.array(tokens, np.int32),
                          positions=np.array(positions, np.int32),
                          seq_rows=np.array(seq_rows, np.int32), block_tables=tables,
                          sample_tokens=np.array(sample_tokens, np.int32), sampling=sampling,
                          window_tables=windows,
                          feed=None if fed is None else np.array(feed, np.int32))
        return batch, rows

    def _sampling(self, params, sampled, steps):
        """SamplingRows of rows under `params`, of the sequences `sampled`, each at its draw's
        step (the tokens its sequence has generated when the row's token is chosen)."""
        return SamplingRows(
            temperature=np.array([p.temperature for p in params], np.float32),
            # a cut past the vocabulary keeps it all (and any top_k fits int32 so)
            top_k=np.array([min(p.top_k, self.vocab_size) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seed=np.array([s.seed for s in sampled], np.uint64),
            step=np.array(steps, np.int64),
            n_logprobs=max([p.logprobs or 0 for p in params], default=0),
            logprobs=any(p.logprobs is not None for p in params),
            reports=np.array([p.logprobs is not None for p in params], bool))

    def choices(self, sampling, rows, skip=()):
        """Each sampling row's mask and logit edits (SamplingRows.masks and edits) as its
        sequence stands now: after the token the step before chose. Rows of a sequence that
        has ended or is in `skip` get none (what they choose is dropped)."""
        rows = [(seq, position) if seq.finish_reason is None and seq.seq_id not in skip
                else (None, position) for seq, position in rows]
        sampling.masks, sampling.masked = self._masks(rows)
        edits = {r: seq.controls.edits(seq.num_generated) for r, (seq, p) in enumerate(rows)
                 if p is None and seq is not None and seq.controls is not None}
        sampling.edits = LogitEdits.of(len(rows), edits) if edits else None

    def _masks(self, rows):
        """(masks, masked) of SamplingRows for a step's rows: each constrained sequence's
        allowed tokens now, on the row that samples; (None, None) where none is constrained."""
        allowed = {}
        for r, (seq, position) in enumerate(rows):
            if seq is not None and seq.constraint is not None and position is None:
                try:
                    allowed[r] = seq.constraint.allowed()
                except Exception as exc:    # its advance() fails it alone, after the step
                    log.error("request %d: its constraint failed", seq.seq_id, exc_info=exc)
        if not allowed:
            return None, None
        masked = np.zeros(len(rows), bool)
        masked[list(allowed)] = True
        words = max(len(bits) for bits in allowed.values())
        masks = np.full((len(rows), words), 0xFFFFFFFF, np.uint32)
        for r, bits in allowed.items():
            masks[r] = 0
            masks[r, :len(bits)] = bits
        return masks, masked
