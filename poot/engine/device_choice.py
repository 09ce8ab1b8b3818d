"""The device's part in choosing a step's tokens (DeviceRunner's): the logits' edits and masks
uploaded and applied in place after the output head (choice.logit_edits), the greedy choice of
every row (choice.argmax_chunks, then argmax), the draw of the rows that sample (choice.draw,
which overwrites their greedy tokens) and, for rows that report log probabilities, each row's
candidates (choice.top_candidates) read back for step_runner.py to score the tokens with.
"""
import numpy as np

from ..kernels import choice
from .kernel_choice import ARGMAX_CHUNKS

# A step's logit edits the device holds (SamplingRows.edits): this many a row, the rows' room
# pooled, so one row may take several rows' share; a step's rows past it are edited on the host
EDITS_PER_ROW = 4096
EDIT_TOKENS = 8192      # a row's tokens one logit_edits workgroup masks


class DeviceChoice:
    """DeviceRunner's methods that edit the logits and read the device's choice of tokens."""

    def _mask_words(self):
        return -(-self.vocab_size // 32)

    def _upload_edits(self, rows):
        """The step's logit edits and masks (SamplingRows.edits and masks) into the edit_
        buffers, which logit_edits applies after the output head: each row's, in row order,
        while the room for edits (EDITS_PER_ROW a row, pooled) lasts. A row whose edits do not
        fit has nothing applied on the device, its mask neither: collect() reads its logits
        back and edits them on the host (_host_edits)."""
        self._edited, self._host_edits = False, []
        if not self.has_logits or (rows.edits is None and rows.masked is None):
            return
        R, edits = len(rows.temperature), rows.edits
        starts = np.zeros(self.max_seqs + 1, np.int32)
        mask_of = np.full(self.max_seqs, -1, np.int32)
        parts, masked, room = [], [], self.max_seqs * EDITS_PER_ROW
        for r in range(R):
            count = 0 if edits is None else edits.count(r)
            starts[r + 1] = starts[r]
            if count > room:
                self._host_edits.append(r)
                continue
            if count:
                parts.append(edits.row(r))
                starts[r + 1] += count
                room -= count
            if rows.masked is not None and rows.masked[r]:
                mask_of[r] = len(masked)
                masked.append(r)
        starts[R + 1:] = starts[R]
        dev, B = self.device, self.buffers
        dev.write(B["edit_starts"], starts)
        dev.write(B["edit_mask_of"], mask_of)
        for i, name in enumerate(("edit_tokens", "edit_repeat", "edit_add")):
            if parts:
                dev.write(B[name], np.concatenate([part[i] for part in parts]))
        if masked:
            words = min(self._mask_words(), rows.masks.shape[1])
            masks = np.zeros((len(masked), self._mask_words()), np.uint32)
            masks[:, :words] = rows.masks[masked, :words]    # words past a mask: none allowed
            dev.write(B["edit_masks"], masks)
        self._edited = bool(parts or masked)

    def _choose(self, rows, R):
        """StepRunner.choose: the step's edits uploaded and applied, its greedy choice made,
        in stream order after its launches; its side's mark after them."""
        self._upload_edits(rows)
        self._edit(R)
        self._greedy(R)
        self._issued(R)

    def _edit(self, R):
        """The step's logit edits (_upload_edits), in place, before anything reads the logits:
        launched only in steps that have some (StepRunner.run records those apart)."""
        if not (self._edited and R):
            return
        B = self.buffers
        parts = -(-self.vocab_size // EDIT_TOKENS)
        self._launch(choice.logit_edits(), (R, parts), self._buffer(self.graph.outputs["logits"]),
                     B["edit_starts"], B["edit_tokens"], B["edit_repeat"], B["edit_add"],
                     B["edit_mask_of"], B["edit_masks"], self.vocab_size, self._mask_words())

    def _greedy(self, R):
        """Every row's token: the greedy choice of each, then the draw of those that sample
        (where the step has any: StepInputs._draws), so a step reads back tokens, not logits."""
        if not (self.has_logits and R):
            return
        sg, chunks, B = self.device.subgroup_size, ARGMAX_CHUNKS, self.buffers
        values, indices = B["argmax_values"], B["argmax_indices"]
        logits = self._buffer(self.graph.outputs["logits"])
        self._launch(choice.argmax_chunks(sg), (R, chunks), logits, values, indices,
                     self.vocab_size, -(-self.vocab_size // chunks))
        self._launch(choice.argmax(sg), (R,), values, indices, B["argmax"], chunks)
        if self._draws:
            self._launch(choice.draw(sg), (R,), logits, B["draw_rows"], B["exp2"], B["argmax"],
                         self.vocab_size)
        if self._staged():
            self.device.download(self._host["argmax"], self.buffers["argmax"], R * 4)

    def _has_candidates(self):
        return self.has_logits

    def _edit_state(self):
        return self._edited, self._host_edits

    def _candidate_chunks(self):
        return -(-self.vocab_size // choice.TOP_CHUNK)

    def _candidates(self, R, temperature):
        """(values, ids [R, chunks, TOP_KEEP], maxima, sums [R, chunks]) of the last step's R
        rows of logits, from a launch of top_candidates after the step (sums at each row's
        temperature)."""
        chunks, B = self._candidate_chunks(), self.buffers
        self.device.write(B["top_temperature"], np.ascontiguousarray(temperature[:R], np.float32))
        self._launch(choice.top_candidates(self.device.subgroup_size), (R, chunks),
                     B[self._output_name()], B["top_temperature"], B["top_values"],
                     B["top_indices"], B["top_maxima"], B["top_sums"], self.vocab_size)
        out = []
        for name, dtype, width in (("top_values", np.float32, choice.TOP_KEEP),
                                   ("top_indices", np.int32, choice.TOP_KEEP),
                                   ("top_maxima", np.float32, 1), ("top_sums", np.float32, 1)):
            raw = self.device.read(B[name], R * chunks * width * 4)
            array = np.frombuffer(raw, dtype).reshape(R, chunks, width)
            out.append(array[..., 0] if width == 1 else array)
        return out
