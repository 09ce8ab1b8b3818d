"""The step graph lowered to launch steps: which ops fuse into one kernel, which weights are
stacked, and which arena slot each value lives in. Pure functions of the graph (and of whether
the device runs the tensor-core matmul): no device, no kernel choice, no buffers; the runner
(device_runner.py) issues what comes out, kernel_choice.py says which kernel runs each step.
A step is the graph's own Op where nothing fuses, an Op of a fused kind (rope_store_kv, an
all_reduce with its residual), or a Matvec: a matmul with the work fused into it.
"""
from collections import Counter
from dataclasses import dataclass

from ..ir.graph import Op, Tensor

SHARES_INPUT = ("reshape", "rope", "rope_store_kv")   # run in place


@dataclass(frozen=True)
class Matvec:
    """One matmul launch (kernels/matmul.py) with the work fused into it: the RMSNorm of its
    input (`norm`, the norm's weight), a residual add, several weights stacked row-wise into one
    (`weight` then names a stacked weight, and each part has its own output), or gate and up
    projections with the gated unit of the two (`weight` is gate's, `up` is up's, `glu` the
    unit's activation)."""
    x: object
    weight: object
    outputs: tuple
    norm: object = None
    eps: float = 0.0
    residual: object = None
    up: object = None
    glu: str = None
    kind = "matmul"

    @property
    def inputs(self):
        return tuple(t for t in (self.x, self.norm, self.residual, self.weight, self.up)
                     if t is not None)

    @property
    def variant(self):
        """The matvec kernel's keyword arguments."""
        return dict(residual=self.residual is not None, norm=self.norm is not None,
                    outputs=len(self.outputs), glu=self.glu)


@dataclass(frozen=True)
class ExpertMatvec:
    """One expert_matvec launch (kernels/experts.py): each route's product with its chosen
    expert's matrix (`weight` [experts, rows, cols]; `ids` the router's choice), or gate and up
    with the gated unit of the two (`up`, `glu`), and the RMSNorm of its input (`norm`), as
    Matvec's."""
    x: object
    weight: object
    ids: object
    outputs: tuple
    up: object = None
    glu: str = None
    norm: object = None
    eps: float = 0.0
    kind = "expert_matmul"

    @property
    def inputs(self):
        return tuple(t for t in (self.x, self.norm, self.weight, self.up, self.ids)
                     if t is not None)


@dataclass(frozen=True)
class Route:
    """A router's top_k and the route_weights of its choice, one launch (kernels/experts.py:
    route), in top_k's place: outputs (ids, weights)."""
    logits: object
    outputs: tuple
    used: int
    normalize: bool
    kind = "route"

    @property
    def inputs(self):
        return (self.logits,)


def shared_buffers(graph):
    """What a tensor group reads from each other's memory lives in buffers of its own, not
    in the arenas: the partial sums of the all_reduces in two buffers used in turn, each
    all_gather's slice in one (group.py's barriers make both safe). {value's name: (buffer
    name, value)}."""
    out, seen = {}, Counter()
    for op in graph.ops:
        x = op.inputs[0]
        if op.kind == "all_reduce":
            out[x.name] = (f"reduce.{seen[op.kind] % 2}", x)
        elif op.kind == "all_gather":
            out[x.name] = (f"gather.{seen[op.kind]}", x)
        seen[op.kind] += 1
    return out


def lower(graph, stack_glu=False):
    """The graph's ops as launch steps, fusing ops into one kernel where what passes
    between them is used only there:
    - an rms_norm read only by matmuls (and expert_matmuls) is folded into each of them;
    - a glu (gated unit) of two matmuls of one input becomes one matmul over both weights;
    - an add whose input is a matmul used only there (a residual add) becomes the matmul's
      epilogue;
    - the other matmuls of one input whose weights share a dtype (q, k, v) become one
      over their weights stacked row-wise (returned by name: (stacked weight, parts)),
      each part's rows written to its own output, so q, k and v stay separate values;
    - the ropes of q and k and the store_kv of k become one kernel, where q goes on only
      to the attention that reads that cache;
    - a route_weights of a top_k's choice over the same logits becomes one Route with it; a
      glu of two expert_matmuls of one input and routing one ExpertMatvec over both (the
      others are one each), and an add of an expert_sum used only there the sum's epilogue;
    - an add of an all_reduce's sum (a tensor group's) becomes the reduction's epilogue, and
      an add of an rms_norm used only there (Gemma's norms after attention and the
      feed-forward) the norm's.
    With stack_glu (a device that runs the tensor-core matmul) a gated unit's gate and up
    weights are stacked too, so that mma_tiled reads them in one launch (twice the rows, a
    wave of workgroups where each alone would split); the matvecs read each part.
    A fused step takes the place of its first op. (A unit formed as the down projection
    reads it was measured slower: every row recomputes it.)"""
    ops_ = graph.ops
    uses = Counter(t.name for op in ops_ for t in op.inputs)
    uses.update(t.name for t in graph.outputs.values())
    producer = {op.output.name: op for op in ops_}
    order = {id(op): i for i, op in enumerate(ops_)}
    users = {}
    for op in ops_:
        for t in op.inputs:
            users.setdefault(t.name, []).append(op)

    def made_once(t, kind):
        """The op of `kind` that makes t, where t is used once, else None."""
        op = producer.get(t.name)
        return op if op is not None and op.kind == kind and uses[t.name] == 1 else None

    place = {}      # id(op) -> the step lowered in its place, or None where it is fused away
    pair = []       # (gate, up) weights of the SwiGLUs, where stacked
    for op in ops_:
        if op.kind == "add":
            for mine, other in ((0, 1), (1, 0)):
                reduce = made_once(op.inputs[mine], "all_reduce")
                if reduce is not None and op.inputs[other].kind == "value":
                    place[id(reduce)] = Op("all_reduce", (reduce.inputs[0], op.inputs[other]),
                                             op.output, dict(reduce.attrs, residual=True))
                    place[id(op)] = None
                    break
                norm = made_once(op.inputs[mine], "rms_norm")
                if norm is not None and op.inputs[other].kind == "value" and \
                        op.inputs[other].shape == norm.output.shape:
                    place[id(norm)] = Op("rms_norm", (*norm.inputs, op.inputs[other]),
                                         op.output, dict(norm.attrs, residual=True))
                    place[id(op)] = None
                    break
                total = made_once(op.inputs[mine], "expert_sum")
                if total is not None and op.inputs[other].kind == "value":
                    place[id(total)] = Op("expert_sum", (*total.inputs, op.inputs[other]),
                                          op.output, {"residual": True})
                    place[id(op)] = None
                    break
        elif op.kind == "all_reduce":
            place.setdefault(id(op), Op("all_reduce", op.inputs, op.output,
                                          dict(op.attrs, residual=False)))
    norm_of = {}
    for op in ops_:
        readers = users.get(op.output.name, [])
        if op.kind == "rms_norm" and readers and uses[op.output.name] == len(readers) and \
                all(r.kind in ("matmul", "expert_matmul") and
                    r.inputs[0].name == op.output.name for r in readers):
            norm_of[op.output.name] = op
            place[id(op)] = None

    def matvec(x, weight, outputs, **fused):
        norm = norm_of.get(x.name)
        if norm is not None:
            fused.update(norm=norm.inputs[1], eps=norm.attrs["eps"])
            x = norm.inputs[0]
        return Matvec(x, weight, tuple(outputs), **fused)

    def expert_matvec(x, weight, ids, outputs, **fused):
        norm = norm_of.get(x.name)
        if norm is not None:
            fused.update(norm=norm.inputs[1], eps=norm.attrs["eps"])
            x = norm.inputs[0]
        return ExpertMatvec(x, weight, ids, tuple(outputs), **fused)

    for op in ops_:
        if id(op) in place:
            continue
        if op.kind == "glu":
            gate, up = (made_once(t, "matmul") for t in op.inputs)
            if gate and up and gate.inputs[0].name == up.inputs[0].name and \
                    gate.inputs[1].dtype == up.inputs[1].dtype and \
                    gate.inputs[1].shape == up.inputs[1].shape:
                first, second = sorted((gate, up), key=lambda m: order[id(m)])
                place[id(first)] = matvec(gate.inputs[0], gate.inputs[1], [op.output],
                                          up=up.inputs[1], glu=op.attrs["activation"])
                place[id(second)] = place[id(op)] = None
                if stack_glu:
                    pair.append((gate.inputs[1], up.inputs[1]))
                continue
            gate, up = (made_once(t, "expert_matmul") for t in op.inputs)
            if gate and up and [t.name for t in gate.inputs[::2]] == \
                    [t.name for t in up.inputs[::2]] and \
                    (gate.inputs[1].dtype, gate.inputs[1].shape) == \
                    (up.inputs[1].dtype, up.inputs[1].shape):
                first, second = sorted((gate, up), key=lambda m: order[id(m)])
                x, w, ids = gate.inputs
                place[id(first)] = expert_matvec(x, w, ids, [op.output], up=up.inputs[1],
                                                 glu=op.attrs["activation"])
                place[id(second)] = place[id(op)] = None
        elif op.kind == "add":
            for mine, other in ((0, 1), (1, 0)):
                maker = made_once(op.inputs[mine], "matmul")
                if maker is not None and id(maker) not in place and \
                        op.inputs[other].kind == "value":
                    place[id(maker)] = matvec(maker.inputs[0], maker.inputs[1], [op.output],
                                              residual=op.inputs[other])
                    place[id(op)] = None
                    break
        elif op.kind == "store_kv":
            _fuse_rope_store_kv(op, users, order, made_once, place)

    for op in ops_:
        if op.kind == "expert_matmul" and id(op) not in place:
            place[id(op)] = expert_matvec(*op.inputs, [op.output])
        chooser = producer.get(op.inputs[1].name) if op.kind == "route_weights" else None
        if chooser is not None and chooser.kind == "top_k" and \
                chooser.inputs[0].name == op.inputs[0].name:
            place[id(chooser)] = Route(op.inputs[0], (chooser.output, op.output),
                                       chooser.attrs["k"], op.attrs["normalize"])
            place[id(op)] = None
    groups = {}
    for op in ops_:
        if op.kind == "matmul" and id(op) not in place:
            w = op.inputs[1]
            alone = uses[w.name] > 1                # its planes serve another op too
            key = (op.inputs[0].name, w.dtype, w.shape[1], id(op) if alone else None)
            groups.setdefault(key, []).append(op)
    stacked = {}

    def stack(parts):
        weight = Tensor("+".join(p.name for p in parts),
                        (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                        parts[0].dtype, "weight")
        stacked[weight.name] = (weight, parts)
        return weight

    for parts in pair:
        stack(parts)
    for members in groups.values():
        parts = tuple(m.inputs[1] for m in members)
        weight = stack(parts) if len(parts) > 1 else parts[0]
        place[id(members[0])] = matvec(members[0].inputs[0], weight,
                                       [m.output for m in members])
        for m in members[1:]:
            place[id(m)] = None

    steps = []
    for op in ops_:
        if id(op) not in place:
            steps.append(op)
        elif place[id(op)] is not None:
            steps.append(place[id(op)])
    return steps, stacked


def _fuse_rope_store_kv(store, users, order, made_once, place):
    """rope(q), rope(k), store_kv(k, v) -> one rope_store_kv step in store_kv's place,
    when the roped q is read only by the attention over the cache store_kv writes; and where
    q and k come from rms_norms of one eps over their heads (Qwen3's, Gemma 3's), read only
    there, with q's input read only by its norm, the norms too (their weights the step's last
    two inputs, `eps` among its attributes)."""
    k_rope = made_once(store.inputs[0], "rope")
    attention = next((u for u in users.get(store.output.name, ())
                      if u.kind == "attention" and order[id(u)] > order[id(store)]), None)
    q_rope = made_once(attention.inputs[0], "rope") if attention is not None else None
    if k_rope is None or q_rope is None or \
            [t.name for t in k_rope.inputs[1:]] != [t.name for t in q_rope.inputs[1:]] or \
            k_rope.attrs != q_rope.attrs or len(users.get(q_rope.inputs[0].name, ())) != 1:
        return
    q, k = q_rope.inputs[0], k_rope.inputs[0]
    inputs, attrs = (q, k, *store.inputs[1:], q_rope.inputs[2]), q_rope.attrs
    q_norm, k_norm = made_once(q, "rms_norm"), made_once(k, "rms_norm")
    if q_norm is not None and k_norm is not None and q_norm.attrs == k_norm.attrs and \
            len(users.get(q_norm.inputs[0].name, ())) == 1:
        inputs = (q_norm.inputs[0], k_norm.inputs[0], *inputs[2:], q_norm.inputs[1],
                  k_norm.inputs[1])
        attrs = dict(attrs, eps=q_norm.attrs["eps"])
        place[id(q_norm)] = place[id(k_norm)] = None
    place[id(store)] = Op("rope_store_kv", inputs, q_rope.output, attrs)
    place[id(k_rope)] = place[id(q_rope)] = None


def assign_slots(steps, outputs, shared, elements):
    """(uses, slot of each value, slot sizes) of a lowering: arena slots by liveness, a
    value taking a free slot of its size at its op and freeing it after its last use; a
    reshape, and rope and rope_store_kv (which rotate q in place), share their input's
    slot; what a rope_store_kv reads lives until the attention that may fold it in
    (rope_before), a Route's logits until the expert launch that may choose itself
    (route_before)."""
    reads = []                  # each step's inputs, with those of the step it may do itself
    for i, op in enumerate(steps):
        before = rope_before(steps, i) or route_before(steps, i)
        reads.append([*op.inputs, *(before.inputs if before is not None else ())])
    last_use, alias = {}, {}
    for i, op in enumerate(steps):
        for t in reads[i]:
            last_use[t.name] = i
        if op.kind in SHARES_INPUT:
            alias[op.output.name] = alias.get(op.inputs[0].name, op.inputs[0].name)
    for name, root in alias.items():        # a slot lives until its last alias is used
        last_use[root] = max(last_use.get(root, 0), last_use.get(name, 0))
    for t in outputs:
        last_use[t.name] = len(steps)
    free, slot_of, sizes = {}, {}, []
    for i, op in enumerate(steps):
        for out in op.outputs:
            if op.kind == "all_gather" and out.name not in last_use:
                continue        # read by no op here: the ranks that do not keep the logits
            if out.kind == "value" and op.kind not in SHARES_INPUT and \
                    out.name not in shared:
                size = elements(out.shape) * 4
                pool = free.setdefault(size, [])
                slot = pool.pop() if pool else len(sizes)
                if slot == len(sizes):
                    sizes.append(size)
                slot_of[out.name] = slot
            elif op.kind in SHARES_INPUT:
                slot_of[out.name] = slot_of[alias[out.name]]
        for t in dict.fromkeys(reads[i]):     # once each, in order: the same slots every run
            root = alias.get(t.name, t.name)
            if t.kind == "value" and last_use.get(root) == i and root in slot_of:
                free.setdefault(sizes[slot_of[root]], []).append(slot_of[root])
    uses = {}
    for op in steps:
        for t in op.inputs:
            uses[t.name] = uses.get(t.name, 0) + 1
    return uses, slot_of, sizes


def part_rows(stacked):
    """{part's name: (stacked weight, its first row)} of the stacked weights of a lowering."""
    out = {}
    for whole, parts in stacked.values():
        row = 0
        for p in parts:
            out[p.name] = (whole, row)
            row += p.shape[0]
    return out


def rope_before(steps, i):
    """The rope_store_kv step right before attention step steps[i] that rotates its q, or
    None: the attention of a decode step does that step's work itself (ops.attention's
    rope), reading its inputs."""
    op = steps[i]
    prev = steps[i - 1] if i else None
    if op.kind == "attention" and prev is not None and prev.kind == "rope_store_kv" and \
            prev.output.name == op.inputs[0].name:
        return prev
    return None


def route_before(steps, i):
    """The Route step right before expert_matmul step steps[i] that reads its ids, or None:
    the expert launch of a one-token step may make that choice itself (mma_vec's choose),
    reading its logits."""
    op = steps[i]
    prev = steps[i - 1] if i else None
    if op.kind == "expert_matmul" and prev is not None and prev.kind == "route" and \
            prev.outputs[0].name == op.ids.name:
        return prev
    return None


def next_matmul(steps, i):
    """The step after steps[i] (past reshapes) if it is a matmul, else None."""
    for op in steps[i + 1:]:
        if op.kind != "reshape":
            return op if op.kind == "matmul" else None
    return None


def normed_after(steps, i):
    """The matmul after steps[i] (an all_reduce or expert_sum with a residual) if it reads
    the sum through an RMSNorm on mma_vec, whose norm_x16 the sum's launch may make
    (reduce_norm_x16, expert_sum_norm_x16); else None."""
    op, after = steps[i], steps[i + 1] if i + 1 < len(steps) else None
    if after is None or after.kind != "matmul" or after.norm is None or \
            after.x.name != op.output.name or not op.attrs.get("residual"):
        return None
    return after

