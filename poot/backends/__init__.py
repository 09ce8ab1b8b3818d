"""Devices: one module per backend, each a `Device` that states the contract once (below) and
is its differences only; select.py opens them (--backend, the auto order, refusals, placement
over a `DeviceGroup`), and the device runner (engine/device_runner.py) is their only user in
the engine.

Every backend refuses a launch of an empty grid (`workgroups`): CUDA does
(CUDA_ERROR_INVALID_VALUE) while Vulkan and wgpu run nothing without a word, so the same
refusal everywhere lets the CPU's Vulkan (lavapipe) catch what would fail on a GPU.
"""
from ..errors import ModelRefused

# The optional parts of a device, by the name `features` lists, and the methods each stands for.
FEATURES = {
    "capture": ("capture", "replay"),       # a step recorded once, issued again as one submission
    "timing": ("start_timing", "stop_timing"),      # per-kernel times on the device
    "staging": ("host_array", "download"),  # page-locked host memory that steps copy in a recording
    "views": ("view",),                     # a buffer's part from an offset on, as a buffer
    "lanes": ("lane",),                     # the device again, with a stream of its own
    "marks": ("mark", "wait_mark"),         # a point in the work issued so far, waited for alone
}


class EmptyLaunch(ValueError):
    """A launch of a grid with no workgroups: its caller has lost count of its work."""


def workgroups(kernel, grid, most=None):
    """A launch's grid as three workgroup counts (missing dimensions 1); EmptyLaunch when one
    is below 1, ValueError when one is over the device's `most` of its dimension."""
    groups = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if min(groups) < 1:
        raise EmptyLaunch(f"{kernel.name}: launch of an empty grid {groups}")
    if most is not None and any(g > m for g, m in zip(groups, most)):
        raise ValueError(f"{kernel.name}: grid {groups} is over the device's {tuple(most)}")
    return groups


class Device:
    """The contract of a backend's device. It has `backend` (its name), `name` (for people),
    `ordinal`, `caps` (the kernel-language capabilities it offers: storage16, storage8, float16,
    int16, int64, subgroup, subgroup_arith, subgroup_shuffle, shared, and PTX's own),
    `subgroup_size`, `target` (the code its kernels are rendered to), `max_buffer` (the most bytes
    one buffer may hold, None for no limit of its own), `memory_source` (where memory() comes
    from), `features` (which of FEATURES it has: their methods exist exactly there), and:

        memory() -> (free, total)           bytes, from the driver's own accounting
                                            (`memory_source` names it); CapacityError when the
                                            driver reports none
        held() -> (bytes, source)           the device memory this process holds now, by the
                                            driver's own account where it keeps one (the
                                            post-allocation check compares its growth to the plan)
        allocation_bytes(nbytes)            the device memory one buffer of nbytes takes (the
                                            allocator's rounding; engine/plan.py counts with it)
        alloc(nbytes) -> buffer             free(buffer); `allocated` counts the bytes held
        write(buffer, array, offset=0)      host -> device, in order with launches
        read(buffer, nbytes=None, offset=0) -> bytes, after everything issued before it
        copy(dst, src, nbytes)              device -> device, in order
        program(kernel) -> program          build(kernel), once per kernel name (cached here)
        launch(program, kernel, grid, args) args follow kernel.params: buffers, then scalars
        synchronize()

    `step_staging`: whether a device runner stages its steps' inputs in host_array memory;
    `multiprocessors`: how many the device has, where the driver says.
    """
    features = frozenset()
    step_staging = False
    multiprocessors = None

    def __init__(self):
        self._programs = {}

    def program(self, kernel):
        program = self._programs.get(kernel.name)
        if program is None:
            program = self._programs[kernel.name] = self.build(kernel)
        return program

    def require(self, kernel, limits=()):
        """Refuses (ModelRefused) a kernel this device cannot run: one needing a capability it
        lacks (the one capability check, Kernel.require), or more than one of its `limits`
        allows ((need, what the device offers, what is counted) triples)."""
        where = f"{self.backend}: {self.name}: "
        kernel.require(self.caps, "the device", where)
        for need, have, what in limits:
            if need > have:
                raise ModelRefused(f"{where}kernel {kernel.name} needs {need} {what}; the device "
                                   f"offers {have}")


class DeviceGroup:
    """Devices of one backend run as one (--placement over several, engine/group.py): `devices`,
    `backend`, `name`, `features` (of FEATURES, as a Device's), and signal(i) (device i's event
    after its work so far), wait(i, j) (device i's later work waits for j's event), barrier(),
    copy(i, dst, j, src, nbytes) (from device j into device i), synchronize()."""
    features = frozenset()
