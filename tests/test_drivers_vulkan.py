"""drivers/vulkan.py against the real Vulkan loader (lavapipe on a machine without a GPU).

Read as an example of the binding in use: an instance with the Khronos validation layer whose
messages are collected through VK_EXT_debug_utils (any error fails the test), the property,
feature and memory chains, a device with a features chain, and one real compute dispatch checked
against numpy. Skips name what is missing: the loader, a device, or `spirv-as`.
"""

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from drivers import DriverError, LibraryNotFound, held_functions
from drivers import vulkan as vk

ffi = vk.ffi
SPIRV_SOURCES = Path(__file__).parent / "data" / "spirv"
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
NAN_PATTERN = 0x7FC0DEAD  # a quiet NaN no arithmetic produces: the output is poisoned with it


def assemble(name, tmp_path):
    """SPIR-V words of tests/data/spirv/<name>.spvasm, assembled with spirv-as (test-only tool)."""
    if shutil.which("spirv-as") is None:
        pytest.skip("spirv-as not installed (Debian package spirv-tools)")
    output = tmp_path / f"{name}.spv"
    subprocess.run(["spirv-as", "--target-env", "vulkan1.1", str(SPIRV_SOURCES / f"{name}.spvasm"),
                    "-o", str(output)], check=True)
    return output.read_bytes()


@pytest.fixture(scope="module")
def lib():
    try:
        lib, _ = vk.load()
    except LibraryNotFound as error:
        pytest.skip(f"Vulkan loader not available: {error}")
    return lib


class Instance:
    """A VkInstance with the validation layer (when installed) reporting into `messages`."""

    def __init__(self, lib):
        self.lib = lib
        found = vk.enumerate_all(lib.vkEnumerateInstanceLayerProperties, "VkLayerProperties")
        layers = [vk.text(layer.layerName) for layer in found]
        self.validated = VALIDATION_LAYER in layers
        self.messages = []  # (severity bits, message id name, text)
        self.callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", self.on_message)
        messenger_info = vk.new(
            "VkDebugUtilsMessengerCreateInfoEXT",
            messageSeverity=lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
            | lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
            messageType=lib.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
            | lib.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
            | lib.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT,
            pfnUserCallback=self.callback)
        layer_names = [VALIDATION_LAYER] if self.validated else []
        extensions = ["VK_EXT_debug_utils"] if self.validated else []
        info = vk.new(
            "VkInstanceCreateInfo",
            # Chained into the create info, the messenger also sees vkCreate/DestroyInstance.
            pNext=messenger_info if self.validated else ffi.NULL,
            pApplicationInfo=vk.new("VkApplicationInfo", pApplicationName=b"poot tests",
                                    apiVersion=vk.make_version(1, 3)),
            enabledLayerCount=len(layer_names), ppEnabledLayerNames=vk.strings(layer_names),
            enabledExtensionCount=len(extensions), ppEnabledExtensionNames=vk.strings(extensions))
        handle = ffi.new("VkInstance *")
        vk.check(lib.vkCreateInstance(info, ffi.NULL, handle), "vkCreateInstance")
        self.handle = handle[0]
        self.messenger = None
        if self.validated:
            create = vk.instance_function(lib, self.handle, "vkCreateDebugUtilsMessengerEXT")
            messenger = ffi.new("VkDebugUtilsMessengerEXT *")
            vk.check(create(self.handle, messenger_info, ffi.NULL, messenger),
                     "vkCreateDebugUtilsMessengerEXT")
            self.messenger = messenger[0]

    def on_message(self, severity, types, data, user):
        name = ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        self.messages.append((severity, name, ffi.string(data.pMessage).decode()))
        return 0  # VK_FALSE: never abort the call that triggered the message

    def errors(self):
        bit = self.lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT
        return [f"{name}: {text}" for severity, name, text in self.messages if severity & bit]

    def destroy(self):
        if self.messenger is not None:
            destroy = vk.instance_function(self.lib, self.handle, "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.handle, self.messenger, ffi.NULL)
        self.lib.vkDestroyInstance(self.handle, ffi.NULL)


@pytest.fixture(scope="module")
def instance(lib):
    instance = Instance(lib)
    yield instance
    instance.destroy()
    assert instance.errors() == []


@pytest.fixture(autouse=True)
def no_validation_errors(request):
    """Fail a test that made the validation layer report an error."""
    if "instance" not in request.fixturenames:
        yield
        return
    instance = request.getfixturevalue("instance")
    seen = len(instance.errors())
    yield
    assert instance.errors()[seen:] == []


def describe(lib, physical_device):
    """Properties (with subgroup and driver properties chained) of one physical device.

    The three structs returned own their memory: hold them while reading (a field read through
    a temporary, `describe(...)[0].properties`, would outlive its owner).
    """
    subgroup = vk.new("VkPhysicalDeviceSubgroupProperties")
    driver = vk.new("VkPhysicalDeviceDriverProperties")
    properties = vk.chain(vk.new("VkPhysicalDeviceProperties2"), subgroup, driver)
    lib.vkGetPhysicalDeviceProperties2(physical_device, properties)
    return properties, subgroup, driver


@pytest.fixture(scope="module")
def physical_device(lib, instance):
    """lavapipe when present (the device these tests know the facts of), else the first device."""
    devices = list(vk.enumerate_all(lib.vkEnumeratePhysicalDevices, "VkPhysicalDevice",
                                    instance.handle))
    if not devices:
        pytest.skip("no Vulkan physical device (install mesa-vulkan-drivers for lavapipe)")
    for device in devices:
        if names(lib, device)[1] == "llvmpipe":
            return device
    return devices[0]


def names(lib, physical_device):
    """(device name, driver name) of a physical device."""
    properties, _, driver = describe(lib, physical_device)
    return vk.text(properties.properties.deviceName), vk.text(driver.driverName)


def is_lavapipe(lib, physical_device):
    return names(lib, physical_device)[1] == "llvmpipe"


def device_extensions(lib, physical_device):
    found = vk.enumerate_all(lib.vkEnumerateDeviceExtensionProperties, "VkExtensionProperties",
                             physical_device, ffi.NULL)
    return {vk.text(extension.extensionName) for extension in found}


def read_features(lib, physical_device):
    v11, v12, v13 = (vk.new(f"VkPhysicalDeviceVulkan1{minor}Features") for minor in (1, 2, 3))
    features = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), v11, v12, v13)
    lib.vkGetPhysicalDeviceFeatures2(physical_device, features)
    return features, v11, v12, v13


def test_instance_version_and_layers(lib, instance):
    version = ffi.new("uint32_t *")
    vk.check(lib.vkEnumerateInstanceVersion(version), "vkEnumerateInstanceVersion")
    assert version[0] >= vk.make_version(1, 1)
    assert vk.version_string(vk.make_version(1, 3, 239)) == "1.3.239"
    if not instance.validated:
        pytest.skip(f"{VALIDATION_LAYER} not installed (Debian package vulkan-validationlayers)")


def test_the_calls_a_launch_makes_are_declared_alike_to_ctypes(lib):
    """RECORDED's ctypes signatures agree with the cffi declarations (drivers.held_functions
    checks them as it binds), and each is a function of the opened library."""
    held = held_functions(vk.ffi, lib, vk.RECORDED)
    assert all(callable(getattr(held, name)) for name in vk.RECORDED)


def test_properties_and_subgroups(lib, physical_device):
    properties, subgroup, driver = describe(lib, physical_device)
    limits = properties.properties.limits
    assert vk.text(properties.properties.deviceName)
    assert properties.properties.apiVersion >= vk.make_version(1, 1)
    assert subgroup.subgroupSize >= 1 and subgroup.subgroupSize & (subgroup.subgroupSize - 1) == 0
    assert subgroup.supportedOperations & lib.VK_SUBGROUP_FEATURE_BASIC_BIT
    assert limits.maxPushConstantsSize >= 128  # the spec's required minimum
    assert limits.maxComputeWorkGroupInvocations >= 128
    if is_lavapipe(lib, physical_device):
        assert properties.properties.deviceType == lib.VK_PHYSICAL_DEVICE_TYPE_CPU
        assert subgroup.subgroupSize == 8
        assert subgroup.supportedOperations & lib.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT
        assert subgroup.supportedStages & lib.VK_SHADER_STAGE_COMPUTE_BIT


def test_features_chain(lib, physical_device):
    features, v11, v12, v13 = read_features(lib, physical_device)
    assert features.sType == lib.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
    if not is_lavapipe(lib, physical_device):
        pytest.skip("the offered features below are lavapipe's")
    assert v11.storageBuffer16BitAccess and v12.storageBuffer8BitAccess
    assert v12.shaderFloat16 and v12.shaderInt8 and v12.hostQueryReset


def test_memory_properties_and_budget_chain(lib, physical_device):
    budget = vk.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT")
    memory = vk.chain(vk.new("VkPhysicalDeviceMemoryProperties2"), budget)
    lib.vkGetPhysicalDeviceMemoryProperties2(physical_device, memory)
    heaps = memory.memoryProperties.memoryHeaps[0:memory.memoryProperties.memoryHeapCount]
    assert heaps and all(heap.size > 0 for heap in heaps)
    has_budget = "VK_EXT_memory_budget" in device_extensions(lib, physical_device)
    if has_budget:
        assert any(budget.heapBudget[i] > 0 for i in range(len(heaps)))
    if is_lavapipe(lib, physical_device):
        # lavapipe offers no budget, and the chained struct comes back untouched: only the
        # extension list can say whether a budget is known.
        assert not has_budget
        assert list(budget.heapBudget) == [0] * lib.VK_MAX_MEMORY_HEAPS
        types = memory.memoryProperties.memoryTypes[0:memory.memoryProperties.memoryTypeCount]
        wanted = lib.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
        assert any(t.propertyFlags & wanted == wanted for t in types)


class Device:
    """A VkDevice with one compute queue, the 16/8-bit storage and f16/i8 features enabled where
    offered, and the few objects the dispatch test shares (command pool, fence)."""

    def __init__(self, lib, physical_device):
        self.lib, self.physical_device = lib, physical_device
        self.families = vk.enumerate_all(lib.vkGetPhysicalDeviceQueueFamilyProperties,
                                         "VkQueueFamilyProperties", physical_device)
        self.family = next(index for index, family in enumerate(self.families)
                           if family.queueFlags & lib.VK_QUEUE_COMPUTE_BIT)
        offered, o11, o12, _ = read_features(lib, physical_device)
        v11 = vk.new("VkPhysicalDeviceVulkan11Features",
                     storageBuffer16BitAccess=o11.storageBuffer16BitAccess)
        v12 = vk.new("VkPhysicalDeviceVulkan12Features",
                     storageBuffer8BitAccess=o12.storageBuffer8BitAccess,
                     shaderFloat16=o12.shaderFloat16, shaderInt8=o12.shaderInt8)
        features = vk.chain(vk.new("VkPhysicalDeviceFeatures2"), v11, v12)
        features.features.shaderInt16 = offered.features.shaderInt16
        queue = vk.new("VkDeviceQueueCreateInfo", queueFamilyIndex=self.family, queueCount=1,
                       pQueuePriorities=ffi.new("float[]", [1.0]))
        info = vk.new("VkDeviceCreateInfo", pNext=features, queueCreateInfoCount=1,
                      pQueueCreateInfos=queue)
        handle = ffi.new("VkDevice *")
        vk.check(lib.vkCreateDevice(physical_device, info, ffi.NULL, handle), "vkCreateDevice")
        self.handle = handle[0]
        queue_handle = ffi.new("VkQueue *")
        lib.vkGetDeviceQueue(self.handle, self.family, 0, queue_handle)
        self.queue = queue_handle[0]
        self.memory = vk.new("VkPhysicalDeviceMemoryProperties2")  # owner of the views read below
        lib.vkGetPhysicalDeviceMemoryProperties2(physical_device, self.memory)
        self.destroyers = []

    def create(self, kind, info):
        """vkCreate<kind> with `info`; the object is destroyed with the device."""
        handle = ffi.new(f"Vk{kind} *")
        create, destroy = (getattr(self.lib, f"vk{verb}{kind}") for verb in ("Create", "Destroy"))
        vk.check(create(self.handle, info, ffi.NULL, handle), f"vkCreate{kind}")
        self.destroyers.append(lambda: destroy(self.handle, handle[0], ffi.NULL))
        return handle[0]

    def host_visible_type(self, type_bits):
        lib = self.lib
        wanted = lib.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | lib.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        properties = self.memory.memoryProperties
        for index in range(properties.memoryTypeCount):
            flags = properties.memoryTypes[index].propertyFlags
            if type_bits & (1 << index) and flags & wanted == wanted:
                return index
        pytest.fail("no host-visible coherent memory type")

    def buffer(self, size, usage):
        """A buffer bound to its own host-visible allocation; returns (buffer, mapped pointer)."""
        lib = self.lib
        buffer = self.create("Buffer", vk.new("VkBufferCreateInfo", size=size, usage=usage,
                                              sharingMode=lib.VK_SHARING_MODE_EXCLUSIVE))
        requirements = ffi.new("VkMemoryRequirements *")
        lib.vkGetBufferMemoryRequirements(self.handle, buffer, requirements)
        memory = ffi.new("VkDeviceMemory *")
        allocate = vk.new("VkMemoryAllocateInfo", allocationSize=requirements.size,
                          memoryTypeIndex=self.host_visible_type(requirements.memoryTypeBits))
        vk.check(lib.vkAllocateMemory(self.handle, allocate, ffi.NULL, memory), "vkAllocateMemory")
        self.destroyers.append(lambda: lib.vkFreeMemory(self.handle, memory[0], ffi.NULL))
        vk.check(lib.vkBindBufferMemory(self.handle, buffer, memory[0], 0), "vkBindBufferMemory")
        pointer = ffi.new("void **")
        vk.check(lib.vkMapMemory(self.handle, memory[0], 0, lib.VK_WHOLE_SIZE, 0, pointer),
                 "vkMapMemory")
        self.destroyers.append(lambda: lib.vkUnmapMemory(self.handle, memory[0]))
        return buffer, memory[0], pointer[0]

    def destroy(self):
        vk.check(self.lib.vkDeviceWaitIdle(self.handle), "vkDeviceWaitIdle")
        for destroy in reversed(self.destroyers):
            destroy()
        self.lib.vkDestroyDevice(self.handle, ffi.NULL)


@pytest.fixture(scope="module")
def device(lib, instance, physical_device):
    device = Device(lib, physical_device)
    yield device
    device.destroy()


def host_array(pointer, count, dtype=np.float32):
    """A numpy view of `count` elements of mapped memory."""
    return np.frombuffer(ffi.buffer(pointer, count * np.dtype(dtype).itemsize), dtype=dtype)


def test_affine_dispatch_matches_numpy(lib, device, tmp_path):
    """y = a*x + b on the device, output poisoned first; fill, barriers, copy and timestamps."""
    n, pad, local_size = 1000, 64, 64
    rng = np.random.default_rng()
    x = rng.standard_normal(n).astype(np.float32)
    a, b = np.float32(rng.uniform(-2, 2)), np.float32(rng.uniform(-2, 2))
    storage, transfer_src, transfer_dst = (lib.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
                                           lib.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                                           lib.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
    x_buffer, _, x_host = device.buffer(4 * n, storage)
    y_buffer, _, y_host = device.buffer(4 * (n + pad), storage | transfer_src | transfer_dst)
    out_buffer, out_memory, out_host = device.buffer(4 * (n + pad), transfer_dst)
    host_array(x_host, n)[:] = x
    host_array(y_host, n + pad)[:] = rng.standard_normal(n + pad)  # junk the fill must replace
    host_array(out_host, n + pad, np.uint32)[:] = 0xFFFFFFFF
    flush = vk.new("VkMappedMemoryRange", memory=out_memory, offset=0, size=lib.VK_WHOLE_SIZE)
    vk.check(lib.vkFlushMappedMemoryRanges(device.handle, 1, flush), "vkFlushMappedMemoryRanges")

    code = assemble("affine", tmp_path)
    module = device.create("ShaderModule", vk.new(
        "VkShaderModuleCreateInfo", codeSize=len(code), pCode=ffi.from_buffer("uint32_t[]", code)))
    bindings = ffi.new("VkDescriptorSetLayoutBinding[]", [
        {"binding": binding, "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
         "descriptorCount": 1, "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT}
        for binding in (0, 1)])
    set_layout = device.create("DescriptorSetLayout", vk.new(
        "VkDescriptorSetLayoutCreateInfo", bindingCount=2, pBindings=bindings))
    set_layouts = ffi.new("VkDescriptorSetLayout[]", [set_layout])
    push_range = ffi.new("VkPushConstantRange *", {
        "stageFlags": lib.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0, "size": 12})
    layout = device.create("PipelineLayout", vk.new(
        "VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=set_layouts,
        pushConstantRangeCount=1, pPushConstantRanges=push_range))
    pipeline_info = vk.new("VkComputePipelineCreateInfo", layout=layout, stage={
        "stage": lib.VK_SHADER_STAGE_COMPUTE_BIT, "module": module, "pName": b"main"})
    pipeline = ffi.new("VkPipeline *")
    vk.check(lib.vkCreateComputePipelines(device.handle, ffi.NULL, 1, pipeline_info, ffi.NULL,
                                          pipeline), "vkCreateComputePipelines")
    device.destroyers.append(lambda: lib.vkDestroyPipeline(device.handle, pipeline[0], ffi.NULL))

    pool_sizes = ffi.new("VkDescriptorPoolSize *", {"type": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                    "descriptorCount": 2})
    descriptor_pool = device.create("DescriptorPool", vk.new(
        "VkDescriptorPoolCreateInfo", maxSets=1, poolSizeCount=1, pPoolSizes=pool_sizes))
    descriptor_set = ffi.new("VkDescriptorSet *")
    vk.check(lib.vkAllocateDescriptorSets(device.handle, vk.new(
        "VkDescriptorSetAllocateInfo", descriptorPool=descriptor_pool, descriptorSetCount=1,
        pSetLayouts=set_layouts), descriptor_set), "vkAllocateDescriptorSets")
    buffer_infos = [ffi.new("VkDescriptorBufferInfo *", {"buffer": buffer, "offset": 0,
                                                         "range": lib.VK_WHOLE_SIZE})
                    for buffer in (x_buffer, y_buffer)]
    writes = vk.new_array("VkWriteDescriptorSet", [
        {"dstSet": descriptor_set[0], "dstBinding": binding, "descriptorCount": 1,
         "descriptorType": lib.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, "pBufferInfo": info}
        for binding, info in enumerate(buffer_infos)])
    lib.vkUpdateDescriptorSets(device.handle, 2, writes, 0, ffi.NULL)

    queries = device.create("QueryPool", vk.new(
        "VkQueryPoolCreateInfo", queryType=lib.VK_QUERY_TYPE_TIMESTAMP, queryCount=2))
    command_pool = device.create("CommandPool", vk.new(
        "VkCommandPoolCreateInfo", queueFamilyIndex=device.family))
    commands = ffi.new("VkCommandBuffer *")
    vk.check(lib.vkAllocateCommandBuffers(device.handle, vk.new(
        "VkCommandBufferAllocateInfo", commandPool=command_pool,
        level=lib.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1), commands),
        "vkAllocateCommandBuffers")
    cb = commands[0]

    def barrier(src_stage, src_access, dst_stage, dst_access):
        memory = vk.new("VkMemoryBarrier", srcAccessMask=src_access, dstAccessMask=dst_access)
        lib.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 1, memory, 0, ffi.NULL, 0, ffi.NULL)

    vk.check(lib.vkBeginCommandBuffer(cb, vk.new(
        "VkCommandBufferBeginInfo", flags=lib.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)),
        "vkBeginCommandBuffer")
    lib.vkCmdResetQueryPool(cb, queries, 0, 2)
    lib.vkCmdFillBuffer(cb, y_buffer, 0, lib.VK_WHOLE_SIZE, NAN_PATTERN)
    barrier(lib.VK_PIPELINE_STAGE_TRANSFER_BIT, lib.VK_ACCESS_TRANSFER_WRITE_BIT,
            lib.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
            lib.VK_ACCESS_SHADER_READ_BIT | lib.VK_ACCESS_SHADER_WRITE_BIT)
    lib.vkCmdBindPipeline(cb, lib.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline[0])
    lib.vkCmdBindDescriptorSets(cb, lib.VK_PIPELINE_BIND_POINT_COMPUTE, layout, 0, 1,
                                descriptor_set, 0, ffi.NULL)
    params = struct.pack("<ffI", a, b, n)
    lib.vkCmdPushConstants(cb, layout, lib.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(params),
                           ffi.from_buffer(params))
    lib.vkCmdWriteTimestamp(cb, lib.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, queries, 0)
    lib.vkCmdDispatch(cb, (n + local_size - 1) // local_size, 1, 1)
    lib.vkCmdWriteTimestamp(cb, lib.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, queries, 1)
    barrier(lib.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, lib.VK_ACCESS_SHADER_WRITE_BIT,
            lib.VK_PIPELINE_STAGE_TRANSFER_BIT, lib.VK_ACCESS_TRANSFER_READ_BIT)
    region = ffi.new("VkBufferCopy *", {"srcOffset": 0, "dstOffset": 0, "size": 4 * (n + pad)})
    lib.vkCmdCopyBuffer(cb, y_buffer, out_buffer, 1, region)
    barrier(lib.VK_PIPELINE_STAGE_TRANSFER_BIT, lib.VK_ACCESS_TRANSFER_WRITE_BIT,
            lib.VK_PIPELINE_STAGE_HOST_BIT, lib.VK_ACCESS_HOST_READ_BIT)
    vk.check(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")

    fence = device.create("Fence", vk.new("VkFenceCreateInfo"))
    fences = ffi.new("VkFence[]", [fence])
    assert lib.vkGetFenceStatus(device.handle, fence) == lib.VK_NOT_READY
    submit = vk.new("VkSubmitInfo", commandBufferCount=1, pCommandBuffers=commands)
    vk.check(lib.vkQueueSubmit(device.queue, 1, submit, fence), "vkQueueSubmit")
    assert vk.check(lib.vkWaitForFences(device.handle, 1, fences, lib.VK_TRUE, 10 * 10**9),
                    "vkWaitForFences") == lib.VK_SUCCESS
    assert lib.vkGetFenceStatus(device.handle, fence) == lib.VK_SUCCESS
    vk.check(lib.vkResetFences(device.handle, 1, fences), "vkResetFences")
    assert lib.vkGetFenceStatus(device.handle, fence) == lib.VK_NOT_READY
    vk.check(lib.vkQueueWaitIdle(device.queue), "vkQueueWaitIdle")
    vk.check(lib.vkInvalidateMappedMemoryRanges(device.handle, 1, flush),
             "vkInvalidateMappedMemoryRanges")

    result = host_array(out_host, n + pad).copy()
    np.testing.assert_allclose(result[:n], a * x + b, rtol=1e-6, atol=1e-6)
    assert (result[n:].view(np.uint32) == NAN_PATTERN).all(), "the shader wrote past n"

    stamps = ffi.new("uint64_t[2]")
    flags = lib.VK_QUERY_RESULT_64_BIT | lib.VK_QUERY_RESULT_WAIT_BIT
    assert vk.check(lib.vkGetQueryPoolResults(device.handle, queries, 0, 2, ffi.sizeof(stamps),
                                              stamps, 8, flags), "vkGetQueryPoolResults") == 0
    bits = device.families[device.family].timestampValidBits
    assert bits > 0
    mask = (1 << bits) - 1
    properties, _, _ = describe(lib, device.physical_device)
    period = properties.properties.limits.timestampPeriod
    nanoseconds = ((stamps[1] & mask) - (stamps[0] & mask)) * period
    assert nanoseconds >= 0


def test_validation_errors_reach_the_list(lib, instance, device):
    """The messenger works: an invalid call is reported (then forgiven, as it was on purpose)."""
    if not instance.validated:
        pytest.skip(f"{VALIDATION_LAYER} not installed (Debian package vulkan-validationlayers)")
    seen = len(instance.messages)
    info = vk.new("VkFenceCreateInfo", sType=lib.VK_STRUCTURE_TYPE_APPLICATION_INFO)  # wrong sType
    fence = ffi.new("VkFence *")
    vk.check(lib.vkCreateFence(device.handle, info, ffi.NULL, fence), "vkCreateFence")
    lib.vkDestroyFence(device.handle, fence[0], ffi.NULL)
    reported = instance.messages[seen:]
    assert any("VkFenceCreateInfo-sType" in name for _, name, _ in reported), reported
    del instance.messages[seen:]


def test_failed_call_raises_with_result_name(lib):
    info = vk.new("VkInstanceCreateInfo", enabledLayerCount=1,
                  ppEnabledLayerNames=vk.strings(["VK_LAYER_POOT_no_such_layer"]))
    with pytest.raises(DriverError) as caught:
        vk.check(lib.vkCreateInstance(info, ffi.NULL, ffi.new("VkInstance *")), "vkCreateInstance")
    error = caught.value
    assert (error.library, error.call, error.code, error.name) == (
        "vulkan", "vkCreateInstance", -6, "VK_ERROR_LAYER_NOT_PRESENT")
    assert str(error) == ("vkCreateInstance failed: VK_ERROR_LAYER_NOT_PRESENT (-6): "
                          "a requested layer is not present or could not be loaded")


def test_absurd_allocation_raises_out_of_device_memory(lib, physical_device):
    """Outside the validated instance: the layer would (rightly) flag a size over the heap."""
    bare = vk.new("VkInstanceCreateInfo", pApplicationInfo=vk.new(
        "VkApplicationInfo", apiVersion=vk.make_version(1, 3)))
    handle = ffi.new("VkInstance *")
    vk.check(lib.vkCreateInstance(bare, ffi.NULL, handle), "vkCreateInstance")
    try:
        physical = vk.enumerate_all(lib.vkEnumeratePhysicalDevices, "VkPhysicalDevice", handle[0])
        chosen = next(p for p in physical if names(lib, p) == names(lib, physical_device))
        device = Device(lib, chosen)
        try:
            allocate = vk.new("VkMemoryAllocateInfo", allocationSize=1 << 62, memoryTypeIndex=0)
            with pytest.raises(DriverError) as caught:
                vk.check(lib.vkAllocateMemory(device.handle, allocate, ffi.NULL,
                                              ffi.new("VkDeviceMemory *")), "vkAllocateMemory")
            assert caught.value.name == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
            assert str(caught.value).startswith(
                "vkAllocateMemory failed: VK_ERROR_OUT_OF_DEVICE_MEMORY (-2)")
        finally:
            device.destroy()
    finally:
        lib.vkDestroyInstance(handle[0], ffi.NULL)


def test_missing_extension_function_is_a_driver_error(lib, instance):
    with pytest.raises(DriverError, match="vkPootNoSuchFunctionEXT"):
        vk.instance_function(lib, instance.handle, "vkPootNoSuchFunctionEXT")


def test_check_hands_back_positive_results():
    assert vk.check(2, "vkWaitForFences") == 2  # VK_TIMEOUT is an answer, not an error
    assert vk.RESULTS[-2][0] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"


def test_library_absent_names_the_path(monkeypatch):
    monkeypatch.setenv(vk.ENV_VAR, "/nonexistent/libvulkan.so.1")
    with pytest.raises(LibraryNotFound) as caught:
        vk.load()
    assert isinstance(caught.value, DriverError)
    assert "/nonexistent/libvulkan.so.1" in str(caught.value)
    assert caught.value.tried[0][0].startswith("/nonexistent/libvulkan.so.1")
