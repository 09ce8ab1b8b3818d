"""Faults injected into a runner's steps: the seam through which tests and scripts/serve-check
exercise the engine's fault isolation on real devices (`POOT_INJECT_FAULTS` sets it in a
server). Nothing here runs unless a Faults object is attached to a runner (`runner.faults`).

A due step raises InjectedFault part way through its launches (a DeviceRunner's third launch,
while it is issued or captured), before its recorded step is replayed, or before the reference
runner computes it: the device is left as a real failure leaves it. From step `lost_at` on the
device counts as lost: every step fails and so does every attempt to recover from one.
"""


class InjectedFault(RuntimeError):
    """The error an injected fault raises."""


class Faults:
    def __init__(self, every=None, lost_at=None, at_launch=3):
        self.every, self.lost_at, self.at_launch = every, lost_at, at_launch
        self.steps = 0              # steps begun
        self.injected = 0           # steps failed
        self._left = None           # launches the armed step has before it fails

    @classmethod
    def parse(cls, text):
        """'every=N' (fail every N-th step) and/or 'lost=N' (the N-th step loses the device),
        comma-separated, e.g. 'every=200,lost=5000'."""
        fields = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name not in ("every", "lost") or not value.isdigit() or int(value) < 1:
                raise ValueError(f"{item!r}: expected every=N or lost=N (N at least 1)")
            fields[name] = int(value)
        return cls(every=fields.get("every"), lost_at=fields.get("lost"))

    def __str__(self):
        parts = [f"every {self.every}th step fails"] if self.every else []
        if self.lost_at:
            parts.append(f"step {self.lost_at} loses the device")
        return ", ".join(parts) or "none"

    @property
    def lost(self):
        return self.lost_at is not None and self.steps >= self.lost_at

    def begin_step(self):
        """A step begins: it is armed to fail when due."""
        self.steps += 1
        due = self.lost or (self.every is not None and self.steps % self.every == 0)
        self._left = self.at_launch if due else None

    def launch(self):
        """Before each launch of the step: the armed step fails at its at_launch-th."""
        if self._left is not None:
            self._left -= 1
            if self._left <= 0:
                self._fail()

    def end_step(self):
        """After the step is issued (or before its replay, or its reference run): an armed
        step that has not failed yet fails here."""
        if self._left is not None:
            self._fail()

    def recover(self):
        """Recovering from a failed step: impossible once the device is lost."""
        if self.lost:
            raise InjectedFault(f"injected: the device was lost at step {self.lost_at}")

    def _fail(self):
        self._left = None
        self.injected += 1
        raise InjectedFault(f"injected fault in step {self.steps}"
                            + (" (the device is lost)" if self.lost else ""))
