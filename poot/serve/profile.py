"""A sampling profiler of the server's threads (`poot-serve --profile PATH`).

Every few milliseconds a thread of its own reads every other thread's stack
(`sys._current_frames`), and at exit PATH gets, per kind of thread (the engine, the HTTP
handlers, ...), the functions its samples fell in: in the function itself and anywhere below
it. Nothing traces calls, so the threads run at their own speed; it answers where the time of a
serving server goes (between the device's steps, in the handlers, waiting), not how long one
call takes.
"""
import os
import re
import sys
import threading
import time
from collections import Counter

INTERVAL_S = 0.005
SHOWN = 30              # functions listed per thread kind, each way


class StackSampler:
    def __init__(self, path, interval=INTERVAL_S):
        self.path, self.interval = path, interval
        self.own = Counter()                    # (thread kind, function): samples it was in
        self.below = Counter()                  # (thread kind, function): samples under it
        self.samples = Counter()                # thread kind: samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poot-profile", daemon=True)
        self.started = time.monotonic()

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self):
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            kind = thread_kind(names.get(ident, "unknown"))
            self.samples[kind] += 1
            self.own[kind, where(frame)] += 1
            seen = set()
            while frame is not None:
                seen.add(where(frame))
                frame = frame.f_back
            for function in seen:
                self.below[kind, function] += 1

    def stop(self):
        """Stops sampling and writes the report."""
        self._stop.set()
        self._thread.join()
        with open(self.path, "w") as out:
            out.write(self.report())

    def report(self):
        seconds = time.monotonic() - self.started
        lines = [f"# poot-serve --profile: {seconds:.1f} s, a sample every "
                 f"{self.interval * 1e3:g} ms of each thread"]
        for kind, total in self.samples.most_common():
            lines.append(f"\n## {kind}: {total} samples")
            for title, counts in (("in the function itself", self.own),
                                  ("in the function or below it", self.below)):
                lines.append(f"{title}:")
                mine = sorted(((n, f) for (k, f), n in counts.items() if k == kind),
                              reverse=True)[:SHOWN]
                lines += [f"  {100 * n / total:5.1f}%  {f}" for n, f in mine]
        return "\n".join(lines) + "\n"


def thread_kind(name):
    """Threads of one kind share a name but for their numbers ('Thread-7 (process_request_
    thread)'): one kind, one section."""
    return re.sub(r"\d+", "N", name)


def where(frame):
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
