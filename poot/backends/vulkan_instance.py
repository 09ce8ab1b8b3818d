"""Vulkan before a device is opened: the instance (with the validation layer where asked), the
physical devices with a compute queue, their extensions and timestamps, and the memory budget of
their device-local heaps. The Vulkan backend opens its device from these, and wgpu reads the
budget and the subgroup size of its adapter through PhysicalDeviceView. Nothing here chooses a
device.
"""
from drivers import vulkan as vk

from ..errors import CapacityError

ffi = vk.ffi
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
BUDGET_EXTENSION = "VK_EXT_memory_budget"


def open_instance(lib, validate):
    """An instance (Vulkan 1.3 where the loader has it); with `validate`, the Khronos layer
    reporting through a messenger into the returned list. Returns (instance, messenger
    keep-alive, messages)."""
    version = ffi.new("uint32_t *")
    vk.check(lib.vkEnumerateInstanceVersion(version), "vkEnumerateInstanceVersion")
    layers = {vk.text(p.layerName) for p in vk.enumerate_all(
        lib.vkEnumerateInstanceLayerProperties, "VkLayerProperties")}
    validate = validate and VALIDATION_LAYER in layers
    messages = []

    def on_message(severity, types, data, user):
        name = ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        messages.append((severity, name, ffi.string(data.pMessage).decode("utf-8", "replace")))
        return 0

    callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT", on_message)
    messenger = vk.new(
        "VkDebugUtilsMessengerCreateInfoEXT",
        messageSeverity=lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
        | lib.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
        messageType=lib.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
        | lib.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT, pfnUserCallback=callback)
    names = [VALIDATION_LAYER] if validate else []
    extensions = ["VK_EXT_debug_utils"] if validate else []
    info = vk.new(
        "VkInstanceCreateInfo", pNext=messenger if validate else ffi.NULL,
        pApplicationInfo=vk.new("VkApplicationInfo", pApplicationName=b"poot",
                                apiVersion=min(version[0], vk.make_version(1, 3))),
        enabledLayerCount=len(names), ppEnabledLayerNames=vk.strings(names),
        enabledExtensionCount=len(extensions), ppEnabledExtensionNames=vk.strings(extensions))
    handle = ffi.new("VkInstance *")
    vk.check(lib.vkCreateInstance(info, ffi.NULL, handle), "vkCreateInstance")
    keep = [callback, messenger]
    if validate:
        create = vk.instance_function(lib, handle[0], "vkCreateDebugUtilsMessengerEXT")
        out = ffi.new("VkDebugUtilsMessengerEXT *")
        vk.check(create(handle[0], messenger, ffi.NULL, out), "vkCreateDebugUtilsMessengerEXT")
        keep.append(out)
    return handle[0], keep, messages if validate else None


def compute_devices(lib, instance):
    """Physical devices with a compute queue, each as (handle, index of its compute family)."""
    found = []
    for physical in vk.enumerate_all(lib.vkEnumeratePhysicalDevices, "VkPhysicalDevice", instance):
        families = vk.enumerate_all(lib.vkGetPhysicalDeviceQueueFamilyProperties,
                                    "VkQueueFamilyProperties", physical)
        family = next((i for i, f in enumerate(families)
                       if f.queueFlags & lib.VK_QUEUE_COMPUTE_BIT), None)
        if family is not None:
            found.append((physical, family))
    return found


def queue_timestamp_bits(lib, physical, family):
    """Valid bits of the timestamps the compute queue family writes (0: none)."""
    families = vk.enumerate_all(lib.vkGetPhysicalDeviceQueueFamilyProperties,
                                "VkQueueFamilyProperties", physical)
    return families[family].timestampValidBits


def device_extensions(lib, physical):
    return {vk.text(e.extensionName) for e in vk.enumerate_all(
        lib.vkEnumerateDeviceExtensionProperties, "VkExtensionProperties", physical, ffi.NULL)}


def _local_heaps(lib, physical):
    """[(size, budget, usage)] of the device-local heaps, from VK_EXT_memory_budget (the caller
    knows the extension is there)."""
    budget = vk.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT")
    memory = vk.chain(vk.new("VkPhysicalDeviceMemoryProperties2"), budget)
    lib.vkGetPhysicalDeviceMemoryProperties2(physical, memory)
    props = memory.memoryProperties
    return [(props.memoryHeaps[i].size, budget.heapBudget[i], budget.heapUsage[i])
            for i in range(props.memoryHeapCount)
            if props.memoryHeaps[i].flags & lib.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]


def heap_budget(lib, physical, extensions, name):
    """(free, total) bytes of the device-local heaps: VK_EXT_memory_budget's budget minus usage.

    Without the extension the driver leaves the chained struct untouched (PLATFORM-NOTES), so
    the extension list decides, and an unknown budget is a CapacityError, never a guess."""
    if BUDGET_EXTENSION not in extensions:
        raise CapacityError(f"{name}: the Vulkan driver reports no memory budget (no "
                            f"{BUDGET_EXTENSION}); --memory-limit sets one")
    heaps = _local_heaps(lib, physical)
    return sum(max(b - u, 0) for _, b, u in heaps), sum(size for size, _, _ in heaps)


def heap_usage(lib, physical):
    """Bytes of the device-local heaps this process uses, by VK_EXT_memory_budget's heapUsage
    (unlike the budget, which moves as other processes use memory, this is ours alone)."""
    return sum(u for _, _, u in _local_heaps(lib, physical))


class PhysicalDeviceView:
    """The `index`-th physical device with these PCI ids, seen through a bare instance: how a
    backend with no memory query of its own (wgpu) reads the budget, and the subgroup size
    compute pipelines get. Raises DriverError, or LookupError when no such device is listed."""

    def __init__(self, vendor_id, device_id, index=0):
        self.lib, _ = vk.load()
        self.instance, _, _ = open_instance(self.lib, validate=False)
        seen = 0
        for physical, _ in compute_devices(self.lib, self.instance):
            subgroup = vk.new("VkPhysicalDeviceSubgroupProperties")
            props = vk.chain(vk.new("VkPhysicalDeviceProperties2"), subgroup)
            self.lib.vkGetPhysicalDeviceProperties2(physical, props)
            if (props.properties.vendorID, props.properties.deviceID) != (vendor_id, device_id):
                continue
            if seen == index:
                self.physical, self.subgroup_size = physical, subgroup.subgroupSize
                self.extensions = device_extensions(self.lib, physical)
                return
            seen += 1
        raise LookupError(f"Vulkan lists {seen} device(s) {vendor_id:04x}:{device_id:04x}, "
                          f"not number {index}")

    def budget(self, name):
        return heap_budget(self.lib, self.physical, self.extensions, name)
