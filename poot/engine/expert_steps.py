"""The device runner's steps of a mixture-of-experts block (device_runner.STEPS's entries for
them): for each kind, the kernels it may launch and how it launches them (kernels/experts.py).

A route step also groups the routes by expert (expert_groups) into buffers of the runner's own,
`expert_offsets`, `expert_routes` and `expert_active`, which the layer's expert matvecs read:
every layer rewrites them, in order, so one set serves them all. Nothing is read back to the
host: an expert matvec's grid covers as many experts as the step's routes can choose, and a
workgroup column past the chosen ones returns at once.

On a device that runs mma_vec on the experts' format (ptx), their matvecs are mma_vec's expert
variant for every step length: each expert's routes gathered into 8-token tiles on the tensor
cores, its rows read once a pass of up to 8 * token_tiles routes; a folded norm is a norm_x16
launch first, into `expert_x16`, or in steps of a few tokens the route's own launch makes it
(normed_in_route). A one-token step's first expert launch may choose its routes itself
(chooses_itself): then the route launches nothing and the router's matvec makes the x16.
Elsewhere expert_matvec streams each expert's rows for its routes, a token group at a time.
"""
import math
from functools import cache

from ..kernels import experts, mma_vec
from .kernel_choice import matvec_rows, sum_x16_formats
from .lowering import normed_after, route_before


ROUTE_NORM_TOKENS = 8       # steps this short make the experts' x16 in the route's workgroup


def buffers(runner):
    """[(name, u32 words)] of the route groups and the normed x of the experts' mma_vec, for
    a runner of a graph with experts (else none)."""
    routers = [op for op in runner.graph.ops if op.kind == "top_k"]
    if not routers:
        return []
    n_experts = max(op.inputs[0].shape[1] for op in routers)
    if n_experts > experts.MAX_EXPERTS:
        raise ValueError(f"{n_experts} experts: expert_groups counts at most "
                         f"{experts.MAX_EXPERTS}")
    used = max(op.attrs["k"] for op in routers)
    out = [("expert_offsets", n_experts + 1), ("expert_routes", runner.max_tokens * used),
           ("expert_active", n_experts)]
    x16 = max((op.weight.shape[2] // 2 for op in runner.steps
               if op.kind == "expert_matmul" and op.norm is not None and
               on_tensor_cores(runner, op)), default=0)
    return out + ([("expert_x16", runner.max_tokens * x16)] if x16 else [])


def on_tensor_cores(runner, op):
    """Whether an ExpertMatvec runs mma_vec's expert variant: where the device runs mma_vec
    on its weights' format, of columns a multiple of 8."""
    return runner.choice.mma_vec_runs(op.weight.dtype) and op.weight.shape[2] % 8 == 0


@cache
def mma_shape(dtype, n_experts, rows, cols, used, multiprocessors, T, x16=False):
    """(slots, mma_vec keywords) of the expert mma_vec of a T-token step: as many workgroup
    columns as experts its routes can choose; token tiles for the routes an expert has on
    average (mma_vec.token_tiles), the rows' shape (mma_vec.shape) for all those experts'
    rows together (`x16`: x comes as norm_x16's words)."""
    slots = min(n_experts, T * used)
    tiles = mma_vec.token_tiles(dtype, -(-T * used // slots))
    return slots, mma_vec.shape(dtype, rows * slots, cols, multiprocessors, tiles,
                                experts=True, x16=x16)


@cache
def mma_shapes(dtype, n_experts, rows, cols, used, multiprocessors, most, x16=False):
    """The distinct mma_vec keywords of mma_shape over steps of 1 to `most` tokens (they stop
    changing once every expert can be chosen and the token tiles are at their most)."""
    shapes, last = {}, mma_shape(dtype, n_experts, rows, cols, used, multiprocessors, most,
                                 x16)[1]
    for T in range(1, most + 1):
        shape = mma_shape(dtype, n_experts, rows, cols, used, multiprocessors, T, x16)[1]
        shapes[tuple(sorted(shape.items()))] = shape
        if T * used >= n_experts and shape == last:
            break
    return list(shapes.values())


def mma_kernel(runner, op, T, shape=None, by_route=None, route=None):
    """(slots, kernel, its shape) of an ExpertMatvec's mma_vec in a T-token step (of `shape`
    where given): by route in a one-token step (its routes choose different experts), else
    over the route groups (`by_route` where given: which); choosing the routes of Route op
    `route` itself where given (mma_vec's choose)."""
    n_experts, rows, cols = op.weight.shape
    slots, chosen = mma_shape(op.weight.dtype, n_experts, rows, cols, op.ids.shape[1],
                              runner.choice.multiprocessors, T, op.norm is not None)
    shape = shape or chosen
    by_route = takes_routes(T) if by_route is None else by_route
    choose = None if route is None else (
        route.used, route.normalize, experts.route_slots(route.logits.shape[1], mma_vec.SUBGROUP))
    return slots, mma_vec.mma_vec(op.weight.dtype, glu=op.glu, x16=op.norm is not None,
                                  experts=True, by_route=by_route, choose=choose, **shape), shape


def token_group(dtype, T):
    """The routes an expert_matvec subgroup takes a pass in a T-token step: at most T choose
    one expert (a token chooses it once), so the smallest group that holds them all, of those
    the format takes (experts.expert_tokens)."""
    groups = experts.expert_tokens(dtype)
    return next((g for g in groups if g >= T), groups[-1])


def normed_in_route(runner, steps, i, T):
    """The ExpertMatvec after Route step steps[i] whose norm_x16 that step's launch makes
    (route_grouped's norm variant), or None: in steps of at most ROUTE_NORM_TOKENS tokens,
    an mma_vec reading the route's ids through a norm right after it."""
    op, after = steps[i], steps[i + 1] if i + 1 < len(steps) else None
    if T > ROUTE_NORM_TOKENS or T * op.used > experts.GROUPED_ROUTES or after is None or \
            after.kind != "expert_matmul" or after.norm is None or \
            after.ids.name != op.outputs[0].name or not on_tensor_cores(runner, after):
        return None
    return after


def route_kernels(runner, steps, i, long):
    op = steps[i]
    normed = normed_in_route(runner, steps, i, 1)
    x16 = None if normed is None else normed.weight.dtype
    out = [*route_apart(runner, op), grouped_kernel(runner, op)]
    out += [] if x16 is None else [grouped_kernel(runner, op, x16)]
    return out + ([grouped_kernel(runner, op, x16, False)]     # one token's, where it launches
                  if routes_alone(runner, steps, i, 1) and
                  chooses_itself(runner, steps, i, 1) is None else [])


def route_apart(runner, op):
    """The route and expert_groups kernels of Route op, launched apart (steps of more than
    experts.GROUPED_ROUTES routes)."""
    sg = runner.device.subgroup_size
    return (experts.route(sg, op.used, op.normalize, experts.route_slots(op.logits.shape[1], sg)),
            experts.expert_groups(op.used % 4 == 0))


def takes_routes(T):
    """Whether the expert mma_vec of a T-token step takes its routes a workgroup column each
    (mma_vec's by_route): one token's routes choose different experts."""
    return T == 1


def routes_alone(runner, steps, i, T):
    """Whether Route step steps[i] of a T-token step leaves its routes ungrouped: one token's
    routes choose different experts, and every expert matvec reading them takes them by route
    (mma_vec's by_route: on the tensor cores)."""
    op = steps[i]
    return takes_routes(T) and all(
        on_tensor_cores(runner, after) for after in steps
        if after.kind == "expert_matmul" and after.ids.name == op.outputs[0].name)


def router_before(steps, i):
    """The matmul step right before Route step steps[i] (past reshapes) that makes its logits,
    or None."""
    for op in reversed(steps[:i]):
        if op.kind != "reshape":
            return op if op.kind == "matmul" and \
                op.outputs[0].name == steps[i].logits.name else None
    return None


def chooses_itself(runner, steps, i, T):
    """The ExpertMatvec after Route step steps[i] that makes the route's choice itself
    (mma_vec's choose), so that the route launches nothing, or None: in a one-token step
    whose expert launches all take their routes by route (routes_alone), where the first
    reads x through the norm that the router's matvec folds in too (the same x, gain and
    eps; the router a plain matvec, whose one workgroup more makes that x16: normed_out).
    Asked for each layer's launches of every step: the answer is the runner's once a route."""
    if not takes_routes(T):
        return None
    return runner.choice._once(("chooses", steps[i].outputs[0].name),
                               lambda: _chooser(runner, steps, i, T))


def _chooser(runner, steps, i, T):
    after = normed_in_route(runner, steps, i, T)
    if after is None or not routes_alone(runner, steps, i, T):
        return None
    router = router_before(steps, i)
    if router is None or router.norm is None or router.residual is not None or \
            router.up is not None or len(router.outputs) != 1 or \
            router.x.name != after.x.name or router.norm.name != after.norm.name or \
            router.eps != after.eps or runner.choice.runs_mma_vec(router.weight):
        return None
    return after


def router_normed_out(runner, steps, i, T):
    """The weight format whose x16 router matmul steps[i] makes (matvec's normed_out) for the
    expert launch that chooses after its route (chooses_itself), else None."""
    j = next((j for j in range(i + 1, len(steps)) if steps[j].kind != "reshape"), None)
    if j is None or steps[j].kind != "route" or router_before(steps, j) is not steps[i]:
        return None
    after = chooses_itself(runner, steps, j, T)
    return None if after is None else after.weight.dtype


def router_variant(runner, op, T, dtype):
    """(kernel, grid of T tokens) of router matmul op's matvec that makes the experts' x16
    of format dtype too."""
    w = op.weight
    return runner.choice.matvec(w, runner.choice.group_of(w, T),
                                dict(op.variant, normed_out=dtype))[:2]


def router_kernels(runner, steps, i, long):
    """The router matvec a one-token step launches where its expert launch chooses."""
    dtype = None if long else router_normed_out(runner, steps, i, 1)
    return [] if dtype is None else [router_variant(runner, steps[i], 1, dtype)[0]]


def router(runner, op, T, dtype):
    """Router matmul op's matvec with one workgroup more, the last, which writes the experts'
    x16 (of format dtype) into expert_x16."""
    B = runner._buffer
    kernel, grid = router_variant(runner, op, T, dtype)
    width, height = grid(T)
    rows, cols = op.weight.shape
    runner._launch(kernel, (width + 1, height), *runner._weight_planes(op.weight), B(op.x),
                   B(op.norm), B(op.outputs[0]), rows, cols, T, op.eps,
                   runner.buffers["expert_x16"])


def grouped_kernel(runner, op, norm_x16=None, grouped=True):
    """The route_grouped of Route op (with norm_x16, the experts' weight format, where it makes
    their x16; not `grouped`, the routes alone)."""
    sg = runner.device.subgroup_size
    return experts.route_grouped(sg, op.used, op.normalize,
                                 experts.route_slots(op.logits.shape[1], sg), norm_x16, grouped)


def route(runner, op, T, R, i, long):
    """A Route (lowering.py): each token's experts and their weights, then the step's routes
    grouped by expert; one launch where the step has at most experts.GROUPED_ROUTES routes
    (decode steps), else two. In steps of a few tokens the launch also makes the x16 of the
    expert mma_vec next (normed_in_route). Nothing where that expert launch chooses itself."""
    if chooses_itself(runner, runner.steps, i, T) is not None:
        return
    (ids, weights), n_experts = op.outputs, op.logits.shape[1]
    B = runner._buffer
    if T * op.used <= experts.GROUPED_ROUTES:
        normed = normed_in_route(runner, runner.steps, i, T)
        alone = routes_alone(runner, runner.steps, i, T)
        grouped = grouped_kernel(runner, op, None if normed is None else normed.weight.dtype,
                                 not alone)
        x16 = [] if normed is None else [B(normed.x), B(normed.norm),
                                         runner.buffers["expert_x16"]]
        rest = [] if normed is None else [normed.weight.shape[2], normed.eps]
        runner._launch(grouped, (1,), B(op.logits), B(ids), B(weights),
                       *([] if alone else expert_buffers(runner)), *x16, n_experts, T, *rest)
        return
    route_, groups = route_apart(runner, op)
    runner._launch(route_, (T,), B(op.logits), B(ids), B(weights), n_experts)
    runner._launch(groups, (1,), B(ids), *expert_buffers(runner), T * op.used, n_experts)


def expert_buffers(runner):
    return [runner.buffers[f"expert_{name}"] for name in ("offsets", "routes", "active")]


def matvec_kernel(runner, op, group):
    """The expert_matvec of an ExpertMatvec step (lowering.py) for a token group, and its
    rows a subgroup (as a dense matvec's: kernel_choice.matvec_rows)."""
    rows_per = matvec_rows(op.weight.dtype, group, 2 if op.glu else 1)
    return experts.expert_matvec(op.weight.dtype, runner.device.subgroup_size, group, op.glu,
                                 rows_per, op.norm is not None), rows_per


def matvec_kernels(runner, steps, i, long):
    op = steps[i]
    if on_tensor_cores(runner, op):
        n_experts, rows, cols = op.weight.shape
        shapes = mma_shapes(op.weight.dtype, n_experts, rows, cols, op.ids.shape[1],
                            runner.choice.multiprocessors, runner.max_tokens, op.norm is not None)
        prep = [mma_vec.norm_x16(op.weight.dtype)] if op.norm is not None else []
        route = route_before(steps, i)
        chooser = route is not None and chooses_itself(runner, steps, i - 1, 1) is op
        return prep + [mma_kernel(runner, op, 1, shape, False)[1] for shape in shapes] + \
            [mma_kernel(runner, op, 1, by_route=True)[1]] + (   # a one-token step's
                [mma_kernel(runner, op, 1, route=route)[1]] if chooser else [])
    return [matvec_kernel(runner, op, group)[0]
            for group in experts.expert_tokens(op.weight.dtype)]


def matvec(runner, op, T, R, i, long):
    """An ExpertMatvec: each expert's rows over the routes that chose it."""
    sg, (n_experts, rows, cols) = runner.device.subgroup_size, op.weight.shape
    x_per = op.ids.shape[1] if len(op.x.shape) == 2 else 1     # x a token's, or a route's
    planes = runner._weight_planes(op.weight) + (runner._weight_planes(op.up) if op.up else [])
    B = runner._buffer
    if on_tensor_cores(runner, op):
        route = route_before(runner.steps, i)
        chooser = route is not None and chooses_itself(runner, runner.steps, i - 1, T) is op
        slots, kernel, shape = mma_kernel(runner, op, T, route=route if chooser else None)
        x = B(op.x)
        if op.norm is not None:
            x = runner.buffers["expert_x16"]
            made = route is not None and normed_in_route(runner, runner.steps, i - 1, T) is op
            if not made:
                runner._launch(mma_vec.norm_x16(op.weight.dtype), (T,), B(op.x), B(op.norm),
                               x, cols, op.eps)
        grid = (mma_vec.grid(rows, 1, shape["tiles"], shape["split"])[0], slots)
        by_route = takes_routes(T)
        groups = [B(route.logits), *map(B, route.outputs)] if chooser else \
            [B(op.ids)] if by_route else expert_buffers(runner)
        runner._launch(kernel, grid, *planes, x, *groups, B(op.outputs[0]), rows, cols, x_per,
                       *([n_experts] if by_route else []))
        return
    kernel, rows_per = matvec_kernel(runner, op, token_group(op.weight.dtype, T))
    grid = experts.expert_grid(rows, min(n_experts, T * op.ids.shape[1]), sg, rows_per)
    norm = [] if op.norm is None else [runner._buffer(op.norm)]
    eps = [] if op.norm is None else [op.eps]
    runner._launch(kernel, grid, *planes, runner._buffer(op.x), *norm, *expert_buffers(runner),
                   runner._buffer(op.outputs[0]), rows, cols, x_per, *eps)


def sum_kernels(runner, steps, i, long):
    op, sg = steps[i], runner.device.subgroup_size
    used = op.inputs[0].shape[1]
    return [experts.expert_sum(used, op.attrs.get("residual", False))] + [
        experts.expert_sum_norm_x16(used, dtype, sg)
        for dtype in sum_x16_formats(runner.choice, steps, i, long)]


def expert_sum(runner, op, T, R, i, long):
    """The routes' outputs summed by their weights (plus the residual); where the matmul next
    reads the sum through a norm, the launch makes its x16 too (DeviceRunner._sum_x16)."""
    y, B, after = op.inputs[0], runner._buffer, normed_after(runner.steps, i)
    used, cols = y.shape[1:]
    made = runner._sum_x16(after, T, long)
    if made is None:
        runner._launch(experts.expert_sum(used, op.attrs.get("residual", False)),
                       (math.ceil(T * cols / experts.WG),), *map(B, op.inputs), B(op.output),
                       T, cols)
        return
    dtype, x16, held = made
    runner._launch(experts.expert_sum_norm_x16(used, dtype, runner.device.subgroup_size), (T,),
                   *map(B, op.inputs), B(op.output), B(after.norm), x16, cols, after.eps)
    runner._x16["mma" if long else "norm"] = held
