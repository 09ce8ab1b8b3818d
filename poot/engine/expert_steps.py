"""The device runner's steps of a mixture-of-experts block (device_runner.STEPS's entries for
them): for each kind, the kernels it may launch and how it launches them (kernels/experts.py).

top_k also groups the routes by expert (expert_groups) into two buffers of the runner's own,
`expert_offsets` and `expert_routes`, which the layer's expert matvecs read: every layer
rewrites them, in order, so one pair serves them all. Nothing is read back to the host: the
launches' grids cover every expert, and an expert no route chose returns at once.
"""
import math

from ..kernels import experts
from .kernel_choice import TOKEN_GROUPS, matvec_rows


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
    return [("expert_offsets", n_experts + 1), ("expert_routes", max_tokens * used)]


def token_group(T):
    """The routes an expert_matvec subgroup takes at once in a T-token step: at most T choose
    one expert (a token chooses it once), so the smallest group that holds them all."""
    return next((g for g in TOKEN_GROUPS if g >= T), TOKEN_GROUPS[-1])


def top_k_kernels(runner, steps, i, long):
    return [experts.top_k(runner.device.subgroup_size, steps[i].attrs["k"]),
            experts.expert_groups()]


def top_k(runner, op, T, R, i, long):
    logits, ids = op.inputs[0], op.output
    n_experts, used = logits.shape[1], op.attrs["k"]
    B = runner._buffer
    runner._launch(experts.top_k(runner.device.subgroup_size, used), (T,), B(logits), B(ids),
                   n_experts)
    runner._launch(experts.expert_groups(), (1,), B(ids), runner.buffers["expert_offsets"],
                   runner.buffers["expert_routes"], T * used, n_experts)


def route_weights_kernels(runner, steps, i, long):
    op = steps[i]
    return [experts.route_weights(runner.device.subgroup_size, op.inputs[1].shape[1],
                                  op.attrs["normalize"])]


def route_weights(runner, op, T, R, i, long):
    logits, ids = op.inputs
    B = runner._buffer
    runner._launch(route_weights_kernels(runner, [op], 0, long)[0], (T,), B(logits), B(ids),
                   B(op.output), logits.shape[1])


def matvec_kernel(runner, op, group):
    """The expert_matvec of an ExpertMatvec step (lowering.py) for a token group, and its
    rows a subgroup (as a dense matvec's: kernel_choice.matvec_rows)."""
    rows_per = matvec_rows(op.weight.dtype, group, 2 if op.glu else 1)
    return experts.expert_matvec(op.weight.dtype, runner.device.subgroup_size, group, op.glu,
                                 rows_per), rows_per


def matvec_kernels(runner, steps, i, long):
    return [matvec_kernel(runner, steps[i], group)[0] for group in TOKEN_GROUPS]


def matvec(runner, op, T, R, i, long):
    """An ExpertMatvec: each expert's rows over the routes that chose it."""
    sg, (n_experts, rows, cols) = runner.device.subgroup_size, op.weight.shape
    x_per = op.ids.shape[1] if len(op.x.shape) == 2 else 1     # x a token's, or a route's
    planes = runner._weight_planes(op.weight) + (runner._weight_planes(op.up) if op.up else [])
    kernel, rows_per = matvec_kernel(runner, op, token_group(T))
    grid = experts.expert_grid(rows, n_experts, sg, rows_per)
    runner._launch(kernel, grid, *planes, runner._buffer(op.x),
                   runner.buffers["expert_offsets"], runner.buffers["expert_routes"],
                   runner._buffer(op.outputs[0]), rows, cols, x_per)


def sum_kernels(runner, steps, i, long):
    op = steps[i]
    return [experts.expert_sum(op.inputs[0].shape[1], op.attrs.get("residual", False))]


def expert_sum(runner, op, T, R, i, long):
    y = op.inputs[0]
    cols = y.shape[2]
    B = runner._buffer
    runner._launch(sum_kernels(runner, [op], 0, long)[0], (math.ceil(T * cols / experts.WG),),
                   *map(B, op.inputs), B(op.output), T, cols)
