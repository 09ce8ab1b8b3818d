"""One model over a device group (`--placement pipeline:...` / `tensor:...`, ptx only).

Each device runs a DeviceRunner on its Part of the model (engine/placement.py): the runners
lower, plan and allocate exactly as on one device, so every device's footprint is its own
runner's allocation list. A GroupRunner steps them together:

- tensor: every rank issues its launches up to its next all_reduce or all_gather
  (DeviceRunner.launches stops there), then a barrier orders the group (each device's event
  recorded, every other device's stream waiting on it), then each rank sums the partials
  straight out of the others' memory. The partials sit in two buffers used in turn, so one
  barrier per reduction is enough: a rank refills a buffer only after the next barrier, which
  every rank passes only after its reduction from that buffer. From three devices on, long
  messages reduce in two phases (each rank sums its slice; after a second barrier it copies the
  others' slices). Each rank computes the logits of its rows of the output head (the vocabulary)
  into a buffer of its own; after one more barrier rank 0 copies every rank's slice into its
  columns of the logits (an all_gather) and samples. A rank rewrites its slice only after the
  next step's first barrier, which it passes only after rank 0 has done that copy, so one buffer
  is enough. (A tied head, the embedding table, stays whole on rank 0: engine/placement.py.)
- pipeline: stage s+1 waits on stage s's event, pulls its activations with a peer copy, and
  runs its layers. A decode step is cut into micro-batches (token ranges, run as views from
  their first row), issued micro-batch by micro-batch, so stage 0 works on the second while
  stage 1 works on the first; a micro-batch is never so short that its matmuls would lose the
  tensor-core kernel the whole step gets. The last stage computes the logits.

A decode step over the group is one CUDA graph (PtxGroup.capture) replayed as one launch; the
host never waits between layers or devices.
"""
import math

from ..errors import PlacementRefused
from ..formats.quants import QUANTS
from . import placement
from .device_runner import DeviceRunner, StepRunner


def parts(model, kind, world, num_blocks, block_size):
    """The Part of each device of a `kind` group of `world` devices."""
    cfg = model.config
    shapes = model.weight_shapes()
    if kind == "tensor":
        return placement.tensor_parts(cfg, shapes, world)

    def nbytes(name):
        shape, dtype = shapes[name]
        return QUANTS[dtype].nbytes(math.prod(shape))

    layer = sum(nbytes(name) for name in shapes if name.startswith("blk.0."))
    kv = 2 * num_blocks * block_size * cfg.n_kv_heads * cfg.head_dim * 2       # f16 K and V
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    return placement.pipeline_parts(cfg, world, layer + kv, nbytes("token_embd.weight"),
                                    nbytes("output_norm.weight") + nbytes(head))


class GroupRunner(StepRunner):
    backend = "ptx"

    def __init__(self, model, group, kind, num_blocks, block_size=16, max_tokens=256,
                 max_seqs=16, micro_batches=None, check=True):
        """check=False: for a plan's candidate (DeviceRunner's check)."""
        if kind not in ("pipeline", "tensor"):
            raise ValueError(f"placement {kind!r}")
        self.model, self.group, self.placement = model, group, kind
        self.parts = parts(model, kind, len(group.devices), num_blocks, block_size)
        self.runners = [DeviceRunner(model, device, num_blocks, block_size, max_tokens,
                                     max_seqs, part, check=check)
                        for device, part in zip(group.devices, self.parts)]
        if kind == "tensor":
            for runner in self.runners:
                runner.peers = self.runners
                if len(self.runners) < 3:       # two phases read no less from one peer
                    runner.two_phase_floats = math.inf
        self.head = next(r for r in self.runners if r.has_logits)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.vocab_size = model.config.vocab_size
        self.max_context = self.runners[0].max_context
        self.micro_batches = micro_batches or 2 * len(self.runners)
        self.graphs = {}

    def allocate(self):
        for runner in self.runners:
            runner.allocate()

    def upload(self):
        for runner in self.runners:
            runner.upload()

    def time_kernels(self):
        raise PlacementRefused("--device-timing is refused over a device group")

    # -- StepRunner's hooks ----------------------------------------------------------------------
    def _upload(self, batch):
        for runner in self.runners:
            runner._upload(batch)

    def _issue(self, T, R):
        if self.placement == "tensor":
            self._issue_tensor(T, R)
        else:
            self._issue_pipeline(T, R)

    def _issue_tensor(self, T, R):
        runs = [runner.launches(T, R) for runner in self.runners]
        while True:
            reached = [next(run, None) for run in runs]
            if all(op is None for op in reached):
                return
            if any(op is None for op in reached):
                raise RuntimeError("the ranks' graphs reach different numbers of all_reduce "
                                   "and all_gather ops")
            self.group.barrier()

    def _issue_pipeline(self, T, R):
        """Micro-batches (decode steps only: there rows are tokens) through the stages, each
        long enough to keep the matmul kernel a step of its size would get (decode_piece)."""
        pieces = min(self.micro_batches, T // self.runners[0].decode_piece()) if T == R else 1
        spans = placement.even(T, pieces) if pieces > 1 else [(0, T)]
        width = self.model.config.d_model * 4
        last = len(self.runners) - 1
        try:
            for t0, t1 in spans:
                r0, r1 = (t0, t1) if pieces > 1 else (0, R)
                for s, runner in enumerate(self.runners):
                    runner._offsets, runner._step_tokens = (t0, r0), T
                    if s > 0:
                        before = self.runners[s - 1]
                        self.group.wait(s, s - 1)
                        self.group.copy(s, runner._buffer(runner.graph.inputs["hidden"]), s - 1,
                                        before._buffer(before.graph.outputs["hidden"]),
                                        (t1 - t0) * width)
                    runner._issue(t1 - t0, r1 - r0)
                    if s < last:
                        self.group.signal(s)
        finally:
            for runner in self.runners:
                runner._offsets, runner._step_tokens = (0, 0), None

    def _set_long(self, length):
        return all([runner._set_long(length) for runner in self.runners])

    def _can_capture(self):
        return hasattr(self.group, "capture")

    def _capture(self, issue):
        return self.group.capture(issue)

    def _replay(self, graph):
        self.group.replay(graph)

    def _read(self, name, nbytes):
        return self.head._read(name, nbytes)

    def _output_name(self):
        return self.head._output_name()
