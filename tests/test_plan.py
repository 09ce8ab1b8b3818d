"""The memory plan on this machine's real devices: lavapipe through raw Vulkan and through wgpu.

Footprints come from the runner's own allocation list, rounded by the device's allocation rule;
the chosen candidate is the largest that fits; after a real allocation the device's accounting
agrees with the plan, and a buffer allocated or freed behind the plan's back makes it disagree.
`poot plan` prints all of it, with the exit statuses of the spec's table.
"""
import pytest

from poot.backends.select import open_device
from poot.cli import main
from poot.engine import plan
from poot.errors import BackendUnavailable, CapacityError, PlanMismatch
from tests.conftest import open_or_skip


@pytest.fixture(scope="module", params=["vulkan", "wgpu"])
def device(request):
    return open_or_skip(request.param)


def test_candidates_are_ordered_and_bounded_by_the_model_and_the_pins():
    every = plan.candidates(8192)
    assert all(c.kv_blocks == c.full_blocks == c.max_seqs * -(-c.context // 16) for c in every)
    assert [c.rank for c in every] == sorted(c.rank for c in every)
    assert {c.context for c in every} == {512, 1024, 2048, 4096, 8192}
    assert {c.max_seqs for c in every} == set(plan.MAX_SEQS)
    assert all(c.step_tokens >= c.max_seqs for c in every)
    assert {c.context for c in plan.candidates(300)} == {300}
    pinned = plan.candidates(8192, max_seqs=3, context=1000)
    assert {(c.max_seqs, c.context) for c in pinned} == {(3, 1000)}
    assert {c.step_tokens for c in plan.candidates(8192, max_seqs=200)} == {200, 512, 2048}
    assert {c.step_tokens for c in plan.candidates(8192, max_seqs=600)} == {600, 2048}


def test_the_footprint_is_the_runners_allocation_list_rounded_by_the_device(tiny, device):
    before = device.allocated
    candidate = plan.Candidate(4, 256, 128)
    runner = plan.runner_for(tiny, device, candidate)
    assert device.allocated == before            # a runner's plan side allocates nothing
    sums = dict.fromkeys(plan.KINDS, 0)
    for a in runner.allocations():
        sums[a.kind] += device.allocation_bytes(a.nbytes)
    f = plan.footprint(runner)
    assert (f.weights, f.arenas, f.state) == (sums["weights"], sums["arenas"], sums["state"])
    assert f.total == sum(sums.values())
    cache = [a for a in runner.allocations() if a.kind == "state"]
    cfg = tiny.config
    assert len(cache) == 2 * cfg.n_layers and all(
        a.nbytes == candidate.kv_blocks * plan.BLOCK_SIZE * cfg.n_kv_heads * cfg.head_dim * 2
        for a in cache)


@pytest.mark.parametrize("nbytes", [1, 4, 4097, 1 << 20, (3 << 20) + 1])
def test_the_allocation_rule_is_what_a_real_buffer_takes(device, nbytes):
    before = device.allocated
    buffer = device.alloc(nbytes)
    try:
        assert device.allocated - before == device.allocation_bytes(nbytes) >= nbytes
    finally:
        device.free(buffer)
    if device.backend == "wgpu":
        assert device.allocation_bytes(nbytes) == max(-(-nbytes // 4) * 4, 4)


def test_the_cuda_rule_is_whole_2_mib_pages():
    from poot.backends.ptx import PtxDevice
    rule = PtxDevice.allocation_bytes.__get__(object.__new__(PtxDevice))
    assert [rule(n) for n in (1, 2 << 20, (2 << 20) + 1)] == [2 << 20, 2 << 20, 4 << 20]


@pytest.mark.parametrize("free", [None, 1, 40 << 20, 10 << 30])
def test_the_chosen_candidate_is_the_largest_that_fits(tiny, device, free):
    p = plan.plan(tiny, device, free, "a test")
    fits = [i for i, (_, f) in enumerate(p.table) if free is not None and f.total <= free]
    if not fits:
        assert p.chosen is None
        with pytest.raises(CapacityError) as e:
            p.require()
        smallest = min(f.total for _, f in p.table)
        assert plan.size(smallest) in str(e.value) and "smallest" in str(e.value)
        assert e.value.exit_status == 6
        return
    assert p.require() is p and p.chosen == fits[-1]
    assert p.footprint.total <= free
    assert all(f.total > free for _, f in p.table[p.chosen + 1:])


def test_a_shapes_footprint_at_any_kv_blocks_is_its_runners(tiny, device):
    """Scaling (the plan's footprint of a shape at a count of KV blocks) is what the runner
    built for that count lists, from the least blocks a shape serves with to its full count."""
    shape = plan.Candidate(8, 256, 128)
    least = shape.sharing(shape.least_blocks)
    scaling = plan.Scaling.of(plan.runner_for(tiny, device, least).allocations(),
                              least.kv_blocks, device.allocation_bytes)
    for blocks in (shape.least_blocks, shape.least_blocks + 7, shape.full_blocks):
        runner = plan.runner_for(tiny, device, shape.sharing(blocks))
        assert scaling.at(blocks) == plan.footprint(runner)
        assert runner.max_context == 256


def test_sequences_share_the_kv_cache_the_memory_leaves(tiny, device):
    """Where a full context for every sequence does not fit, the plan still takes the longest
    context and the most sequences, and gives the KV cache every block that fits: one more
    would not."""
    roomy = plan.plan(tiny, device, 1 << 30, "a test").require()
    context = tiny.context_length
    assert (roomy.candidate.context, roomy.candidate.max_seqs) == (context, max(plan.MAX_SEQS))
    full = roomy.candidate.full_blocks
    assert roomy.candidate.kv_blocks == full
    f = roomy.footprint
    per_block = f.state // full
    free = f.total - (full // 3) * per_block        # a third of the full cache does not fit
    tight = plan.plan(tiny, device, free, "a test").require()
    c = tight.candidate
    assert (c.context, c.max_seqs, c.step_tokens) == (context, max(plan.MAX_SEQS),
                                                       roomy.candidate.step_tokens)
    assert c.least_blocks <= c.kv_blocks < full and tight.footprint.total <= free
    more = plan.footprint(plan.runner_for(tiny, device, c.sharing(c.kv_blocks + 1)))
    assert more.total > free
    assert "sharing" in str(c)


def test_a_real_allocation_agrees_with_the_plan(tiny, device):
    p = plan.plan(tiny, device, 64 << 20, "a test").require()
    runner = plan.runner_for(tiny, device, p.candidate)
    before, _ = device.held()
    runner.allocate()
    try:
        check = plan.verify(device, p.footprint, runner, before)
        assert check.planned == p.footprint.total
        if "count of its allocations" in check.source:      # lavapipe: no budget extension
            assert check.measured == check.planned
    finally:
        for buffer in runner.buffers.values():
            device.free(buffer)


def test_a_buffer_allocated_behind_the_plans_back_fails_the_check(tiny, device):
    p = plan.plan(tiny, device, 64 << 20, "a test").require()
    runner = plan.runner_for(tiny, device, p.candidate)
    before, _ = device.held()
    runner.allocate()
    stowaway = device.alloc(1 << 20)
    try:
        with pytest.raises(PlanMismatch) as e:
            plan.verify(device, p.footprint, runner, before)
        assert e.value.exit_status == 6 and "cannot be trusted" in str(e.value)
    finally:
        for buffer in [stowaway, *runner.buffers.values()]:
            device.free(buffer)


def test_a_buffer_freed_behind_the_plans_back_fails_the_check(tiny, device):
    p = plan.plan(tiny, device, 64 << 20, "a test").require()
    runner = plan.runner_for(tiny, device, p.candidate)
    before, _ = device.held()
    runner.allocate()
    cache = next(a.name for a in runner.allocations() if a.kind == "state")
    device.free(runner.buffers.pop(cache))
    try:
        with pytest.raises(PlanMismatch):
            plan.verify(device, p.footprint, runner, before)
    finally:
        for buffer in runner.buffers.values():
            device.free(buffer)


# ---- poot plan ------------------------------------------------------------------------------

def run_plan(capsys, *flags):
    status = main(["plan", *flags])
    out, err = capsys.readouterr()
    return status, out, err


def test_poot_plan_prints_every_candidate_and_marks_the_chosen_one(tiny, capsys):
    open_or_skip("vulkan")
    status, out, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan",
                                "--memory-limit", "40MiB")
    assert status == 0 and err == ""
    rows = [line for line in out.splitlines() if line[:5].strip().isdigit()]
    assert len(rows) == len(plan.candidates(tiny.context_length))
    assert sum("<- chosen" in row for row in rows) == 1
    chosen = rows.index(next(row for row in rows if "<- chosen" in row))
    assert all("over" in row for row in rows[chosen + 1:])
    assert "free: 40.0 MiB (--memory-limit" in out and out.rstrip().splitlines()[-1].startswith(
        "chosen: ")


def test_poot_plan_pins_and_placement(tiny, capsys):
    open_or_skip("vulkan")
    status, out, _ = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan",
                              "--memory-limit", "1GiB", "--max-seqs", "3", "--ctx", "100",
                              "--placement", "pipeline:0")
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert status == 0 and {(r[0], r[1]) for r in rows} == {("3", "100")}
    status, _, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan",
                              "--memory-limit", "1GiB", "--placement", "pipeline:9")
    assert status == 2 and "--placement pipeline:9" in err and "sees 1" in err
    status, _, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "wgpu",
                              "--placement", "tensor:0,1")
    assert status == 5 and "cannot copy between devices" in err
    status, _, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan",
                              "--memory-limit", "1GiB", "--ctx", "100000")
    assert status == 2 and "context length" in err


def test_poot_plan_without_a_budget_prints_the_needs_then_exits_6(tiny, capsys):
    device = open_or_skip("vulkan")
    try:
        device.memory()
        pytest.skip(f"{device.name} reports a memory budget")
    except CapacityError:
        pass
    status, out, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan")
    assert status == 6 and "budget" in err and "--memory-limit" in err
    assert "free: unknown" in out and "<- chosen" not in out


def test_poot_plan_with_a_limit_below_the_weights_exits_6(tiny, capsys):
    open_or_skip("vulkan")
    status, out, err = run_plan(capsys, "--model", str(tiny.path), "--backend", "vulkan",
                                "--memory-limit", "64KiB")
    assert status == 6 and "no serving shape fits: the smallest" in err
    assert "64.0 KiB" not in err and "0.1 MiB free" in err and err.count("\n") == 1


@pytest.mark.parametrize("backend, words", [("ptx", "libcuda"), ("rocm", "hsa_init")])
def test_poot_plan_on_a_backend_that_cannot_open_exits_3(tiny, capsys, backend, words):
    try:
        open_device(backend)
        pytest.skip(f"{backend} opens here")
    except BackendUnavailable:
        pass
    status, out, err = run_plan(capsys, "--model", str(tiny.path), "--backend", backend)
    assert status == 3 and err.startswith(f"poot: {backend}: ") and words in err


def test_poot_plan_on_the_reference_backend_says_it_plans_nothing(tiny, capsys):
    status, out, _ = run_plan(capsys, "--model", str(tiny.path), "--backend", "reference")
    assert status == 0 and "plans nothing against host memory" in out


def test_a_plan_refuses_kernels_the_device_lacks_and_checks_them_once(tiny, monkeypatch):
    """plan() checks the kernels' needs against the device on its first candidate (a device
    without subgroup arithmetic: ModelRefused naming a kernel and the capability), and builds
    its other candidates unchecked; the chosen candidate's runner checks again."""
    from poot.engine.device_runner import DeviceRunner
    from poot.errors import ModelRefused
    from tests.test_device_runner import LaunchLog

    class Lacking(LaunchLog):
        allocation_bytes = staticmethod(lambda n: n)
        max_buffer = None

    lacking = Lacking()
    lacking.caps = lacking.caps - {"subgroup_arith"}
    with pytest.raises(ModelRefused, match=r"kernel \w+ needs subgroup_arith, which the "
                                           r"device lacks"):
        plan.plan(tiny, lacking, 1 << 30, "test")
    checks = []
    check = DeviceRunner._check_supported
    monkeypatch.setattr(DeviceRunner, "_check_supported",
                        lambda runner: checks.append(runner) or check(runner))
    device = Lacking()
    chosen = plan.plan(tiny, device, 1 << 30, "test").require()
    assert len(checks) == 1 and len(plan.candidates(tiny.context_length)) > 1
    plan.runner_for(tiny, device, chosen.candidate)
    assert len(checks) == 2


def test_the_plan_leaves_the_driver_a_reserve_of_what_it_reports_free():
    """The driver's free figure less DRIVER_RESERVE (the KV cache takes all the plan is given,
    so the driver's own later objects need room kept); a user's smaller limit is taken as it
    is, and a driver without a figure needs one."""
    from poot.options import DRIVER_RESERVE, device_memory

    class Reporting:            # a device as far as its memory figures go
        memory_source = "the driver"

        def __init__(self, free):
            self.free = free

        def memory(self):
            if self.free is None:
                raise CapacityError("no budget")
            return self.free, 100 << 30

    free, total, source = device_memory(Reporting(80 << 30), None)
    assert (free, total) == ((80 << 30) - DRIVER_RESERVE, 100 << 30) and "driver" in source
    assert device_memory(Reporting(80 << 30), 1 << 30)[:2] == (1 << 30, 100 << 30)
    assert device_memory(Reporting(80 << 30), 90 << 30)[0] == (80 << 30) - DRIVER_RESERVE
    assert device_memory(Reporting(None), 1 << 30)[0] == 1 << 30
    with pytest.raises(CapacityError):
        device_memory(Reporting(None), None)
