"""A step's run on a device and the choice of its tokens: what every device runner shares.

`StepRunner` runs a step over the hooks its subclass gives (DeviceRunner for one device,
GroupRunner in group.py for a device group): pure decode steps replay a recording of their
bucket's launches, other steps issue them one by one; the device edits the logits in place
where rows have penalties, biases or masks (choice.logit_edits); the step's tokens are the
device's, greedy or drawn (choice.draw: engine/sampling.py's definition, exactly), and only
rows whose edits the device had no room for are read back and sampled on the host.
"""
from collections import deque
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from .batch import StepBatch, StepOutput
from .sampling import edit_row, logprobs_among, sample, sample_row


class GraphKey(NamedTuple):
    """Which recording a pure decode step replays: its bucket (rows, padded), whether it
    splits its attention, edits logits, takes tokens of the step before (StepBatch.feed), and
    the side of host memory its copies read and write (step_inputs.py), whether it chooses its
    tokens (or leaves that to StepRunner.choose) and whether some row draws (choice.draw)."""
    bucket: int
    long: bool
    edited: bool = False
    fed: bool = False
    side: int = 0
    chooses: bool = True
    draws: bool = False


class StepRunner:
    """A step's run, logits and sampling over the hooks a runner gives: _upload, _issue,
    _can_capture, _capture, _replay, _read and _synchronize (DeviceRunner for one device,
    GroupRunner in engine/group.py for a device group)."""
    kernel_times = None
    faults = None               # engine/faults.py: steps made to fail, for tests
    queues = True               # launch() queues the step on the device(s) and returns
    feeds = False               # whether a step may be launched on the last one's greedy
    _side = 0                   # tokens before it lands (StepBatch.feed; DeviceRunner's)
    _draws = False              # whether a row of the step uploaded draws (StepInputs's)

    def run(self, batch, record=True, choose=True):
        """Runs a step on the device, leaving logits (edited) and its tokens there; with
        choose=False, only its logits (unedited), choose() doing the rest later.

        A pure decode step (every token sampled, each sequence at one position) runs as one
        replay of the launches recorded for its bucket, the next power of two of its size; the
        batch is padded to the bucket by repeating its last token, which rewrites the same
        cache slot with the same values. A bucket has a recording with the logits' edits and
        one without, so steps without any launch nothing for them.
        `record=False` issues every launch one by one instead (per-kernel device timing).
        A step whose longest sequence spans more than one attention split runs (and records)
        attention split along the context; shorter ones keep the one-pass kernel.
        """
        T, R = len(batch.tokens), len(batch.sample_tokens)
        long = self._set_long(int(batch.positions.max(initial=0)) + 1)
        faults = self.faults
        if faults is not None:
            faults.begin_step()
        if self.kernel_times is not None:
            self._upload(batch)
            self.device.start_timing()
            self._issue(T, R)
            if faults is not None:
                faults.end_step()
            for name, seconds in self.device.stop_timing():
                total = self.kernel_times.setdefault(name, [0, 0.0])
                total[0] += 1
                total[1] += seconds
            return self._issued(R)
        bucket = 1 << max(T - 1, 0).bit_length()
        if record and T == R and bucket <= self.max_seqs and self._can_capture() and \
                batch.one_position_each():
            pad = bucket - T
            padded = batch if pad == 0 else StepBatch(
                *(np.concatenate([a, np.repeat(a[-1:], pad)]) for a in (
                    batch.tokens, batch.positions, batch.seq_rows)), batch.block_tables,
                np.concatenate([batch.sample_tokens, T - 1 + np.zeros(pad, np.int32)]),
                batch.sampling, batch.window_tables,
                None if batch.feed is None else np.concatenate(
                    [batch.feed, np.repeat(batch.feed[-1:], pad)]))
            self._upload(padded)
            key = GraphKey(bucket, long, self._edit_state()[0], batch.feed is not None,
                           self._side, choose, self._draws)
            graph = self.graphs.get(key)
            if graph is None:
                graph = self.graphs[key] = self._capture(
                    lambda: self._issue(bucket, bucket, choose))
            if faults is not None:
                faults.end_step()
            self._replay(graph)
        else:
            self._upload(batch)
            self._issue(T, R, choose)
            if faults is not None:
                faults.end_step()
        return self._issued(R) if choose else R

    def _issued(self, R):
        """After a step's launches (R: its sampled rows, returned): what a runner marks of it
        (DeviceRunner: the host memory it reads is in use until it is done)."""
        return R

    def recover(self):
        """After a step raised (a launch refused, a driver error, an injected fault): what it
        issued is waited for and nothing of it is held, so the next step starts as any does
        (a capture the error broke was ended where it broke). Raises when the device cannot
        even do that: a sticky driver error (CUDA's illegal address, Vulkan's device lost)
        fails every call after it, so the device is lost."""
        self._launched.clear()
        if self.faults is not None:
            self.faults.recover()
        self._synchronize()

    def logits(self, batch):
        """Runs a step; the logits of its sampled rows as sampling sees them (edited:
        sampling.edit_row), float32 [R, vocab]."""
        logits = self._logits_of(self.run(batch))
        host = self._edit_state()[1]
        if host:
            logits = logits.copy()
            for r in host:
                logits[r] = edit_row(logits[r], batch.sampling, r)
        return logits

    def _logits_of(self, R):
        """The last step's R rows of logits, read back."""
        raw = self._read(self._output_name(), R * self.vocab_size * 4)
        return np.frombuffer(raw, np.float32).reshape(R, self.vocab_size)

    def _logit_rows(self, rows):
        """Rows `rows` of the last step's logits, each read back alone: the rows a step's
        candidates left undecided are few, the rest need not cross to the host."""
        size = self.vocab_size * 4
        return {r: np.frombuffer(self._read(self._output_name(), size, r * size), np.float32)
                for r in rows}

    def step(self, batch):
        """Runs a step and returns its tokens (launch, then collect)."""
        self.launch(batch)
        return self.collect()

    def launch(self, batch, choose=True):
        """Issues a step without waiting for it; collect() returns its tokens. A pipeline's
        lanes (engine/group.py) each have a step in flight this way; where the runner feeds,
        a second step may be launched before the first is collected (collect takes them in
        order). choose=False leaves its choice to choose(), before it is collected."""
        R = self.run(batch, choose=choose)
        self._launched.append((batch, R, self._edit_state()[1], self._launched_mark()))

    def chooses_on_device(self):
        """Whether the device chose every row of the last step launched (none was left to the
        host for edits it had no room for): a step fed its tokens may follow it."""
        return not self._launched or not self._launched[-1][2]

    def choose(self, sampling):
        """The choice of the step launched last with choose=False, once its rows' masks and
        edits are known (SamplingRows: they follow the tokens of the step before, which has
        landed by then): they are uploaded and applied and the rows chosen on the device,
        after the step's launches, so the device runs the step meanwhile."""
        batch, R, _, mark = self._launched[-1]
        self._choose(sampling, R)
        self._launched[-1] = (replace(batch, sampling=sampling), R, self._edit_state()[1], mark)

    def _launched_mark(self):
        """What collect() waits for of the step just run (None: the device, whole)."""
        return None

    def _landing(self, mark):
        """Before collect() reads a step back: waits for it where it has a mark."""

    def collect(self):
        """The tokens of the step launch() issued, once the device has done it: the device's
        (greedy or drawn) read back, and, for rows that report log probabilities, their
        candidates with sums at temperature 1 (_step_with_logprobs). The logits are edited on
        the device (constrained rows too) but for the rows whose edits it had no room for:
        those read their logits back and are edited and sampled on the host."""
        batch, R, host, mark = self._launched.popleft()
        self._landing(mark)
        out = self._tokens(batch.sampling, R)
        rows = batch.sampling
        for r, logits in self._logit_rows(host).items():
            out.tokens[r], out.logprobs[r], out.top_ids[r], out.top_logprobs[r] = \
                sample_row(edit_row(logits, rows, r), rows, r, rows.n_logprobs)
        if rows.hidden is not None:
            size = self.hidden_size * 4
            out.hidden = {int(r): np.frombuffer(self._read(self._hidden_name(), size, r * size),
                                                np.float32)
                          for r in np.flatnonzero(rows.hidden)}
        return out

    def _tokens(self, rows, R):
        """collect()'s StepOutput of the last step's R rows, rows edited on the host aside."""
        if R == 0:
            return _tokens_only(np.zeros(0, np.int32))
        if not self._has_candidates() and (rows.logprobs or rows.n_logprobs):
            return sample(self._logits_of(R), rows)
        tokens = np.frombuffer(self._read("argmax", R * 4), np.int32).copy()
        if rows.forced is not None:
            tokens = np.where(rows.forced[:R] >= 0, rows.forced[:R], tokens).astype(np.int32)
        if rows.logprobs or rows.n_logprobs:
            return self._step_with_logprobs(R, rows, tokens)
        return _tokens_only(tokens)

    def _step_with_logprobs(self, R, rows, tokens):
        """The log probabilities (of the edited logits) of the last step's R rows' `tokens`:
        a row that reports them from its candidates with sums at temperature 1
        (sampling.logprobs_among), or, where its token is no candidate, from its logits read
        back (sampling.sample_row, whose token is the device's: the same definition)."""
        k = rows.n_logprobs
        reports = np.ones(R, bool) if rows.reports is None else np.asarray(rows.reports, bool)
        candidates = self._candidates(R, np.ones(R, np.float32))
        chosen = np.zeros(R, np.float32)
        top, top_lp = np.zeros((R, k), np.int32), np.zeros((R, k), np.float32)
        undecided = []
        for r in np.flatnonzero(reports):
            got = logprobs_among(*(c[r] for c in candidates), self.vocab_size, int(tokens[r]), k)
            if got is None:
                undecided.append(r)
            else:
                chosen[r], top[r], top_lp[r] = got
        for r, logits in self._logit_rows(undecided).items():   # its token is no candidate
            _, chosen[r], top[r], top_lp[r] = sample_row(logits, rows, r, k)
        return StepOutput(tokens=tokens, logprobs=chosen, top_ids=top, top_logprobs=top_lp)

    def _has_candidates(self):
        """Whether the runner leaves its rows' top_candidates on the device (_candidates)."""
        return False

    def _edit_state(self):
        """(whether the uploaded step edits logits on the device, the rows it leaves to the
        host to edit) of the runner that computes the logits (DeviceRunner's; a group asks its
        head's)."""
        raise NotImplementedError


def _tokens_only(tokens):
    """A StepOutput of tokens without log probabilities."""
    R = len(tokens)
    return StepOutput(tokens=tokens, logprobs=np.zeros(R, np.float32),
                      top_ids=np.zeros((R, 0), np.int32),
                      top_logprobs=np.zeros((R, 0), np.float32))
