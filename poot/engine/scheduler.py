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

With lanes (a pipeline's, engine/group.py) each running sequence belongs to one: newcomers join
the lane whose turn it is, up to its share of the sequences there are.
"""
import logging

import numpy as np

from poot.engine.batch import LogitEdits, SamplingRows, StepBatch
from poot.engine.kvcache import BlockAllocator
from poot.engine.logit_controls import LogitControls

log = logging.getLogger("poot.engine")


class Scheduler:
    def __init__(self, num_blocks, block_size, max_seqs, step_tokens, table_width, vocab_size,
                 lanes=1, prefix_caching=True):
        self.kv = BlockAllocator(num_blocks, block_size, prefix_caching)
        self.max_seqs, self.step_tokens = max_seqs, step_tokens
        self.table_width, self.vocab_size, self.lanes = table_width, vocab_size, lanes
        self.waiting = []   # by arrival (seq_id), preempted sequences included
        self.running = []   # by arrival
        self.in_flight = set()  # ids of the sequences whose steps are launched and not landed
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0

    def add(self, seq):
        ends = tuple(seq.params.stop_token_ids) + (() if seq.params.ignore_eos
                                                   else tuple(seq.eos_ids))
        seq.controls = LogitControls.of(seq.params, seq.prompt, ends, self.vocab_size)
        self.waiting.append(seq)
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
                return True
        return False

    def clear(self):
        """Every sequence gone and every block free (the engine has failed)."""
        self.waiting.clear()
        self.running.clear()
        self.in_flight.clear()
        self.kv = BlockAllocator(self.kv.num_blocks, self.kv.block_size, self.kv.caching)

    def schedule(self, lane=0, make_room=lambda: False):
        """The lane's next step: (sequence, token count) pairs, empty when it has nothing to
        run (`build` makes its batch). Where only sequences in flight hold the blocks a
        sequence needs, `make_room()` is asked to land their steps (True if it landed any)."""
        budget = self.step_tokens
        plan = []
        scheduled = set()

        def take(seq, n):
            nonlocal budget
            plan.append((seq, n))
            scheduled.add(seq.seq_id)
            budget -= n

        def fit(seq, n):
            """Grow seq's blocks for n more tokens, preempting later arrivals; the n that fits."""
            while not self.kv.grow(seq.blocks, seq.num_computed + n):
                if self._preempt_latest(after=seq.seq_id, keep=scheduled | self.in_flight):
                    continue
                if make_room():
                    continue
                room = (len(seq.blocks) + self.kv.num_free) * self.kv.block_size
                n = min(n, room - seq.num_computed)
                if n < 1:
                    return 0
            return n

        mine = [s for s in self.running if s.lane == lane]
        # Decode first: every running sequence with one token to go gets its token.
        for seq in [s for s in mine if s.num_uncomputed == 1]:
            if seq in self.running and budget > 0 and fit(seq, 1):
                take(seq, 1)
        # Then prefill chunks of admitted sequences, then newcomers (and the preempted) in order.
        for seq in [s for s in mine if s.num_uncomputed > 1]:
            if seq not in self.running or budget < 1:
                continue
            n = fit(seq, min(seq.num_uncomputed, budget))
            if n:
                take(seq, n)
        # A newcomer joins only if a block per running sequence stays free for their next
        # tokens: admitting into a full cache would only preempt someone at the next step.
        # With lanes, each takes its share of the sequences there are.
        share = -(-min(self.max_seqs, len(self.running) + len(self.waiting)) // self.lanes)
        # It takes the blocks of its longest cached prefix first, and computes only the rest.
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs \
                and sum(s.lane == lane for s in self.running) < share:
            seq = self.waiting[0]
            seq.blocks, seq.keys = self.kv.match(seq.tokens, seq.keys)
            seq.num_computed = len(seq.blocks) * self.kv.block_size
            spare = self.kv.num_free - len(self.running)
            want = min(seq.num_uncomputed, budget, spare * self.kv.block_size)
            if want < 1:
                self.kv.release(seq.blocks)
                seq.num_computed = 0
                break
            if not seq.admitted:
                seq.admitted, seq.cached_tokens = True, seq.num_computed
            self.kv.grow(seq.blocks, seq.num_computed + want)
            self.waiting.pop(0)
            seq.lane = lane
            self._insert(self.running, seq)
            take(seq, want)
        return plan

    def launched(self, plan):
        """A step of `plan` is in flight: its sequences' blocks are being written."""
        self.in_flight.update(seq.seq_id for seq, _ in plan)

    def computed(self, plan):
        """A step of `plan` has landed: its tokens are in the cache, and its full blocks may
        serve later prompts."""
        for seq, n in plan:
            seq.num_computed += n
            seq.keys = self.kv.register(seq.blocks, seq.tokens, seq.num_computed, seq.keys)
        self.released(plan)

    def released(self, plan):
        """A step of `plan` has ended, landed or failed: its sequences are in flight no more."""
        self.in_flight.difference_update(seq.seq_id for seq, _ in plan)

    def accept(self, seq, token, logprob, now, context_limit):
        """A sampled sequence's new token; its Output. A sequence that finishes leaves and
        frees its blocks."""
        output = seq.accept(token, logprob, now, context_limit)
        self.generation_tokens_total += 1
        if seq.finish_reason is not None:
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
                seq.num_computed = 0
                self._insert(self.waiting, seq)
                self.preemptions_total += 1
                return True
        return False

    @staticmethod
    def _insert(queue_, seq):
        i = len(queue_)
        while i > 0 and queue_[i - 1].seq_id > seq.seq_id:
            i -= 1
        queue_.insert(i, seq)

    def build(self, plan):
        """(StepBatch, the sequences it samples, in row order) of a plan."""
        tokens, positions, seq_rows, sample_tokens, sampled = [], [], [], [], []
        tables = np.zeros((len(plan), self.table_width), np.int32)
        for row, (seq, n) in enumerate(plan):
            start = seq.num_computed
            tokens += seq.tokens[start:start + n]
            positions += range(start, start + n)
            seq_rows += [row] * n
            tables[row, :len(seq.blocks)] = seq.blocks
            if start + n == len(seq.tokens):
                sample_tokens.append(len(tokens) - 1)
                sampled.append(seq)
        params = [s.params for s in sampled]
        sampling = SamplingRows(
            temperature=np.array([p.temperature for p in params], np.float32),
            # a cut past the vocabulary keeps it all (and any top_k fits int32 so)
            top_k=np.array([min(p.top_k, self.vocab_size) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seed=np.array([s.seed for s in sampled], np.uint64),
            step=np.array([s.num_generated for s in sampled], np.int64),
            n_logprobs=max([p.logprobs or 0 for p in params], default=0),
            logprobs=any(p.logprobs is not None for p in params),
            reports=np.array([p.logprobs is not None for p in params], bool))
        sampling.masks, sampling.masked = self._masks(sampled)
        edits = {r: seq.controls.edits(seq.num_generated) for r, seq in enumerate(sampled)
                 if seq.controls is not None}
        if edits:
            sampling.edits = LogitEdits.of(len(sampled), edits)
        batch = StepBatch(tokens=np.array(tokens, np.int32),
                          positions=np.array(positions, np.int32),
                          seq_rows=np.array(seq_rows, np.int32), block_tables=tables,
                          sample_tokens=np.array(sample_tokens, np.int32), sampling=sampling)
        return batch, sampled

    def _masks(self, sampled):
        """(masks, masked) of SamplingRows for the sampled sequences: each constrained one's
        allowed tokens now; (None, None) where none is constrained."""
        allowed = {}
        for r, seq in enumerate(sampled):
            if seq.constraint is not None:
                try:
                    allowed[r] = seq.constraint.allowed()
                except Exception as exc:    # its advance() fails it alone, after the step
                    log.error("request %d: its constraint failed", seq.seq_id, exc_info=exc)
        if not allowed:
            return None, None
        masked = np.zeros(len(sampled), bool)
        masked[list(allowed)] = True
        words = max(len(bits) for bits in allowed.values())
        masks = np.full((len(sampled), words), 0xFFFFFFFF, np.uint32)
        for r, bits in allowed.items():
            masks[r] = 0
            masks[r, :len(bits)] = bits
        return masks, masked
