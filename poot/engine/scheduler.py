"""The engine: continuous batching of requests over one runner with a paged KV cache.

`Engine.submit` queues a prompt and returns a `RequestHandle` that yields an `Output` per step.
Each `Engine.step` packs, into one `StepBatch`, one decode token for every running sequence and
prefill chunks up to a per-step token budget, so a long prompt never stalls the others' decoding.
New sequences join between steps. Priority is arrival order: when KV blocks run out, the
latest-arrived running sequence is preempted (its blocks freed) and later resumed by recomputing
its prompt and generated tokens. The engine runs on its own thread (`start`) or is driven by the
caller (`generate`, `run_until_idle`); both use the same `step`. It never formats JSON.

A runner with lanes (a pipeline over several devices, engine/group.py) gets a step of each lane
in flight: each running sequence belongs to a lane (newcomers join the lane whose turn it is,
up to its share), and `step` takes the lanes in turn, collecting the lane's step in flight,
delivering its tokens, then scheduling and launching its next step while the other lanes' run.
A sequence whose step is in flight is never preempted nor freed: where only such a sequence
could give up blocks, or a cancelled one is in flight, its lane's step is collected first.

A step that raises fails its own requests (their handles get EngineFailed, their blocks are
freed), the runner recovers (`recover`: what the step issued is waited for) and the engine
serves on. Where the runner cannot recover, the device is lost: every request fails, `error`
says so, `device_lost` is set and `on_failure` is called, so the server stops and exits.
"""
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from poot.engine.batch import SamplingRows, StepBatch
from poot.engine.kvcache import BlockAllocator, blocks_for
from poot.engine.request import EngineFailed, InvalidRequest, Sequence, TokenLogprob

log = logging.getLogger("poot.engine")


@dataclass
class EngineStats:
    """A snapshot for /metrics and /health."""
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    steps_total: int
    error: str | None
    step_failures_total: int = 0
    kernel_times: dict | None = None    # kernel -> (launches, device seconds), when timed


def _snapshot(kernel_times):
    return None if kernel_times is None else {k: tuple(v) for k, v in kernel_times.items()}


class RequestHandle:
    """The caller's side of one request: iterate it for Outputs; the last has finish_reason."""

    def __init__(self, engine, seq):
        self._engine = engine
        self._queue = queue.Queue()
        self.seq_id = seq.seq_id
        self.seed = seq.seed
        self.prompt_tokens = len(seq.prompt)
        self.finished = False

    def _put(self, item):
        self._queue.put(item)

    def next_output(self, timeout=None):
        """The next Output; None if `timeout` seconds pass first. Raises the engine's error.

        With no engine thread running, waiting means driving the engine's steps here.
        """
        if self.finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get_nowait()
                break
            except queue.Empty:
                pass
            if self._engine.threaded:
                try:
                    item = self._queue.get(timeout=timeout)
                    break
                except queue.Empty:
                    return None
            if not self._engine.step() and self._queue.empty():
                raise RuntimeError(f"request {self.seq_id} has nothing to wait for: "
                                   "the engine is idle")
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def __iter__(self):
        while not self.finished:
            yield self.next_output()

    def cancel(self):
        """End the request; its blocks are freed before the next step and it finishes "abort"."""
        if not self.finished:
            self._engine._cancel(self.seq_id)


class Engine:
    def __init__(self, runner, tokenizer, *, max_seqs=16, step_tokens=256, max_context=None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv = BlockAllocator(runner.num_blocks, runner.block_size)
        # A lone sequence must always fit the cache, so a context never exceeds its capacity.
        limits = [runner.max_context, self.kv.capacity_tokens]
        if max_context is not None:
            limits.append(max_context)
        self.context_limit = min(limits)
        # A device runner sizes its step buffers for at most max_tokens tokens of max_seqs
        # sequences; the reference runner takes any step.
        self.max_seqs = min(max_seqs, getattr(runner, "max_seqs", max_seqs))
        self.step_tokens = min(max(step_tokens, self.max_seqs),
                               getattr(runner, "max_tokens", step_tokens))
        self.table_width = blocks_for(self.context_limit, runner.block_size)
        self.error = None           # why the engine serves no more (device lost, or a bug)
        self.device_lost = False
        self.on_failure = None      # called (on the engine's thread) once error is set
        self._next_id = 0
        self._inbox = deque()
        self._wake = threading.Condition()
        self._step_lock = threading.RLock()
        # A pipeline's runner has lanes (engine/group.py): each keeps a step of its own
        # sequences in flight while the others' run, so every stage has work.
        self.lanes = getattr(runner, "lanes", [runner])
        self._flight = [None] * len(self.lanes)     # per lane: (plan, sampled, output)
        self._turn = 0
        self._waiting = []    # by arrival (seq_id), preempted sequences included
        self._running = []    # by arrival
        self._handles = {}
        self._thread = None
        self._stopping = False
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._preemptions_total = 0
        self._steps_total = 0
        self._step_failures_total = 0

    # ---- the caller's side -------------------------------------------------------------------

    def submit(self, prompt_ids, params):
        """Queue a request; raises InvalidRequest for a prompt or max_tokens that cannot run."""
        if self.error is not None:
            raise EngineFailed(self.error)
        if self._stopping:
            raise EngineFailed("the engine has stopped")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.runner.vocab_size - 1})", "prompt")
        room = self.context_limit - len(prompt)
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; this server's context "
                                 f"is {self.context_limit} tokens and needs room for at least "
                                 "one more", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens {max_tokens} plus the prompt's {len(prompt)} tokens "
                                 f"exceeds this server's context of {self.context_limit} tokens",
                                 "max_tokens")
        with self._wake:
            seq_id = self._next_id
            self._next_id += 1
        seq = Sequence.create(seq_id, prompt, params, max_tokens, self.tokenizer)
        seq.last_token_time = time.monotonic()
        handle = RequestHandle(self, seq)
        with self._wake:
            self._inbox.append(("submit", seq, handle))
            self._wake.notify()
        return handle

    def generate(self, prompt_ids, params):
        """Outputs of one request; with no engine thread, the caller's thread runs the steps."""
        handle = self.submit(prompt_ids, params)
        try:
            yield from handle
        finally:
            handle.cancel()

    def run_until_idle(self):
        while self.step():
            pass

    def start(self):
        """Run steps on an engine thread until stop()."""
        self._thread = threading.Thread(target=self._loop, name="poot-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout=10.0):
        """Abort whatever is in flight and end the engine thread."""
        self.abort_all()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._step_lock:
            self._apply_inbox()

    def abort_all(self):
        with self._wake:
            ids = [s.seq_id for s in self._waiting + self._running]
            ids += [item[1].seq_id for item in self._inbox if item[0] == "submit"]
        for seq_id in ids:
            self._cancel(seq_id)

    @property
    def threaded(self):
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self):
        return not (self._inbox or self._waiting or self._running)

    def stats(self):
        with self._wake:
            pending = sum(1 for item in self._inbox if item[0] == "submit")
        return EngineStats(
            waiting=len(self._waiting) + pending, running=len(self._running),
            kv_blocks_used=self.kv.num_used, kv_blocks_free=self.kv.num_free,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            preemptions_total=self._preemptions_total, steps_total=self._steps_total,
            error=self.error, step_failures_total=self._step_failures_total,
            kernel_times=_snapshot(getattr(self.runner, "kernel_times", None)))

    def _cancel(self, seq_id):
        with self._wake:
            self._inbox.append(("cancel", seq_id))
            self._wake.notify()
        if not self.threaded:
            with self._step_lock:
                self._apply_inbox()

    # ---- the engine's side -------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._wake:
                while not self._stopping and not self._inbox and not self._waiting \
                        and not self._running:
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                stepped = self.step()
            except Exception as exc:       # a bug outside any step must not hang requests
                self._fail(f"engine failed: {type(exc).__name__}: {exc}", exc)
                return
            if not stepped:
                if self.error is not None:
                    return
                with self._wake:
                    self._wake.wait(0.01)

    def step(self):
        """Run one batch (with lanes: the next lane's, after delivering its step in flight);
        False when there was nothing to run."""
        with self._step_lock:
            self._apply_inbox()
            if self.error is not None:
                return False
            lane = self._turn
            self._turn = (lane + 1) % len(self.lanes)
            delivered = self._collect(lane)
            plan = self._schedule(lane)
            if plan and self._launch(lane, plan) and len(self.lanes) == 1:
                self._collect(lane)
            return self.error is None and bool(delivered or plan or any(self._flight))

    def _launch(self, lane, plan):
        """Issues a lane's step of `plan` (without lanes: runs it); False if it raised (its
        requests failed)."""
        try:
            batch, sampled = self._build(plan)
            if len(self.lanes) == 1:
                out = self.runner.step(batch)
            else:
                self.lanes[lane].launch(batch)
                out = None                      # collect() gives it
        except Exception as exc:
            self._step_failed(lane, plan, exc)
            return False
        self._steps_total += 1
        self._flight[lane] = (plan, sampled, out)
        return True

    def _collect(self, lane):
        """Waits for a lane's step in flight and delivers its tokens; False if it had none."""
        flight = self._flight[lane]
        if flight is None:
            return False
        self._flight[lane] = None
        plan, sampled, out = flight
        try:
            if out is None:
                out = self.lanes[lane].collect()
        except Exception as exc:
            self._step_failed(lane, plan, exc)
            return False
        for seq, n in plan:
            seq.num_computed += n
        now = time.monotonic()
        for r, seq in enumerate(sampled):
            try:
                self._deliver(seq, out, r, now)
            except Exception as exc:        # one request's text or stop check: it alone fails
                log.error("request %d failed", seq.seq_id, exc_info=exc)
                self._fail_sequences([seq], f"request failed: {type(exc).__name__}: {exc}")
        return True

    def _step_failed(self, lane, plan, exc):
        """A step raised: its requests fail and the lane's runner recovers; a runner that
        cannot recover has lost its device, and the engine fails."""
        self._step_failures_total += 1
        log.error("a step of %d sequence(s) failed; they fail, the others are served",
                  len(plan), exc_info=exc)
        try:
            self.lanes[lane].recover()
        except Exception as lost:
            self.device_lost = True
            self._fail(f"device lost: {type(lost).__name__}: {lost} (after a step failed: "
                       f"{type(exc).__name__}: {exc})", lost)
            return
        self._fail_sequences([seq for seq, _ in plan],
                             f"engine step failed: {type(exc).__name__}: {exc}")

    def _fail_sequences(self, seqs, message):
        """These requests end with EngineFailed(message); their blocks are freed."""
        for seq in seqs:
            for queue_ in (self._running, self._waiting):
                if seq in queue_:
                    queue_.remove(seq)
                    self.kv.release(seq.blocks)
                    seq.finish_reason = "error"
                    handle = self._handles.pop(seq.seq_id, None)
                    if handle is not None:
                        handle._put(EngineFailed(message))

    def _in_flight(self):
        """The ids of the sequences whose steps are in flight (their blocks are in use)."""
        return {seq.seq_id for flight in self._flight if flight for seq, _ in flight[0]}

    def _drain(self, but=None):
        """Collects every lane's step in flight (but lane `but`'s); True if there was one."""
        return any([self._collect(lane) for lane in range(len(self.lanes)) if lane != but])

    def _apply_inbox(self):
        while True:
            with self._wake:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
            if item[0] == "submit":
                _, seq, handle = item
                if self.error is not None:
                    handle._put(EngineFailed(self.error))
                    continue
                self._handles[seq.seq_id] = handle
                self._waiting.append(seq)
                self._prompt_tokens_total += len(seq.prompt)
            else:
                self._abort(item[1])

    def _abort(self, seq_id):
        if seq_id in self._in_flight():     # its step still writes into its blocks
            self._drain()
        for queue_ in (self._waiting, self._running):
            for seq in queue_:
                if seq.seq_id == seq_id:
                    queue_.remove(seq)
                    self.kv.release(seq.blocks)
                    self._handles.pop(seq_id)._put(seq.abort())
                    return

    def _schedule(self, lane=0):
        """Choose (sequence, token count) pairs for a lane's step, preempting when blocks run
        out. Sequences of other lanes' steps in flight are never preempted; where only those
        could make room, their steps are collected first."""
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
                if self._preempt_latest(after=seq.seq_id, keep=scheduled | self._in_flight()):
                    continue
                if self._drain(but=lane):
                    continue
                room = (len(seq.blocks) + self.kv.num_free) * self.kv.block_size
                n = min(n, room - seq.num_computed)
                if n < 1:
                    return 0
            return n

        mine = [s for s in self._running if s.lane == lane]
        # Decode first: every running sequence with one token to go gets its token.
        for seq in [s for s in mine if s.num_uncomputed == 1]:
            if seq in self._running and budget > 0 and fit(seq, 1):
                take(seq, 1)
        # Then prefill chunks of admitted sequences, then newcomers (and the preempted) in order.
        for seq in [s for s in mine if s.num_uncomputed > 1]:
            if seq not in self._running or budget < 1:
                continue
            n = fit(seq, min(seq.num_uncomputed, budget))
            if n:
                take(seq, n)
        # A newcomer joins only if a block per running sequence stays free for their next
        # tokens: admitting into a full cache would only preempt someone at the next step.
        # With lanes, each takes its share of the sequences there are.
        share = -(-min(self.max_seqs, len(self._running) + len(self._waiting)) // len(self.lanes))
        while self._waiting and budget > 0 and len(self._running) < self.max_seqs \
                and sum(s.lane == lane for s in self._running) < share:
            seq = self._waiting[0]
            spare = self.kv.num_free - len(self._running)
            want = min(seq.num_uncomputed, budget, spare * self.kv.block_size)
            if want < 1:
                break
            self.kv.grow(seq.blocks, want)
            self._waiting.pop(0)
            seq.lane = lane
            self._insert(self._running, seq)
            take(seq, want)
        return plan

    def _preempt_latest(self, after, keep):
        """Preempt the latest-arrived running sequence later than `after` and not in `keep`."""
        for seq in reversed(self._running):
            if seq.seq_id <= after:
                return False
            if seq.seq_id not in keep:
                self._running.remove(seq)
                self.kv.release(seq.blocks)
                seq.num_computed = 0
                self._insert(self._waiting, seq)
                self._preemptions_total += 1
                return True
        return False

    @staticmethod
    def _insert(queue_, seq):
        i = len(queue_)
        while i > 0 and queue_[i - 1].seq_id > seq.seq_id:
            i -= 1
        queue_.insert(i, seq)

    def _build(self, plan):
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
            top_k=np.array([min(p.top_k, self.runner.vocab_size) for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            min_p=np.array([p.min_p for p in params], np.float32),
            seed=np.array([s.seed for s in sampled], np.uint64),
            step=np.array([s.num_generated for s in sampled], np.int64),
            n_logprobs=max([p.logprobs or 0 for p in params], default=0),
            logprobs=any(p.logprobs is not None for p in params),
            reports=np.array([p.logprobs is not None for p in params], bool))
        sampling.masks, sampling.masked = self._masks(sampled)
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

    def _deliver(self, seq, out, r, now):
        token = int(out.tokens[r])
        if seq.constraint is not None:
            seq.constraint.advance(token)       # raises where the runner broke the mask
        logprob = None
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            top = [(int(i), float(lp))
                   for i, lp in zip(out.top_ids[r, :k], out.top_logprobs[r, :k])]
            logprob = TokenLogprob(token, float(out.logprobs[r]), top)
        output = seq.accept(token, logprob, now, self.context_limit)
        self._generation_tokens_total += 1
        if seq.finish_reason is not None:
            self._running.remove(seq)
            self.kv.release(seq.blocks)
            self._handles.pop(seq.seq_id)._put(output)
        else:
            self._handles[seq.seq_id]._put(output)

    def _fail(self, message, exc):
        """The engine can serve no more: every request ends with the error, and on_failure
        is told (the server drains and exits, for a supervisor to restart it)."""
        self.error = message
        log.error("%s", self.error, exc_info=exc)
        for handle in self._handles.values():
            handle._put(EngineFailed(self.error))
        self._handles.clear()
        self._waiting.clear()
        self._running.clear()
        self._flight = [None] * len(self.lanes)
        self.kv = BlockAllocator(self.kv.num_blocks, self.kv.block_size)   # nothing holds any
        if self.on_failure is not None:
            self.on_failure()
