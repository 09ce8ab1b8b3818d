"""The raw Vulkan and the wgpu Devices on the Vulkan device this machine has (lavapipe on a
machine without a GPU; the facts checked as lavapipe's are skipped elsewhere).

Read as examples of use: opening, capabilities, the memory rule (no budget extension, no
guess), buffers, issue order between writes and launches, recordings, refusals that name what
is missing, and a whole tiny-model run under the Khronos validation layer. Kernel numerics
against numpy are in test_kernels.py, the runner against the reference in
test_device_runner.py.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import poot
from drivers import DriverError
from drivers import vulkan as vk
from poot.backends import vulkan as vulkan_backend
from poot.backends.vulkan import VALIDATION_ENV
from poot.engine.batch import SamplingRows, StepBatch
from poot.errors import CapacityError, ModelRefused
from poot.kernels import ops
from poot.kernels.lang import BF16, F32, I8, I32, KernelBuilder
from tests.conftest import open_or_skip
from tests.models import tiny_model

LAVAPIPE_CAPS = {"storage16", "storage8", "float16", "int16", "int64", "subgroup",
                 "subgroup_arith", "subgroup_shuffle", "shared"}
# naga (wgpu's translator) takes no 8-bit storage and no 16-bit integers
LAVAPIPE_WGPU_CAPS = LAVAPIPE_CAPS - {"storage8", "int16"}
rng = np.random.default_rng()


def open_vulkan():
    """A Vulkan device with the validation layer on (where it is installed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(VALIDATION_ENV, "1")
        return open_or_skip("vulkan")


@pytest.fixture(scope="module")
def vulkan():
    device = open_vulkan()
    yield device
    device.synchronize()        # raises what the validation layer reported


@pytest.fixture(scope="module")
def wgpu_device():
    device = open_or_skip("wgpu")
    yield device
    device.synchronize()        # raises what wgpu reported outside any scope


@pytest.fixture(params=["vulkan", "wgpu"])
def device(request):
    return request.getfixturevalue("vulkan" if request.param == "vulkan" else "wgpu_device")


def lavapipe(device):
    return device.name.startswith("llvmpipe")


def test_vulkan_opens_with_lavapipe_caps(vulkan):
    assert vulkan.backend == "vulkan" and vulkan.name.endswith("(vulkan:0)")
    if not lavapipe(vulkan):
        pytest.skip(f"the facts below are lavapipe's; this is {vulkan.name}")
    assert set(vulkan.caps) == LAVAPIPE_CAPS
    assert vulkan.subgroup_size == 8
    assert vulkan.limits.maxStorageBufferRange == 128 << 20
    assert vulkan.limits.maxPushConstantsSize == 128


def test_a_cpu_device_stages_its_steps_where_asked(vulkan, monkeypatch):
    """lavapipe writes a step's inputs straight into mapped memory, unless STAGING_ENV asks it
    to stage them as a discrete GPU does (how tests and serve-check run that path here)."""
    if not lavapipe(vulkan):
        pytest.skip(f"{vulkan.name} is no CPU device")
    assert not vulkan.step_staging
    monkeypatch.setenv(vulkan_backend.STAGING_ENV, "1")
    assert vulkan_backend.VulkanDevice(0).step_staging


def test_wgpu_opens_with_lavapipe_caps(wgpu_device):
    assert wgpu_device.backend == "wgpu" and wgpu_device.name.endswith("(wgpu:0)")
    assert not hasattr(wgpu_device, "capture"), "wgpu command buffers cannot be replayed"
    if not lavapipe(wgpu_device):
        pytest.skip(f"the facts below are lavapipe's; this is {wgpu_device.name}")
    assert set(wgpu_device.caps) == LAVAPIPE_WGPU_CAPS
    assert wgpu_device.subgroup_size == 8       # from Vulkan: wgpu reports 0 on lavapipe
    assert wgpu_device.limits.maxStorageBufferBindingSize == 128 << 20
    assert wgpu_device.limits.maxImmediateSize == 128


def test_memory_comes_from_the_budget_extension_or_is_a_capacity_error(device):
    try:
        free, total = device.memory()
    except CapacityError as e:
        message = str(e)
        assert "no memory budget" in message and device.name in message
        assert "--memory-limit" in message
        assert "\n" not in message
        return
    assert not lavapipe(device), "lavapipe has no VK_EXT_memory_budget"
    assert 0 < free <= total


def test_each_buffer_grows_the_heap_usage_by_its_planned_bytes(vulkan):
    """What the plan counts for a buffer (allocation_bytes: the driver's requirement in whole
    pages of its own) is what the driver's heapUsage grows by when it is allocated, small and
    large buffers alike (NVIDIA's driver takes 64 KiB pages); without a budget extension the
    device counts its allocations the same way."""
    for nbytes in (4, 4096, 65540, (1 << 20) + 4, 3 << 20, (8 << 20) + 4):
        before, source = vulkan.held()
        buffer = vulkan.alloc(nbytes)
        after, _ = vulkan.held()
        vulkan.free(buffer)
        assert after - before == vulkan.allocation_bytes(nbytes) >= nbytes, (nbytes, source)
    if lavapipe(vulkan):
        assert vulkan.page == 1 and "count of its allocations" in source
    elif vulkan.name.startswith("NVIDIA"):
        assert vulkan.page == 64 << 10 and "heapUsage" in source


@pytest.mark.parametrize("nbytes", [4, 1000, 3 << 20])
def test_alloc_write_read_round_trip(device, nbytes):
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    buffer = device.alloc(nbytes)
    device.write(buffer, data)
    assert device.read(buffer) == data.tobytes()
    tail = rng.integers(0, 256, 400, dtype=np.uint8)
    if nbytes >= 1000:
        device.write(buffer, tail, offset=500)
        assert device.read(buffer, 400, offset=500) == tail.tobytes()
        assert device.read(buffer, 500) == data[:500].tobytes()
    device.free(buffer)


def test_writes_land_between_the_launches_issued_around_them(device):
    """No synchronize between: the second write must not reach the first launch."""
    add = ops.elementwise("add")
    program = device.program(add)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    x, y, out1, out2 = (device.alloc(4000) for _ in range(4))
    device.write(x, a)
    device.write(y, b)
    device.launch(program, add, (4,), [x, y, out1, 1000, 1000])
    device.write(x, b)
    device.launch(program, add, (4,), [x, out1, out2, 1000, 1000])
    assert np.array_equal(np.frombuffer(device.read(out2), np.float32), (a + b) + b)
    for buffer in (x, y, out1, out2):
        device.free(buffer)


def test_a_recording_replays_with_the_inputs_written_before_it(vulkan):
    add = ops.elementwise("add")
    program = vulkan.program(add)
    x, y, out = (vulkan.alloc(4000) for _ in range(3))
    recording = vulkan.capture(lambda: vulkan.launch(program, add, (4,), [x, y, out, 1000, 1000]))
    for _ in range(3):
        a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
        vulkan.write(x, a)
        vulkan.write(y, b)
        vulkan.replay(recording)
        assert np.array_equal(np.frombuffer(vulkan.read(out), np.float32), a + b)
    for buffer in (x, y, out):
        vulkan.free(buffer)


def test_the_staging_path_of_a_discrete_gpu(monkeypatch):
    """Buffers a host cannot map (a discrete GPU's) go through the staging ring, in chunks
    when larger than it; made so here by not mapping and shrinking the ring."""
    monkeypatch.setattr(vulkan_backend, "STAGING_BYTES", 4096)
    device = open_vulkan()
    monkeypatch.setattr(device, "_uma", False)
    data = rng.integers(0, 256, 10000, dtype=np.uint8)
    buffer = device.alloc(data.nbytes)
    assert buffer.mapped is None
    device.write(buffer, data)
    assert device.read(buffer) == data.tobytes()
    assert device.read(buffer, 3000, offset=7000) == data[7000:].tobytes()
    add = ops.elementwise("add")
    program = device.program(add)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    x, y, out = (device.alloc(4000) for _ in range(3))
    recording = device.capture(lambda: device.launch(program, add, (4,), [x, y, out, 1000, 1000]))
    device.write(x, a)
    device.write(y, b)
    device.replay(recording)
    device.write(x, b)          # staged after the replay: must not reach it
    assert np.array_equal(np.frombuffer(device.read(out), np.float32), a + b)
    device.replay(recording)
    assert np.array_equal(np.frombuffer(device.read(out), np.float32), b + b)
    device.synchronize()


def test_a_kernel_needing_a_missing_capability_is_refused_by_name(vulkan, wgpu_device,
                                                                  monkeypatch):
    k = KernelBuilder("widen_i8", (64,))
    x, y = k.buffer("x", I8), k.buffer("y", I32, "w")
    i = k.thread_id()
    y[i] = x[i].to(I32)
    kernel = k.build()
    with pytest.raises(ModelRefused, match=r"kernel widen_i8 needs storage8"):
        wgpu_device.program(kernel)                     # naga has no 8-bit storage
    monkeypatch.setattr(vulkan, "caps", vulkan.caps - {"storage8"})
    with pytest.raises(ModelRefused, match=r"kernel widen_i8 needs storage8"):
        vulkan.program(kernel)


def test_wgpu_refuses_16_bit_integer_buffers_naming_int16(wgpu_device):
    k = KernelBuilder("widen_bf16", (64,))
    x, y = k.buffer("x", BF16), k.buffer("y", F32, "w")
    i = k.thread_id()
    y[i] = x[i].to(F32)
    with pytest.raises(ModelRefused, match=r"kernel widen_bf16 needs int16"):
        wgpu_device.program(k.build())


def test_a_buffer_over_the_storage_limit_is_refused(device):
    limit = device.max_buffer if device.backend == "vulkan" else min(
        device.limits.maxStorageBufferBindingSize, device.limits.maxBufferSize)
    with pytest.raises(ModelRefused, match="over the"):
        device.alloc(limit + 1)


def prompt_step(tokens, table):
    n = len(tokens)
    return StepBatch(np.array(tokens, np.int32), np.arange(n, dtype=np.int32),
                     np.zeros(n, np.int32), np.array([table], np.int32),
                     np.arange(n, dtype=np.int32), SamplingRows.greedy(n))


def decode_step(token, position, table):
    return StepBatch(np.array([token], np.int32), np.array([position], np.int32),
                     np.zeros(1, np.int32), np.array([table], np.int32),
                     np.zeros(1, np.int32), SamplingRows.greedy(1))


def test_validation_errors_are_raised_at_synchronize():
    """What the check below relies on: an invalid call, reported by the layer, raises."""
    device = open_vulkan()
    if device.messages is None:
        pytest.skip("VK_LAYER_KHRONOS_validation is not installed (vulkan-validationlayers)")
    lib = device.lib
    fence = vk.ffi.new("VkFence *")
    wrong = vk.new("VkFenceCreateInfo", sType=lib.VK_STRUCTURE_TYPE_APPLICATION_INFO)
    vk.check(lib.vkCreateFence(device.device, wrong, vk.ffi.NULL, fence), "vkCreateFence")
    lib.vkDestroyFence(device.device, fence[0], vk.ffi.NULL)
    with pytest.raises(DriverError, match="VkFenceCreateInfo-sType"):
        device.synchronize()
    device.synchronize()        # reported once


@pytest.mark.parametrize("dtype", ["F16", "Q4_1"])
def test_validation_layer_reports_no_errors_over_a_tiny_model_run(tmp_path, dtype):
    """Prefill, then decode steps replayed from a recording, all under the validation layer;
    synchronize() raises anything it reported as an error."""
    device = open_vulkan()
    if device.messages is None:
        pytest.skip("VK_LAYER_KHRONOS_validation is not installed (vulkan-validationlayers)")
    model = poot.load(tiny_model(tmp_path, dtype=dtype))
    runner = model.runner(device, num_blocks=16)
    reference = model.runner(None, num_blocks=16)
    table = list(range(16))
    prompt = [5, 80, 9, 41]
    got, want = runner.logits(prompt_step(prompt, table)), reference.logits(
        prompt_step(prompt, table))
    tokens = prompt + [int(np.argmax(want[-1]))]
    for _ in range(4):
        step = decode_step(tokens[-1], len(tokens) - 1, table)
        got, want = runner.logits(step), reference.logits(step)
        tokens.append(int(np.argmax(want[0])))
        assert int(np.argmax(got[0])) == tokens[-1]
    assert runner.graphs, "decode steps ran from a recording"
    device.synchronize()


# A fresh process: opens the device, builds a tiny model's runner, then serves a greedy request
# and a sampled one with a penalty through an engine (prompt chunks, launches ahead, decode
# recordings and replays, logit edits), printing the C types cffi parsed for them.
STEP_TYPES_SCRIPT = """
import sys, poot
from pathlib import Path
from poot.backends.select import open_device
from poot.engine.engine import Engine
from poot.engine.request import SamplingParams
from tests.models import tiny_model
device = open_device(sys.argv[1])
ffi = sys.modules[type(device).__module__].ffi
model = poot.load(tiny_model(Path(sys.argv[2])))
runner = model.runner(device, num_blocks=16, max_tokens=16, max_seqs=2)
parsed = set(ffi._parsed_types)
engine = Engine(runner, model.tokenizer, max_seqs=2, step_tokens=16)
for params in (SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=6, temperature=1, seed=3, top_p=0.9,
                              presence_penalty=0.5, ignore_eos=True)):
    tokens = [t for out in engine.generate(list(range(3, 40)), params) for t in out.token_ids]
    assert len(tokens) == 6, tokens
print(sorted(set(ffi._parsed_types) - parsed))
"""


@pytest.mark.parametrize("backend", ["vulkan", "wgpu"])
def test_a_step_names_no_c_type_the_device_did_not_parse_when_it_opened(tmp_path, backend):
    """cffi parses a C type the first time a call names it (milliseconds a type for Vulkan's
    declarations): the device parses its steps' types (STEP_TYPES) when it opens, so the first
    request's step does not pay for them."""
    open_or_skip(backend)
    from cffi import FFI
    if not hasattr(FFI(), "_parsed_types"):
        pytest.skip("this cffi keeps its parsed types elsewhere")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", STEP_TYPES_SCRIPT, backend, str(tmp_path)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"types parsed in the steps: {done.stdout}"
