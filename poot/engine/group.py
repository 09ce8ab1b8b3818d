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
  runs its layers; the last stage computes the logits. One step at a time would leave every
  device but one idle, so a pipeline has lanes, one per stage: each lane is the same stages on
  the same weights and KV cache, with arenas, step inputs, a stream per device and recorded
  steps of their own (DeviceRunner.lane, PtxGroup.lane). The engine splits the sequences
  between the lanes and keeps a step of each in flight (StepRunner.launch / collect,
  engine/engine.py): while stage 1 runs lane A's step, stage 0 runs lane B's.

A step over the group is one CUDA graph (PtxGroup.capture) replayed as one launch; the host
never waits between layers or devices.
"""
import copy
import math
from collections import deque

from ..errors import PlacementRefused
from ..formats.quants import QUANTS
from . import placement
from .device_runner import DeviceRunner
from .step_runner import StepRunner


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


class DeviceShare:
    """The runners one device holds over a group's lanes, as the plan counts them: the first
    lane's whole allocation list, the others' arenas."""

    def __init__(self, runners):
        self.runners, self.device = runners, runners[0].device

    def allocations(self):
        return [a for runner in self.runners for a in runner.allocations()]


class GroupRunner(StepRunner):
    backend = "ptx"

    def __init__(self, model, group, kind, num_blocks, block_size=16, max_tokens=256,
                 max_seqs=16, check=True, lanes=None, context=None, ring=None):
        """check=False: for a plan's candidate (DeviceRunner's check). lanes: steps a pipeline
        keeps in flight at once (one per stage unless given; a tensor group has one)."""
        if kind not in ("pipeline", "tensor"):
            raise ValueError(f"placement {kind!r}")
        self.model, self.group, self.placement = model, group, kind
        self.parts = parts(model, kind, len(group.devices), num_blocks, block_size)
        self.runners = [DeviceRunner(model, device, num_blocks, block_size, max_tokens,
                                     max_seqs, part, check=check, context=context, ring=ring)
                        for device, part in zip(group.devices, self.parts)]
        if kind == "tensor":
            for runner in self.runners:
                runner.peers = self.runners
                if len(self.runners) < 3:       # two phases read no less from one peer
                    runner.two_phase_floats = math.inf
        self.head = next(r for r in self.runners if r.has_logits)
        self.block_size, self.num_blocks, self.ring = block_size, num_blocks, ring
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.vocab_size = model.config.vocab_size
        self.max_context = self.runners[0].max_context
        if lanes is None:
            lanes = len(self.runners) if kind == "pipeline" else 1
        if lanes > 1 and kind != "pipeline":
            raise ValueError("lanes are a pipeline's")
        self.graphs, self._launched = {}, deque()
        self.lanes = [self] + [self._lane() for _ in range(lanes - 1)]

    def _lane(self):
        """A pipeline lane: this runner's stages on the same weights and KV cache, with arenas,
        step inputs and recorded steps of their own."""
        lane = copy.copy(self)
        lane.runners = [runner.lane() for runner in self.runners]
        lane.head = lane.runners[self.runners.index(self.head)]
        lane.graphs, lane._launched = {}, deque()
        return lane

    def shares(self):
        """Per device, what the plan counts on it: its runner in every lane."""
        return [DeviceShare([lane.runners[i] for lane in self.lanes])
                for i in range(len(self.runners))]

    def allocate(self):
        """Allocates every lane's buffers: the first lane's all of them, each other lane's its
        arenas on a stream of its own (PtxGroup.lane: its steps run beside the others')."""
        for lane in self.lanes:
            if lane is not self and "lanes" in self.group.features:
                lane.group = self.group.lane()
                for runner, device in zip(lane.runners, lane.group.devices):
                    runner.device = device
            for runner in lane.runners:
                runner.allocate()

    def upload(self):
        for lane in self.lanes:
            for runner in lane.runners:
                runner.upload()

    def time_kernels(self):
        raise PlacementRefused("--device-timing is refused over a device group")

    # -- StepRunner's hooks ----------------------------------------------------------------------
    def _upload(self, batch):
        for runner in self.runners:
            runner._upload(batch)

    def _issue(self, T, R, choose=True):
        if self.placement == "tensor":
            self._issue_tensor(T, R, choose)
        else:
            self._issue_pipeline(T, R, choose)

    def _issue_tensor(self, T, R, choose):
        runs = [runner.launches(T, R, choose) for runner in self.runners]
        while True:
            reached = [next(run, None) for run in runs]
            if all(op is None for op in reached):
                return
            if any(op is None for op in reached):
                raise RuntimeError("the ranks' graphs reach different numbers of all_reduce "
                                   "and all_gather ops")
            self.group.barrier()

    def _issue_pipeline(self, T, R, choose):
        """The stages in turn: each after the last one's event, with its activations pulled
        by a peer copy; the last computes the logits."""
        width = self.model.config.d_model * 4
        for s, runner in enumerate(self.runners):
            if s > 0:
                before = self.runners[s - 1]
                self.group.wait(s, s - 1)
                self.group.copy(s, runner._buffer(runner.graph.inputs["hidden"]), s - 1,
                                before._buffer(before.graph.outputs["hidden"]), T * width)
            runner._issue(T, R, choose)
            if s < len(self.runners) - 1:
                self.group.signal(s)

    def _set_long(self, length):
        return all([runner._set_long(length) for runner in self.runners])

    def _can_capture(self):
        return "capture" in self.group.features

    def _capture(self, issue):
        return self.group.capture(issue)

    def _replay(self, graph):
        self.group.replay(graph)

    def _synchronize(self):
        self.group.synchronize()

    def _read(self, name, nbytes, offset=0):
        return self.head._read(name, nbytes, offset)

    def _output_name(self):
        return self.head._output_name()

    def _hidden_name(self):
        return self.head._hidden_name()

    @property
    def hidden_size(self):
        return self.head.hidden_size

    @property
    def _draws(self):
        return self.head._draws

    def _edit_state(self):
        return self.head._edit_state()
