"""The device runner's steps of a mixture-of-experts block (device_runner.STEPS's entries for
them): for each kind, the kernels it may launch and how it launches them (kernels/experts.py).

A route step also groups the routes by expert (expert_groups) into buffers of the runner's own,
`expert_offsets`, `expert_routes` and `expert_active`, which the layer's expert matvecs read:
every layer rewrites them, in order, so one set serves them all. Nothing is read back to the
host: an expert matvec's grid covers as many experts as the step's routes can choose, and a
workgroup column past the chosen ones returns at once.
"""
import math

from ..kernels import experts
from .kernel_choice import matvec_rows


def buffers(graph, max_tokens):
    """[(name, u32 words)] of the route groups, for a graph with experts (else none)."""
    routers = [op for op in graph.ops if op.kind == "top_k"]
    if not routers:
        return []
    n_experts = max(op.inputs[0].shape[1] for op in routers)
    if n_experts > experts.MAX_EXPERTS:
        raise ValueError(f"{n_experts} experts: expert_groups counts at most "
                         f"{experts.MAX_EXPERTS}")
    used = max(op.attrs["k"] for op in routers)
    return [("expert_offsets", n_experts + 1), ("expert_routes", max_tokens * used),
            ("expert_active", n_experts)]


def token_group(dtype, T):
    """The routes an expert_matvec subgroup takes a pass in a T-token step: at most T choose
    one expert (a token chooses it once), so the smallest group that holds them all, of those
    the format takes (experts.expert_tokens)."""
    groups = experts.expert_tokens(dtype)
    return next((g for g in groups if g >= T), groups[-1])


def route_kernels(runner, steps, i, long):
    op, sg = steps[i], runner.device.subgroup_size
    return [experts.route(sg, op.used, op.normalize), experts.expert_groups(),
            experts.route_grouped(sg, op.used, op.normalize)]


def route(runner, op, T, R, i, long):
    """A Route (lowering.py): each token's experts and their weights, then the step's routes
    grouped by expert; one launch where the step has at most experts.GROUPED_ROUTES routes
    (decode steps), else two."""
    route_, groups, grouped = route_kernels(runner, [op], 0, long)
    (ids, weights), n_experts = op.outputs, op.logits.shape[1]
    B = runner._buffer
    if T * op.used <= experts.GROUPED_ROUTES:
        runner._launch(grouped, (1,), B(op.logits), B(ids), B(weights), *expert_buffers(runner),
                       n_experts, T)
        return
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
    return [matvec_kernel(runner, op, group)[0]
            for group in experts.expert_tokens(op.weight.dtype)]


def matvec(runner, op, T, R, i, long):
    """An ExpertMatvec: each expert's rows over the routes that chose it."""
    sg, (n_experts, rows, cols) = runner.device.subgroup_size, op.weight.shape
    x_per = op.ids.shape[1] if len(op.x.shape) == 2 else 1     # x a token's, or a route's
    planes = runner._weight_planes(op.weight) + (runner._weight_planes(op.up) if op.up else [])
    kernel, rows_per = matvec_kernel(runner, op, token_group(op.weight.dtype, T))
    grid = experts.expert_grid(rows, min(n_experts, T * op.ids.shape[1]), sg, rows_per)
    norm = [] if op.norm is None else [runner._buffer(op.norm)]
    eps = [] if op.norm is None else [op.eps]
    runner._launch(kernel, grid, *planes, runner._buffer(op.x), *norm, *expert_buffers(runner),
                   runner._buffer(op.outputs[0]), rows, cols, x_per, *eps)


def sum_kernels(runner, steps, i, long):
    op = steps[i]
    return [experts.expert_sum(op.inputs[0].shape[1], op.attrs.get("residual", False))]


def expert_sum(runner, op, T, R, i, long):
    y = op.inputs[0]
    cols = y.shape[2]
    B = runner._buffer
    runner._launch(sum_kernels(runner, [op], 0, long)[0], (math.ceil(T * cols / experts.WG),),
                   *map(B, op.inputs), B(op.output), T, cols)
