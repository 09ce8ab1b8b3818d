"""Devices: one module per backend, each a Device with the same small surface.

A Device has `backend` (its name), `name` (for people), `caps` (the kernel-language
capabilities it offers: storage16, storage8, float16, int16, int64, subgroup, subgroup_arith,
subgroup_shuffle, shared), `subgroup_size`, `max_buffer` (the most bytes one buffer may hold,
None for no limit of its own), `memory_source` (where memory() comes from), and:

    memory() -> (free, total)           bytes, from the driver's own accounting (`memory_source`
                                        names it); CapacityError when the driver reports none
    held() -> (bytes, source)           the device memory this process holds now, by the
                                        driver's own account where it keeps one (the
                                        post-allocation check compares its growth to the plan)
    allocation_bytes(nbytes)            the device memory one buffer of nbytes takes (the
                                        allocator's rounding; engine/plan.py counts with it)
    alloc(nbytes) -> buffer             free(buffer); `allocated` counts the bytes held
    write(buffer, array, offset=0)      host -> device, in order with launches
    read(buffer, nbytes=None, offset=0) -> bytes, after everything issued before it
    copy(dst, src, nbytes)              device -> device, in order
    program(kernel) -> program          rendered and compiled once per kernel name
    launch(program, kernel, grid, args) args follow kernel.params: buffers, then scalars
    synchronize()
    capture(issue) -> recording         optional: the launches `issue()` makes, recorded
    replay(recording)                   ... and issued again as one submission

select.py opens them (--backend, auto order, refusals); the device runner
(engine/device_runner.py) is their only user in the engine.

Every backend refuses a launch of an empty grid (`workgroups`): CUDA does
(CUDA_ERROR_INVALID_VALUE) while Vulkan and wgpu run nothing without a word, so the same
refusal everywhere lets the CPU's Vulkan (lavapipe) catch what would fail on a GPU.
"""


class EmptyLaunch(ValueError):
    """A launch of a grid with no workgroups: its caller has lost count of its work."""


def workgroups(kernel, grid):
    """A launch's grid as three workgroup counts (missing dimensions 1); EmptyLaunch when one
    is below 1."""
    groups = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if min(groups) < 1:
        raise EmptyLaunch(f"{kernel.name}: launch of an empty grid {groups}")
    return groups
