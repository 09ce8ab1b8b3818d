"""The engine: continuous batching of requests over one runner, on a thread of its own.

`Engine.submit` queues a prompt (`submit_prompts`: several, with n choices each) and returns a
`RequestHandle` that yields an `Output` per step of each choice.
Each `Engine.step` lands the step in flight (the runner's `collect`: its tokens), takes what
the next step needs of it (each token, and the stops a token decides), asks the scheduler
(scheduler.py: the policy) for the next step and launches it, and only then delivers the landed
step's outputs (text, stop strings, log probabilities, each request's handle): the device runs
step n+1 while the host delivers step n. A sequence that a stop string ends during delivery while
its next step is in flight drops that step's token and frees its blocks when the step lands. The
engine runs on its own thread (`start`) or is driven by the caller (`generate`,
`run_until_idle`); both use the same `step`. It never formats JSON.

A runner with lanes (a pipeline over several devices, engine/group.py) gets a step of each lane
in flight: `step` takes the lanes in turn, landing the lane's step in flight and launching its
next while the other lanes' run. A sequence whose step is in flight is never preempted nor
freed: where only such a sequence could give up blocks, or a cancelled one is in flight, its
lane's step is landed first.

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
from contextlib import contextmanager
from dataclasses import dataclass, replace

from poot.engine.kvcache import blocks_for
from poot.engine.masks import MaskThread
from poot.engine.request import (MAX_CHOICES, MAX_N, EngineFailed, Fork, InvalidRequest,
                                 SamplingParams, Sequence, TokenLogprob, Usage)
from poot.engine.scheduler import Scheduler

log = logging.getLogger("poot.engine")

WARM_UP_TOKENS = 4      # Engine.warm_up's request: a prompt step, then steps launched ahead


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
    prefix_cache_hit_tokens_total: int = 0      # prompt tokens taken from the prefix cache
    prefix_cache_query_tokens_total: int = 0    # prompt tokens looked up in it
    prefix_cache_evictions_total: int = 0       # cached blocks taken back for new tokens
    kv_blocks_cached: int = 0                   # blocks no sequence holds that keep a prefix
    launch_gaps_total: int = 0                  # steps launched right after one landed ...
    launch_gap_seconds_total: float = 0.0       # ... and the seconds from the landing to it
    launch_gap_cpu_seconds_total: float = 0.0   # ... of which the engine thread ran (not waited)
    steps_ahead_total: int = 0                  # steps launched on the tokens of one in flight


def _snapshot(kernel_times):
    return None if kernel_times is None else {k: tuple(v) for k, v in kernel_times.items()}


class RequestHandle:
    """The caller's side of one request: iterate it for Outputs as they come. Output.index says
    whose (prompt i's choice j is i * n + j); each choice's last has finish_reason, and the
    request is finished when every choice is. `usage` then sums them: each prompt's tokens
    once (its cached ones: its first choice's), every choice's generated tokens."""

    def __init__(self, engine, seqs, n):
        self._engine = engine
        self._queue = queue.Queue()
        self.seq_ids = [seq.seq_id for seq in seqs]
        self.seeds = [seq.seed for seq in seqs]
        self.n = n
        self._open = len(seqs)
        self.usage = Usage(0, 0)
        self.finished = False
        self._lock = threading.Lock()
        self._listener = None

    def _put(self, item):
        with self._lock:
            if self._listener is None:
                self._queue.put(item)
                return
            self._listener(self, self._account(item))

    def _account(self, item):
        """An item as its consumer takes it: a choice's last Output adds to `usage`, and the
        request is finished once every choice's has come (or an error)."""
        if isinstance(item, BaseException):
            self.finished = True
        elif item.finish_reason is not None:
            u = item.usage
            first = item.index % self.n == 0
            self.usage = Usage(self.usage.prompt_tokens + first * u.prompt_tokens,
                               self.usage.completion_tokens + u.completion_tokens,
                               self.usage.cached_tokens + first * u.cached_tokens)
            self._open -= 1
            self.finished = self._open == 0
        return item

    def listen(self, listener):
        """From now on each Output (or the error that ends the request) goes to
        `listener(handle, item)`, called on the engine's thread as the step delivers it, the
        ones queued already first: a server hands a step's tokens on in bulk this way instead
        of waking a thread per token. The listener must be quick and must not block."""
        with self._lock:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                listener(self, self._account(item))
            self._listener = listener

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
                raise RuntimeError(f"request {self.seq_ids[0]} has nothing to wait for: "
                                   "the engine is idle")
        if isinstance(self._account(item), BaseException):
            raise item
        return item

    def __iter__(self):
        while not self.finished:
            yield self.next_output()

    def cancel(self):
        """End the request, every choice: their blocks are freed before the next step and the
        unfinished ones finish "abort"."""
        if not self.finished:
            self._engine._cancel(self.seq_ids)


class Engine:
    def __init__(self, runner, tokenizer, *, max_seqs=16, step_tokens=256, max_context=None,
                 prefix_caching=True, ahead=True):
        self.runner = runner
        self.tokenizer = tokenizer
        capacity = runner.num_blocks * runner.block_size
        # A lone sequence must always fit the cache, so a context never exceeds its capacity.
        limits = [runner.max_context, capacity]
        if max_context is not None:
            limits.append(max_context)
        self.context_limit = min(limits)
        # A device runner sizes its step buffers for at most max_tokens tokens of max_seqs
        # sequences; the reference runner takes any step.
        self.max_seqs = min(max_seqs, getattr(runner, "max_seqs", max_seqs))
        self.step_tokens = min(max(step_tokens, self.max_seqs),
                               getattr(runner, "max_tokens", step_tokens))
        # A pipeline's runner has lanes (engine/group.py): each keeps a step of its own
        # sequences in flight while the others' run, so every stage has work.
        self.lanes = getattr(runner, "lanes", [runner])
        # Window layers' rings (kvcache.Ring): one a running sequence, and nothing shared.
        ring = getattr(runner, "ring", None)
        if ring is not None:
            self.max_seqs = min(self.max_seqs, ring.rings)
        self.prefix_caching = prefix_caching and ring is None
        self.scheduler = Scheduler(runner.num_blocks, runner.block_size, self.max_seqs,
                                   self.step_tokens, blocks_for(self.context_limit,
                                                                runner.block_size),
                                   runner.vocab_size, len(self.lanes), prefix_caching, ring)
        self.error = None           # why the engine serves no more (device lost, or a bug)
        self.device_lost = False
        self.on_failure = None      # called (on the engine's thread) once error is set
        self._next_id = 0
        self._inbox = deque()
        self._wake = threading.Condition()
        self._step_lock = threading.RLock()
        self._flight = [None] * len(self.lanes)     # per lane: (plan, rows) launched
        # a step launched on the device's tokens of the one in flight before it lands
        # (Scheduler.ahead), where the runner feeds them (StepRunner.feeds): (plan, rows)
        self._ahead = None
        # a step launched ahead whose choice waits for the landing of the one before it
        # (StepRunner.choose: its masks and edits follow that one's tokens), and the sequences
        # whose rows in the step in flight choose nothing (their mask was not ready)
        self._unchosen = None
        self._redo = set()
        self.ahead = ahead and len(self.lanes) == 1 and getattr(runner, "feeds", False)
        self._turn = 0
        self._handles = {}
        self._thread = None
        self._stopping = False
        self._zero_counts()
        self._landed_cpu = 0.0      # the engine thread's CPU time when its last step landed
        # clear from a step's landing to the next launch: threads that work per token (the
        # server's stream writer) wait for it at their loop's head, so as not to take the
        # interpreter's lock from the engine's thread while the device idles
        self.launched = threading.Event()
        self.launched.set()
        # clear while the engine's thread issues a step on a device (schedules, builds and
        # launches it; the device waits for those launches): the server makes requests only
        # while it is set (Serving.intake), so a burst of arrivals leaves the interpreter's lock
        # to the launches. Never clear for the reference runner, whose launch computes the step.
        self.host_free = threading.Event()
        self.host_free.set()
        self._gates_intake = all(getattr(lane, "queues", False) for lane in self.lanes)

    def _zero_counts(self):
        """The engine's own counts (stats()), from zero."""
        self._steps_total = 0
        self._steps_ahead = 0
        self._step_failures_total = 0
        self._gaps = 0              # launches that followed a landing in the same step() ...
        self._gap_seconds = 0.0     # ... and their host time between: the device idles there
        self._gap_cpu = 0.0         # ... of it, the engine thread's own CPU time (the rest it
                                    # waited: for the interpreter's lock, or the CPU)

    @property
    def kv(self):
        return self.scheduler.kv

    # ---- the caller's side -------------------------------------------------------------------

    def submit(self, prompt_ids, params, n=1):
        """Queue a request of n choices of a prompt (submit_prompts)."""
        return self.submit_prompts([prompt_ids], params, n)

    def submit_prompts(self, prompts, params, n=1):
        """Queue a request of n choices of each prompt; raises InvalidRequest for a prompt,
        max_tokens or n that cannot run. Each choice samples on its own: with a seed, choice j
        of a prompt samples with seed + j (mod 2**64), as vLLM seeds them, so choice 0 is the
        prompt's answer with n = 1. A prompt is computed once for its choices (Fork)."""
        if self.error is not None:
            raise EngineFailed(self.error)
        if self._stopping:
            raise EngineFailed("the engine has stopped")
        if not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be between 1 and {MAX_N}, got {n}", "n")
        if not prompts:
            raise InvalidRequest("no prompt", "prompt")
        if len(prompts) * n > MAX_CHOICES:
            raise InvalidRequest(f"{len(prompts)} prompts of {n} choices: a request has at most "
                                 f"{MAX_CHOICES} choices", "prompt")
        checked = [self._check_prompt(p, params, f"prompt {i}: " if len(prompts) > 1 else "")
                   for i, p in enumerate(prompts)]
        bad = [t for t in params.logit_bias or () if t >= self.runner.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                 f"(0..{self.runner.vocab_size - 1})", "logit_bias")
        with self._wake:
            seq_id = self._next_id
            self._next_id += len(prompts) * n
        seqs = []
        now = time.monotonic()
        for prompt, max_tokens in checked:
            for j in range(n):
                seed = None if params.seed is None else (params.seed + j) % 2 ** 64
                seq = Sequence.create(seq_id + len(seqs), prompt, params, max_tokens,
                                      self.tokenizer, seed, index=len(seqs))
                seq.last_token_time = now
                if n > 1:
                    seq.fork = Fork(seq, n - 1) if j == 0 else seqs[-j].fork
                seqs.append(seq)
        handle = RequestHandle(self, seqs, n)
        with self._wake:
            self._inbox.append(("submit", seqs, handle))
            self._wake.notify()
        return handle

    def check_prompt(self, prompt_ids, params):
        """Raises InvalidRequest where submit would refuse this prompt; queues nothing."""
        self._check_prompt(prompt_ids, params, "")

    def _check_prompt(self, prompt_ids, params, where):
        """(the prompt's token ids, its max_tokens) where it can run; else InvalidRequest."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidRequest(f"{where}the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
        if bad:
            raise InvalidRequest(f"{where}token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.runner.vocab_size - 1})", "prompt")
        room = self.context_limit - len(prompt)
        if room < (params.max_tokens != 0):
            raise InvalidRequest(f"{where}the prompt has {len(prompt)} tokens; this server's "
                                 f"context is {self.context_limit} tokens and needs room for at "
                                 "least one more", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(f"{where}max_tokens {max_tokens} plus the prompt's {len(prompt)} "
                                 f"tokens exceeds this server's context of {self.context_limit} "
                                 "tokens", "max_tokens")
        return prompt, max_tokens

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

    def warm_up(self, prompt_ids, max_tokens=WARM_UP_TOKENS, timeout=60.0):
        """Runs one greedy request of max_tokens through the engine and then forgets it (its
        KV blocks and prefix, every count /metrics reports), so that the first requests a
        server takes do not pay the steps' one-time work (in the process, the driver and the
        device): a server calls it before it takes requests. Tokens past the first come from
        steps launched ahead where the engine launches them; the decode step's graph is
        recorded. Faults injected into the runner (engine/faults.py) wait for the steps served
        after it. Raises what the request raises."""
        if not self.idle:
            raise RuntimeError("warm_up: the engine is serving requests")
        faults = [(lane, lane.faults) for lane in self.lanes
                  if getattr(lane, "faults", None) is not None]
        for lane, _ in faults:
            lane.faults = None
        prompt = list(prompt_ids)[:max(1, self.context_limit - 1)]     # as the context holds
        max_tokens = min(max_tokens, self.context_limit - len(prompt))
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for _ in self.generate(prompt, params):
                pass
            deadline = time.monotonic() + timeout
            while not self.idle:        # a step launched ahead of the request's end lands
                if not self.threaded:
                    self.step()
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"warm_up: the engine was not idle after {timeout:.0f} s")
                else:
                    time.sleep(0.001)
        finally:
            for lane, held in faults:
                lane.faults = held
        with self._step_lock:
            if self.error is not None:
                raise EngineFailed(self.error)
            self.kv.forget()
            self.scheduler.zero_totals()
            self._zero_counts()
            times = getattr(self.runner, "kernel_times", None)
            if times is not None:
                times.clear()

    def start(self):
        """Run steps on an engine thread until stop(); the masks that are not kept are
        computed beside it (engine/masks.py)."""
        self.scheduler.mask_ready = MaskThread(self._wake).ready
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
            ids = [s.seq_id for s in self.scheduler.waiting + self.scheduler.running]
            ids += [seq.seq_id for item in self._inbox if item[0] == "submit"
                    for seq in item[1]]
        self._cancel(ids)

    @property
    def threaded(self):
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self):
        return not (self._inbox or self.scheduler.waiting or self.scheduler.running
                    or any(self._flight) or self._ahead)

    def stats(self):
        with self._wake:
            pending = sum(len(item[1]) for item in self._inbox if item[0] == "submit")
        s = self.scheduler
        return EngineStats(
            waiting=len(s.waiting) + pending, running=len(s.running),
            kv_blocks_used=s.kv.num_used, kv_blocks_free=s.kv.num_free,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            preemptions_total=s.preemptions_total, steps_total=self._steps_total,
            error=self.error, step_failures_total=self._step_failures_total,
            kernel_times=_snapshot(getattr(self.runner, "kernel_times", None)),
            prefix_cache_hit_tokens_total=s.kv.hit_tokens,
            prefix_cache_query_tokens_total=s.kv.query_tokens,
            prefix_cache_evictions_total=s.kv.evictions, kv_blocks_cached=s.kv.num_cached,
            launch_gaps_total=self._gaps, launch_gap_seconds_total=self._gap_seconds,
            launch_gap_cpu_seconds_total=self._gap_cpu, steps_ahead_total=self._steps_ahead)

    def _cancel(self, seq_ids):
        with self._wake:
            self._inbox.extend(("cancel", seq_id) for seq_id in seq_ids)
            self._wake.notify()
        if not self.threaded:
            with self._step_lock:
                self._apply_inbox()

    # ---- the engine's side -------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._wake:
                while not self._stopping and self.idle:
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
        """Land the lane's step in flight (its tokens taken), schedule and launch the lane's
        next, then deliver the landed step's outputs while the device runs the next; False
        when there was nothing to run."""
        with self._step_lock:
            self._apply_inbox()
            if self.error is not None:
                return False
            lane = self._turn
            self._turn = (lane + 1) % len(self.lanes)
            plan = None
            try:
                with self._issuing():
                    went_ahead = self._launch_ahead()
                landed = self._land(lane)
                if not went_ahead:
                    with self._issuing():
                        plan = self.scheduler.schedule(
                            lane, make_room=lambda: self._drain(but=lane))
                        if plan and self._launch(lane, plan) and landed is not None:
                            self._gaps += 1
                            self._gap_seconds += time.monotonic() - landed[2]
                            self._gap_cpu += time.thread_time() - self._landed_cpu
            finally:
                self.launched.set()
            if landed is not None:
                self._deliver(*landed)
            return self.error is None and bool(landed or plan or any(self._flight))

    @contextmanager
    def _issuing(self):
        """Engine.host_free is clear within (where the runner queues its steps)."""
        if not self._gates_intake:
            yield
            return
        self.host_free.clear()
        try:
            yield
        finally:
            self.host_free.set()

    def _launch(self, lane, plan):
        """Issues a lane's step of `plan`; False if it raised (its requests failed)."""
        try:
            batch, rows = self.scheduler.build(plan)
            self.lanes[lane].launch(batch)
        except Exception as exc:
            self._step_failed(lane, plan, exc)
            return False
        self._steps_total += 1
        self.scheduler.launched(plan)
        self._flight[lane] = (plan, rows)
        return True

    def _launch_ahead(self):
        """Launches the step that follows the one in flight on its device's tokens, before that
        one lands (Scheduler.ahead), so the device goes from one to the next without waiting
        for the host's landing, scheduling and launch; True if it did. A launch that fails
        fails the step in flight too (the runner's recovery waits for it) and its requests."""
        flight = self._flight[0]
        if not self.ahead or flight is None or self._ahead is not None \
                or not self.lanes[0].chooses_on_device():
            return False
        plan, rows = flight
        ahead = self.scheduler.ahead(plan, self.context_limit, self._redo)
        if not ahead:
            return False
        chooses = all(seq.constraint is None and seq.controls is None for seq, _ in ahead)
        sampled = {seq.seq_id: r for r, (seq, position) in enumerate(rows) if position is None}
        fed = {seq.seq_id: (n, sampled.get(seq.seq_id)) for seq, n in plan}
        try:
            batch, ahead_rows = self.scheduler.build(ahead, fed)
            self.lanes[0].launch(batch, chooses)
        except Exception as exc:
            self._flight[0] = None
            self.scheduler.released(plan)
            self._step_failed(0, plan, exc)
            return False
        self._steps_total += 1
        self._steps_ahead += 1
        self.scheduler.launched(ahead)
        self._ahead = (ahead, ahead_rows)
        if not chooses:
            self._unchosen = (self._ahead, batch.sampling)
        return True

    def _choose_ahead(self, lane):
        """The choice of the step launched ahead that is in flight now, once the step before
        it has landed: its rows' masks and edits follow the tokens just taken. A constrained
        sequence whose mask is not ready chooses nothing there (it is in `_redo`): its token is
        computed and its choice dropped, and a later step computes it again and chooses, so
        no one else's step waits for its mask (engine/masks.py)."""
        (plan, rows), sampling = self._unchosen
        self._unchosen = None
        redo = {seq.seq_id for seq, _ in plan if seq.finish_reason is None
                and seq.constraint is not None and not self.scheduler.mask_ready(seq)}
        try:
            sampling = replace(sampling)
            self.scheduler.choices(sampling, rows, skip=redo)
            self.lanes[lane].choose(sampling)
        except Exception as exc:
            self._flight[lane] = None
            self.scheduler.released(plan)
            self._step_failed(lane, plan, exc)
            return
        self._redo = redo

    def _collect(self, lane):
        """Lands a lane's steps in flight and delivers them; False if it had none."""
        landed_any = False
        while self._flight[lane] is not None:
            try:
                landed = self._land(lane)
            finally:
                self.launched.set()         # no launch follows this landing
            if landed is not None:
                self._deliver(*landed)
                landed_any = True
        return landed_any

    def _land(self, lane):
        """Waits for a lane's step in flight and takes what the next step needs of it: each
        sampled token (Sequence.take: the stops a token decides), prompt log probabilities,
        embeddings, the ends of max_tokens 0. Returns (its output, [(sequence, row)] whose
        tokens are to be delivered, the time it landed), or None where it had no step."""
        flight = self._flight[lane]
        if flight is None:
            return None
        self._flight[lane], self._ahead = self._ahead, None     # the step launched after it
        plan, rows = flight
        redo, self._redo = self._redo, set()
        try:
            out = self.lanes[lane].collect()
            self.launched.clear()
        except Exception as exc:
            self.scheduler.released(plan)
            after = self._flight[lane]
            if after is not None:           # it took this step's tokens: it fails with it
                self._flight[lane], self._unchosen = None, None
                self.scheduler.released(after[0])
                plan = plan + after[0]
            self._step_failed(lane, plan, exc)
            return None
        now, self._landed_cpu = time.monotonic(), time.thread_time()
        # a sequence that chose nothing here (_choose_ahead) computes this token again
        self.scheduler.computed([(seq, 0) if seq.seq_id in redo else (seq, n) for seq, n in plan]
                                if redo else plan)
        tokens = out.tokens.tolist()
        taken = []
        for r, (seq, position) in enumerate(rows):
            if seq.finish_reason is not None or seq.seq_id in redo:   # (ended, or chose nothing)
                continue
            try:
                if position is not None:
                    seq.prompt_logprobs.append(_logprob(out, r, seq.params.prompt_logprobs))
                elif seq.params.embed:
                    self.scheduler.remove(seq)
                    self._handles.pop(seq.seq_id)._put(seq.embedded(out.hidden[r]))
                else:
                    if seq.constraint is not None:
                        seq.constraint.advance(tokens[r])   # raises where the runner broke the mask
                    self.scheduler.accept(seq, tokens[r], self.context_limit)
                    taken.append((seq, r))
            except Exception as exc:        # one request's bookkeeping: it alone fails
                self._request_failed(seq, exc)
        for seq, _ in plan:
            if seq.finish_reason is not None:       # ended while its step ran: its token is dropped
                if seq.seq_id not in self.scheduler.in_flight:  # (no later step of it is)
                    self.scheduler.remove(seq)
            elif seq.max_tokens == 0 and seq.num_computed == len(seq.tokens):
                self._handles.pop(seq.seq_id)._put(self.scheduler.end_at_prompt(seq))
        if self._unchosen is not None and self._unchosen[0] is self._flight[lane]:
            self._choose_ahead(lane)
        return out, taken, now

    def _deliver(self, out, taken, now):
        """Each taken token's Output (its text, stop strings, log probabilities) to its
        request. A sequence a stop string ends here leaves at once, or, where its next step is
        in flight, when that step lands."""
        for seq, r in taken:
            handle = self._handles.get(seq.seq_id)
            if handle is None:                  # failed since it was taken
                continue
            try:
                logprob = None
                if seq.params.logprobs is not None:
                    logprob = _logprob(out, r, seq.params.logprobs)
                output = seq.emit(logprob, now)
            except Exception as exc:        # one request's text or stop check: it alone fails
                self._request_failed(seq, exc)
                continue
            if seq.finish_reason is not None:
                del self._handles[seq.seq_id]
                self._retire(seq)
            handle._put(output)

    def _request_failed(self, seq, exc):
        log.error("request %d failed", seq.seq_id, exc_info=exc)
        self._fail_sequences([seq], f"request failed: {type(exc).__name__}: {exc}")

    def _retire(self, seq):
        """An ended sequence leaves the scheduler and frees its blocks, unless a step of it is
        in flight (that step still writes them): it then leaves when the step lands."""
        if seq.seq_id not in self.scheduler.in_flight:
            self.scheduler.remove(seq)

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
        """These sequences' requests end with EngineFailed(message), each once and whole: a
        request's other prompts and choices end with it, wherever they are (waiting, in
        another step). Their blocks are freed (_retire)."""
        failed = {}
        for seq in seqs:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                self._retire(seq)
            else:
                failed[id(handle)] = handle
        for handle in failed.values():
            for seq_id in handle.seq_ids:
                if self._handles.get(seq_id) is not handle:
                    continue                            # ended already
                del self._handles[seq_id]
                seq = self.scheduler.find(seq_id)
                if seq is not None:
                    seq.finish_reason = "error"
                    self._retire(seq)
            handle._put(EngineFailed(message))

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
                _, seqs, handle = item
                if self.error is not None:
                    handle._put(EngineFailed(self.error))
                    continue
                for seq in seqs:
                    if seq.max_tokens == 0 and seq.params.prompt_logprobs is None \
                            and not seq.params.embed:
                        handle._put(seq.end_at_prompt())        # nothing to compute
                        continue
                    self._handles[seq.seq_id] = handle
                    self.scheduler.add(seq)
            else:
                self._abort(item[1])

    def _abort(self, seq_id):
        """A cancelled sequence ends "abort" at once; a step of it in flight is landed first
        (it still writes its blocks), its token dropped."""
        seq = self.scheduler.find(seq_id)
        if seq is None:
            return
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            handle._put(seq.abort())
        if seq_id in self.scheduler.in_flight:
            self._drain()
        self.scheduler.remove(seq)

    def _fail(self, message, exc):
        """The engine can serve no more: every request ends with the error, and on_failure
        is told (the server drains and exits, for a supervisor to restart it)."""
        self.error = message
        log.error("%s", self.error, exc_info=exc)
        for handle in set(self._handles.values()):
            handle._put(EngineFailed(self.error))
        self._handles.clear()
        self.scheduler.clear()
        self._flight = [None] * len(self.lanes)
        self._ahead, self._unchosen, self._redo = None, None, set()
        if self.on_failure is not None:
            self.on_failure()


def _logprob(out, r, k):
    """Row r of a StepOutput as a TokenLogprob with its k best alternatives."""
    top = [(int(i), float(lp)) for i, lp in zip(out.top_ids[r, :k], out.top_logprobs[r, :k])]
    return TokenLogprob(int(out.tokens[r]), float(out.logprobs[r]), top)
