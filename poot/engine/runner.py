"""The reference runner: the model's step graph interpreted in numpy, behind the runner interface.

A runner turns a StepBatch into a StepOutput (batch.py) and owns the paged KV cache of
`num_blocks` blocks of `block_size` tokens; which blocks belong to which sequence is the
scheduler's business. Device runners implement the same interface.
"""
import numpy as np

from ..ir.reference import ReferenceInterpreter
from .sampling import edit_logits, sample


class ReferenceRunner:
    backend = "reference"
    queues = False              # launch() computes the step (StepRunner's queue it)
    faults = None               # engine/faults.py: steps made to fail, for tests
    _launched = None            # the StepOutput of the step launch() computed

    def __init__(self, model, num_blocks, block_size=16, ring=None):
        """`ring` (kvcache.Ring): the window layers' cache, of its own blocks."""
        self.model = model
        self.block_size, self.num_blocks, self.ring = block_size, num_blocks, ring
        self.vocab_size = model.config.vocab_size
        self.max_context = model.context_length
        self.graph = model.step_graph(num_blocks, block_size,
                                      ring_blocks=ring.num_blocks if ring else 0)
        state = {name: np.zeros(t.shape, np.float32) for name, t in self.graph.state.items()}
        self.interpreter = ReferenceInterpreter(
            self.graph, lambda name: self.graph.read(name, model.weight_array), state)

    def logits(self, batch):
        """Runs the step and returns the logits of the sampled rows as sampling sees them
        (sampling.edit_logits: their edits and masks applied), float32 [R, vocab]."""
        return edit_logits(self._run(batch)["logits"], batch.sampling)

    def _run(self, batch):
        """The step graph's outputs for a batch, as computed."""
        if batch.positions.size and int(batch.positions.max()) >= self.num_blocks * self.block_size:
            raise ValueError("a position lies beyond the KV cache")
        inputs = {"tokens": batch.tokens, "positions": batch.positions,
                  "seq_rows": batch.seq_rows, "block_tables": batch.block_tables,
                  "sample_tokens": batch.sample_tokens}
        if "window_tables" in self.graph.inputs:
            inputs["window_tables"] = batch.window_tables
        return self.interpreter.run(inputs)

    def step(self, batch):
        if self.faults is not None:
            self.faults.begin_step()
            self.faults.end_step()
        values = self._run(batch)
        out = sample(edit_logits(values["logits"], batch.sampling), batch.sampling)
        if batch.sampling.hidden is not None:
            out.hidden = {int(r): np.asarray(values["last_hidden"][r], np.float32)
                          for r in np.flatnonzero(batch.sampling.hidden)}
        return out

    def launch(self, batch):
        """Computes a step (numpy runs it at once); collect() gives its tokens, as a device
        runner's (step_runner.py) launch and collect do."""
        self._launched = self.step(batch)

    def collect(self):
        out, self._launched = self._launched, None
        return out

    def recover(self):
        """After a step raised: the host holds nothing of it (see StepRunner.recover)."""
        self._launched = None
        if self.faults is not None:
            self.faults.recover()
