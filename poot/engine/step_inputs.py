"""How a DeviceRunner's step inputs reach the device and its tokens come back.

Unstaged, a step writes each input and reads the tokens back itself. Staged (the device's
`step_staging`: ptx, a discrete GPU's vulkan), they go through host memory of the device's
(host_array), copied by the step's own recorded launches: one side of it, or two from the first
step launched ahead (StepBatch.feed), which writes the side the step in flight does not read;
a side is written again once the step that last read it is done (its mark).
"""
from dataclasses import dataclass

import numpy as np

from ..kernels.choice import DRAW_WORDS, FLAGS
from .batch import TABLES
from .sampling import draw_rows


@dataclass
class Side:
    """A staged runner's host_array memory for one step in flight: its inputs (one array,
    `host` views of it by name, and the tokens' own), the columns each table row may
    hold there, and the mark of the last step launched from it (None: waited for)."""
    inputs: np.ndarray
    host: dict
    written: dict
    mark: object = None


class StepInputs:
    """DeviceRunner's methods that write a step's inputs and read its tokens."""

    def _allocate_inputs(self):
        """Staged: the views of the packed `inputs` buffer, and the first side."""
        if not self._staged():
            return
        words = self._inputs_layout()
        if self._packed():
            at = 0
            for name, n in words.items():
                self.buffers[name] = self.device.view(self.buffers["inputs"], at * 4)
                at += n
        self._sides = [self._side_arrays(words)]
        self._use_side(0)

    def _side_arrays(self, words):
        """A side's host_array memory: the step inputs (`words` of each, in one array) and
        the tokens read back."""
        inputs = self.device.host_array(sum(words.values()) * 4).view(np.int32)
        inputs[:] = 0
        host, at = {}, 0
        for name, n in words.items():
            host[name] = inputs[at:at + n]
            at += n
        host["argmax"] = self.device.host_array(self.max_seqs * 4).view(np.int32)
        written = {name: np.zeros(self.max_seqs, np.int64) for name in self._table_inputs}
        return Side(inputs, host, written)

    def _use_side(self, i):
        """The side the next step's inputs are written to, once the last step that read it
        has been waited for."""
        side = self._sides[i]
        if side.mark is not None:
            self.device.wait_mark(side.mark)
            side.mark = None
        self._side = i
        self._host_inputs, self._host, self._tables_written = side.inputs, side.host, side.written

    @property
    def feeds(self):
        """Whether a step may be launched before the last one is collected, taking its greedy
        tokens on the device (StepBatch.feed): where steps are staged and the device waits
        for one step at a time (marks), on a runner of one whole model (not a group's), its
        steps not timed kernel by kernel."""
        return (self._staged() and "marks" in self.device.features and self.has_logits
                and self.base is None and self.part is None and self.kernel_times is None)

    def _inputs_layout(self):
        """{step input: int32 words}, in the order of the `inputs` buffer (staged): the block
        tables last, so a step copies only the rows it has (the window layers' tables, where
        they have a ring, just before them)."""
        return {"tokens": self.max_tokens, "positions": self.max_tokens,
                "seq_rows": self.max_tokens, "sample_tokens": self.max_seqs,
                **({"feed": self.max_tokens} if self.feeds else {}),
                **({"draw_rows": self.max_seqs * DRAW_WORDS} if self.has_logits else {}),
                **{name: self.max_seqs * self.table_width for name in self._table_inputs}}

    def _staged(self):
        """Whether a step's inputs and tokens go through host memory of the device's
        (host_array: page-locked on ptx, a host-visible buffer on a discrete GPU's vulkan),
        copied by the step itself, recorded with its launches: no writes or reads of their own.
        The device says where (step_staging): that memory is not the device's, which the plan
        sizes."""
        return getattr(self.device, "step_staging", False)

    def _packed(self):
        """Staged, the inputs are one buffer (views of it, one copy a step) where the device
        has views of buffers (ptx); else a copy each."""
        return self._staged() and "views" in self.device.features

    def _upload_inputs(self, batch):
        """A step's inputs into their buffers (or, staged, into the side it writes)."""
        T = len(batch.tokens)
        dev, staged = self.device, self._staged()
        if batch.feed is not None and not self.feeds:
            raise ValueError(f"{self.backend}: this runner launches no step on the last "
                             "one's tokens")
        self._fed = batch.feed is not None
        if self._fed and len(self._sides) == 1:     # the step in flight reads this side
            self._sides.append(self._side_arrays(self._inputs_layout()))
        if len(self._sides) > 1:        # the other side: no step in flight reads it
            self._use_side(1 - self._side)
        elif staged and not self._idle:     # the last step's copies read this memory: done first
            dev.synchronize()
        self._idle = False
        if self._fed:
            self._host["feed"][:T] = batch.feed
        draws = draw_rows(batch.sampling, self.max_seqs) if self.has_logits else None
        self._draws = draws is not None and bool(draws[:, FLAGS].any())
        if self._draws:
            if staged:
                self._host["draw_rows"][:] = draws.view(np.int32).ravel()
            else:
                dev.write(self.buffers["draw_rows"], draws)
        for name in ("tokens", "positions", "seq_rows", "sample_tokens"):
            values = np.ascontiguousarray(getattr(batch, name), np.int32)
            if staged:
                self._host[name][:len(values)] = values
            else:
                dev.write(self.buffers[name], values)
        for name in self._table_inputs:
            given, (n, width) = getattr(batch, name), getattr(batch, name).shape
            if not staged:
                tables = np.zeros((self.max_seqs, self.table_width), np.int32)
                tables[:n, :width] = given
                dev.write(self.buffers[name], tables)
                continue
            # the staged tables keep what earlier steps wrote: only the columns some step may
            # have written past this one's width are cleared, not a whole context's
            tables = self._host[name].reshape(self.max_seqs, self.table_width)
            tables[:n, :width] = given
            written = self._tables_written[name]
            for r in np.flatnonzero(written[:n] > width):
                tables[r, width:written[r]] = 0
            written[:n] = width

    def _stage_inputs(self, T):
        """Staged: the step's inputs copied from host memory, up to the block tables of as
        many sequences as the step has tokens."""
        if not self._staged():
            return
        rows = min(T, self.max_seqs)
        if self._packed():
            words = len(self._host_inputs) - (self.max_seqs - rows) * self.table_width
            self.device.write(self.buffers["inputs"], self._host_inputs[:words])
            return
        for name, host in self._host.items():
            if name != "argmax" and (name != "feed" or self._fed):
                words = rows * self.table_width if name in TABLES else None
                self.device.write(self.buffers[name], host[:words])

    def _synchronize(self):
        self.device.synchronize()
        self._idle = True
        for side in self._sides:        # done with the rest: their marks are spent
            if side.mark is not None:
                self.device.wait_mark(side.mark)
                side.mark = None

    def _issued(self, R):
        """Two sides: the mark of the step just issued, kept by its side until waited for (by
        collect, or by the step after next, which writes that side again)."""
        if len(self._sides) > 1:
            self._sides[self._side].mark = self.device.mark()
        return R

    def _launched_mark(self):
        return self._side if self._sides else None

    def _landing(self, mark):
        """Staged: the collected step's side (`mark`) is read back once the step is done:
        waited for by its mark; with none (issued while there was one side), by _read as it
        reads, unless a later step writes another side by now (the second's first)."""
        side = None if mark is None else self._sides[mark]
        self._reading = None
        if side is not None and side.mark is not None:
            self.device.wait_mark(side.mark)
            side.mark = None
            self._reading = side.host
        elif side is not None and mark != self._side:
            self._synchronize()
            self._reading = side.host

    def _read(self, name, nbytes, offset=0):
        """Bytes of a buffer of the runner that computes the logits."""
        if name in self._host:                  # staged: the step copied them out
            host = self._reading
            if host is None:
                self.device.synchronize()
                self._idle, host = True, self._host
            return host[name][offset // 4:(offset + nbytes) // 4].tobytes()
        return self.device.read(self.buffers[name], nbytes, offset)
