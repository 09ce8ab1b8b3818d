"""Thin cffi binding of the Vulkan loader (`libvulkan.so.1`) for compute work.

What is here: the declarations a compute backend needs, written from `vulkan_core.h` (trimmed:
only the enumerants compute uses, and structs used only through pointers left opaque), a loader
that finds the library, `check` (a negative VkResult -> DriverError with the spec's meaning), and
small helpers for what Vulkan makes tedious in Python: filling `sType`, linking `pNext` chains,
the two-call enumeration idiom, extension entry points. What is not here: any choice of device,
queue or memory type, any budget rule, any state. Those belong to `poot/backends/vulkan.py`.

Core functions are called straight from the loader's exports (`lib.vkCreateDevice(...)`); the
loader exports every core function up to its version. The extension functions declared (those of
VK_EXT_debug_utils, as PFN types) come from `instance_function`. Non-dispatchable handles are
declared as pointers, which is their definition on 64-bit hosts (the only hosts poot runs on).
"""

import ctypes

from cffi import FFI

from drivers import DriverError, Structs, keep_alive, load_library

ENV_VAR = "POOT_VULKAN_LIB"
CANDIDATES = ("libvulkan.so.1", "libvulkan.so", "libvulkan.1.dylib", "vulkan-1.dll")

_CDEF = r"""
#define VK_FALSE 0
#define VK_TRUE 1
#define VK_WHOLE_SIZE 0xFFFFFFFFFFFFFFFF
#define VK_QUEUE_FAMILY_IGNORED 0xFFFFFFFF
#define VK_MAX_MEMORY_TYPES 32
#define VK_MAX_MEMORY_HEAPS 16

typedef uint32_t VkFlags;
typedef uint32_t VkBool32;
typedef uint64_t VkDeviceSize;

typedef struct VkInstance_T *VkInstance;
typedef struct VkPhysicalDevice_T *VkPhysicalDevice;
typedef struct VkDevice_T *VkDevice;
typedef struct VkQueue_T *VkQueue;
typedef struct VkCommandBuffer_T *VkCommandBuffer;
typedef struct VkDeviceMemory_T *VkDeviceMemory;
typedef struct VkBuffer_T *VkBuffer;
typedef struct VkBufferView_T *VkBufferView;
typedef struct VkSampler_T *VkSampler;
typedef struct VkSemaphore_T *VkSemaphore;
typedef struct VkFence_T *VkFence;
typedef struct VkQueryPool_T *VkQueryPool;
typedef struct VkShaderModule_T *VkShaderModule;
typedef struct VkPipelineCache_T *VkPipelineCache;
typedef struct VkPipelineLayout_T *VkPipelineLayout;
typedef struct VkPipeline_T *VkPipeline;
typedef struct VkDescriptorSetLayout_T *VkDescriptorSetLayout;
typedef struct VkDescriptorPool_T *VkDescriptorPool;
typedef struct VkDescriptorSet_T *VkDescriptorSet;
typedef struct VkCommandPool_T *VkCommandPool;
typedef struct VkDebugUtilsMessengerEXT_T *VkDebugUtilsMessengerEXT;

/* Only ever passed as pointers (NULL, or unused by compute). */
typedef struct VkAllocationCallbacks VkAllocationCallbacks;
typedef struct VkDescriptorImageInfo VkDescriptorImageInfo;
typedef struct VkCopyDescriptorSet VkCopyDescriptorSet;
typedef struct VkCommandBufferInheritanceInfo VkCommandBufferInheritanceInfo;
typedef struct VkImageMemoryBarrier VkImageMemoryBarrier;

typedef enum VkResult {
    VK_SUCCESS = 0, VK_NOT_READY = 1, VK_TIMEOUT = 2, VK_EVENT_SET = 3, VK_EVENT_RESET = 4,
    VK_INCOMPLETE = 5,
    VK_ERROR_OUT_OF_HOST_MEMORY = -1, VK_ERROR_OUT_OF_DEVICE_MEMORY = -2,
    VK_ERROR_INITIALIZATION_FAILED = -3, VK_ERROR_DEVICE_LOST = -4,
    VK_ERROR_MEMORY_MAP_FAILED = -5, VK_ERROR_LAYER_NOT_PRESENT = -6,
    VK_ERROR_EXTENSION_NOT_PRESENT = -7, VK_ERROR_FEATURE_NOT_PRESENT = -8,
    VK_ERROR_INCOMPATIBLE_DRIVER = -9, VK_ERROR_TOO_MANY_OBJECTS = -10,
    VK_ERROR_FORMAT_NOT_SUPPORTED = -11, VK_ERROR_FRAGMENTED_POOL = -12, VK_ERROR_UNKNOWN = -13,
    VK_ERROR_OUT_OF_POOL_MEMORY = -1000069000, VK_ERROR_INVALID_EXTERNAL_HANDLE = -1000072003,
    VK_ERROR_FRAGMENTATION = -1000161000, VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS = -1000257000,
    VK_PIPELINE_COMPILE_REQUIRED = 1000297000,
    VK_RESULT_MAX_ENUM = 0x7FFFFFFF
} VkResult;

typedef enum VkStructureType {
    VK_STRUCTURE_TYPE_APPLICATION_INFO = 0,
    VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1,
    VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO = 2,
    VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO = 3,
    VK_STRUCTURE_TYPE_SUBMIT_INFO = 4,
    VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO = 5,
    VK_STRUCTURE_TYPE_MAPPED_MEMORY_RANGE = 6,
    VK_STRUCTURE_TYPE_FENCE_CREATE_INFO = 8,
    VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO = 11,
    VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO = 12,
    VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO = 16,
    VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO = 18,
    VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO = 29,
    VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO = 30,
    VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO = 32,
    VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO = 33,
    VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO = 34,
    VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET = 35,
    VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO = 39,
    VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO = 40,
    VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO = 42,
    VK_STRUCTURE_TYPE_BUFFER_MEMORY_BARRIER = 44,
    VK_STRUCTURE_TYPE_MEMORY_BARRIER = 46,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES = 49,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES = 51,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES = 53,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2 = 1000059000,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2 = 1000059006,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES = 1000094000,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES = 1000196000,
    VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT = 1000237000,
    VK_STRUCTURE_TYPE_DEBUG_UTILS_OBJECT_NAME_INFO_EXT = 1000128000,
    VK_STRUCTURE_TYPE_DEBUG_UTILS_LABEL_EXT = 1000128002,
    VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CALLBACK_DATA_EXT = 1000128003,
    VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT = 1000128004,
    VK_STRUCTURE_TYPE_MAX_ENUM = 0x7FFFFFFF
} VkStructureType;

typedef enum VkPhysicalDeviceType {
    VK_PHYSICAL_DEVICE_TYPE_OTHER = 0, VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU = 1,
    VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU = 2, VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU = 3,
    VK_PHYSICAL_DEVICE_TYPE_CPU = 4, VK_PHYSICAL_DEVICE_TYPE_MAX_ENUM = 0x7FFFFFFF
} VkPhysicalDeviceType;

typedef enum VkDriverId {
    VK_DRIVER_ID_MAX_ENUM = 0x7FFFFFFF     /* values are vendor ids; read as integers */
} VkDriverId;

typedef enum VkObjectType {
    VK_OBJECT_TYPE_UNKNOWN = 0, VK_OBJECT_TYPE_MAX_ENUM = 0x7FFFFFFF
} VkObjectType;

typedef enum VkSharingMode {
    VK_SHARING_MODE_EXCLUSIVE = 0, VK_SHARING_MODE_CONCURRENT = 1,
    VK_SHARING_MODE_MAX_ENUM = 0x7FFFFFFF
} VkSharingMode;

typedef enum VkDescriptorType {
    VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER = 6, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER = 7,
    VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER_DYNAMIC = 8, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER_DYNAMIC = 9,
    VK_DESCRIPTOR_TYPE_MAX_ENUM = 0x7FFFFFFF
} VkDescriptorType;

typedef enum VkPipelineBindPoint {
    VK_PIPELINE_BIND_POINT_COMPUTE = 1, VK_PIPELINE_BIND_POINT_MAX_ENUM = 0x7FFFFFFF
} VkPipelineBindPoint;

typedef enum VkCommandBufferLevel {
    VK_COMMAND_BUFFER_LEVEL_PRIMARY = 0, VK_COMMAND_BUFFER_LEVEL_SECONDARY = 1,
    VK_COMMAND_BUFFER_LEVEL_MAX_ENUM = 0x7FFFFFFF
} VkCommandBufferLevel;

typedef enum VkQueryType {
    VK_QUERY_TYPE_TIMESTAMP = 2, VK_QUERY_TYPE_MAX_ENUM = 0x7FFFFFFF
} VkQueryType;

typedef enum VkQueueFlagBits {
    VK_QUEUE_GRAPHICS_BIT = 0x1, VK_QUEUE_COMPUTE_BIT = 0x2, VK_QUEUE_TRANSFER_BIT = 0x4,
    VK_QUEUE_SPARSE_BINDING_BIT = 0x8, VK_QUEUE_PROTECTED_BIT = 0x10,
    VK_QUEUE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkQueueFlagBits;

typedef enum VkMemoryPropertyFlagBits {
    VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT = 0x1, VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT = 0x2,
    VK_MEMORY_PROPERTY_HOST_COHERENT_BIT = 0x4, VK_MEMORY_PROPERTY_HOST_CACHED_BIT = 0x8,
    VK_MEMORY_PROPERTY_LAZILY_ALLOCATED_BIT = 0x10, VK_MEMORY_PROPERTY_PROTECTED_BIT = 0x20,
    VK_MEMORY_PROPERTY_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkMemoryPropertyFlagBits;

typedef enum VkMemoryHeapFlagBits {
    VK_MEMORY_HEAP_DEVICE_LOCAL_BIT = 0x1, VK_MEMORY_HEAP_MULTI_INSTANCE_BIT = 0x2,
    VK_MEMORY_HEAP_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkMemoryHeapFlagBits;

typedef enum VkBufferUsageFlagBits {
    VK_BUFFER_USAGE_TRANSFER_SRC_BIT = 0x1, VK_BUFFER_USAGE_TRANSFER_DST_BIT = 0x2,
    VK_BUFFER_USAGE_UNIFORM_BUFFER_BIT = 0x10, VK_BUFFER_USAGE_STORAGE_BUFFER_BIT = 0x20,
    VK_BUFFER_USAGE_INDIRECT_BUFFER_BIT = 0x100,
    VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT = 0x20000,
    VK_BUFFER_USAGE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkBufferUsageFlagBits;

typedef enum VkShaderStageFlagBits {
    VK_SHADER_STAGE_COMPUTE_BIT = 0x20, VK_SHADER_STAGE_ALL = 0x7FFFFFFF
} VkShaderStageFlagBits;

typedef enum VkSubgroupFeatureFlagBits {
    VK_SUBGROUP_FEATURE_BASIC_BIT = 0x1, VK_SUBGROUP_FEATURE_VOTE_BIT = 0x2,
    VK_SUBGROUP_FEATURE_ARITHMETIC_BIT = 0x4, VK_SUBGROUP_FEATURE_BALLOT_BIT = 0x8,
    VK_SUBGROUP_FEATURE_SHUFFLE_BIT = 0x10, VK_SUBGROUP_FEATURE_SHUFFLE_RELATIVE_BIT = 0x20,
    VK_SUBGROUP_FEATURE_CLUSTERED_BIT = 0x40, VK_SUBGROUP_FEATURE_QUAD_BIT = 0x80,
    VK_SUBGROUP_FEATURE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkSubgroupFeatureFlagBits;

typedef enum VkCommandPoolCreateFlagBits {
    VK_COMMAND_POOL_CREATE_TRANSIENT_BIT = 0x1,
    VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT = 0x2,
    VK_COMMAND_POOL_CREATE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkCommandPoolCreateFlagBits;

typedef enum VkCommandBufferUsageFlagBits {
    VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT = 0x1,
    VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT = 0x4,
    VK_COMMAND_BUFFER_USAGE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkCommandBufferUsageFlagBits;

typedef enum VkDescriptorPoolCreateFlagBits {
    VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT = 0x1,
    VK_DESCRIPTOR_POOL_CREATE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkDescriptorPoolCreateFlagBits;

typedef enum VkFenceCreateFlagBits {
    VK_FENCE_CREATE_SIGNALED_BIT = 0x1, VK_FENCE_CREATE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkFenceCreateFlagBits;

typedef enum VkQueryResultFlagBits {
    VK_QUERY_RESULT_64_BIT = 0x1, VK_QUERY_RESULT_WAIT_BIT = 0x2,
    VK_QUERY_RESULT_WITH_AVAILABILITY_BIT = 0x4, VK_QUERY_RESULT_PARTIAL_BIT = 0x8,
    VK_QUERY_RESULT_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkQueryResultFlagBits;

typedef enum VkPipelineStageFlagBits {
    VK_PIPELINE_STAGE_NONE = 0, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT = 0x1,
    VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT = 0x800, VK_PIPELINE_STAGE_TRANSFER_BIT = 0x1000,
    VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT = 0x2000, VK_PIPELINE_STAGE_HOST_BIT = 0x4000,
    VK_PIPELINE_STAGE_ALL_COMMANDS_BIT = 0x10000,
    VK_PIPELINE_STAGE_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkPipelineStageFlagBits;

typedef enum VkAccessFlagBits {
    VK_ACCESS_NONE = 0, VK_ACCESS_INDIRECT_COMMAND_READ_BIT = 0x1,
    VK_ACCESS_UNIFORM_READ_BIT = 0x8, VK_ACCESS_SHADER_READ_BIT = 0x20,
    VK_ACCESS_SHADER_WRITE_BIT = 0x40, VK_ACCESS_TRANSFER_READ_BIT = 0x800,
    VK_ACCESS_TRANSFER_WRITE_BIT = 0x1000, VK_ACCESS_HOST_READ_BIT = 0x2000,
    VK_ACCESS_HOST_WRITE_BIT = 0x4000, VK_ACCESS_MEMORY_READ_BIT = 0x8000,
    VK_ACCESS_MEMORY_WRITE_BIT = 0x10000, VK_ACCESS_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkAccessFlagBits;

typedef enum VkDependencyFlagBits {
    VK_DEPENDENCY_BY_REGION_BIT = 0x1, VK_DEPENDENCY_FLAG_BITS_MAX_ENUM = 0x7FFFFFFF
} VkDependencyFlagBits;

typedef enum VkDebugUtilsMessageSeverityFlagBitsEXT {
    VK_DEBUG_UTILS_MESSAGE_SEVERITY_VERBOSE_BIT_EXT = 0x1,
    VK_DEBUG_UTILS_MESSAGE_SEVERITY_INFO_BIT_EXT = 0x10,
    VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT = 0x100,
    VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT = 0x1000,
    VK_DEBUG_UTILS_MESSAGE_SEVERITY_FLAG_BITS_MAX_ENUM_EXT = 0x7FFFFFFF
} VkDebugUtilsMessageSeverityFlagBitsEXT;

typedef enum VkDebugUtilsMessageTypeFlagBitsEXT {
    VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT = 0x1,
    VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT = 0x2,
    VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT = 0x4,
    VK_DEBUG_UTILS_MESSAGE_TYPE_FLAG_BITS_MAX_ENUM_EXT = 0x7FFFFFFF
} VkDebugUtilsMessageTypeFlagBitsEXT;

typedef VkFlags VkInstanceCreateFlags, VkDeviceCreateFlags, VkDeviceQueueCreateFlags, VkQueueFlags,
    VkMemoryPropertyFlags, VkMemoryHeapFlags, VkMemoryMapFlags, VkSampleCountFlags,
    VkBufferCreateFlags, VkBufferUsageFlags, VkShaderStageFlags, VkSubgroupFeatureFlags,
    VkDescriptorSetLayoutCreateFlags, VkDescriptorPoolCreateFlags, VkShaderModuleCreateFlags,
    VkPipelineLayoutCreateFlags, VkPipelineCreateFlags, VkPipelineShaderStageCreateFlags,
    VkCommandPoolCreateFlags, VkCommandBufferUsageFlags, VkCommandBufferResetFlags,
    VkPipelineStageFlags, VkAccessFlags, VkDependencyFlags, VkFenceCreateFlags,
    VkQueryPoolCreateFlags, VkQueryPipelineStatisticFlags, VkQueryResultFlags,
    VkDebugUtilsMessengerCreateFlagsEXT, VkDebugUtilsMessageSeverityFlagsEXT,
    VkDebugUtilsMessageTypeFlagsEXT, VkDebugUtilsMessengerCallbackDataFlagsEXT;

/* Instance, layers, extensions */
typedef struct VkApplicationInfo {
    VkStructureType sType; const void *pNext;
    const char *pApplicationName; uint32_t applicationVersion;
    const char *pEngineName; uint32_t engineVersion;
    uint32_t apiVersion;
} VkApplicationInfo;

typedef struct VkInstanceCreateInfo {
    VkStructureType sType; const void *pNext;
    VkInstanceCreateFlags flags;
    const VkApplicationInfo *pApplicationInfo;
    uint32_t enabledLayerCount; const char *const *ppEnabledLayerNames;
    uint32_t enabledExtensionCount; const char *const *ppEnabledExtensionNames;
} VkInstanceCreateInfo;

typedef struct VkLayerProperties {
    char layerName[256]; uint32_t specVersion; uint32_t implementationVersion;
    char description[256];
} VkLayerProperties;

typedef struct VkExtensionProperties {
    char extensionName[256]; uint32_t specVersion;
} VkExtensionProperties;

/* Physical device properties */
typedef struct VkPhysicalDeviceLimits {
    uint32_t maxImageDimension1D, maxImageDimension2D, maxImageDimension3D,
        maxImageDimensionCube, maxImageArrayLayers, maxTexelBufferElements,
        maxUniformBufferRange, maxStorageBufferRange, maxPushConstantsSize,
        maxMemoryAllocationCount, maxSamplerAllocationCount;
    VkDeviceSize bufferImageGranularity, sparseAddressSpaceSize;
    uint32_t maxBoundDescriptorSets, maxPerStageDescriptorSamplers,
        maxPerStageDescriptorUniformBuffers, maxPerStageDescriptorStorageBuffers,
        maxPerStageDescriptorSampledImages, maxPerStageDescriptorStorageImages,
        maxPerStageDescriptorInputAttachments, maxPerStageResources,
        maxDescriptorSetSamplers, maxDescriptorSetUniformBuffers,
        maxDescriptorSetUniformBuffersDynamic, maxDescriptorSetStorageBuffers,
        maxDescriptorSetStorageBuffersDynamic, maxDescriptorSetSampledImages,
        maxDescriptorSetStorageImages, maxDescriptorSetInputAttachments,
        maxVertexInputAttributes, maxVertexInputBindings, maxVertexInputAttributeOffset,
        maxVertexInputBindingStride, maxVertexOutputComponents,
        maxTessellationGenerationLevel, maxTessellationPatchSize,
        maxTessellationControlPerVertexInputComponents,
        maxTessellationControlPerVertexOutputComponents,
        maxTessellationControlPerPatchOutputComponents,
        maxTessellationControlTotalOutputComponents,
        maxTessellationEvaluationInputComponents, maxTessellationEvaluationOutputComponents,
        maxGeometryShaderInvocations, maxGeometryInputComponents, maxGeometryOutputComponents,
        maxGeometryOutputVertices, maxGeometryTotalOutputComponents,
        maxFragmentInputComponents, maxFragmentOutputAttachments,
        maxFragmentDualSrcAttachments, maxFragmentCombinedOutputResources,
        maxComputeSharedMemorySize, maxComputeWorkGroupCount[3],
        maxComputeWorkGroupInvocations, maxComputeWorkGroupSize[3],
        subPixelPrecisionBits, subTexelPrecisionBits, mipmapPrecisionBits,
        maxDrawIndexedIndexValue, maxDrawIndirectCount;
    float maxSamplerLodBias, maxSamplerAnisotropy;
    uint32_t maxViewports, maxViewportDimensions[2];
    float viewportBoundsRange[2];
    uint32_t viewportSubPixelBits;
    size_t minMemoryMapAlignment;
    VkDeviceSize minTexelBufferOffsetAlignment, minUniformBufferOffsetAlignment,
        minStorageBufferOffsetAlignment;
    int32_t minTexelOffset; uint32_t maxTexelOffset;
    int32_t minTexelGatherOffset; uint32_t maxTexelGatherOffset;
    float minInterpolationOffset, maxInterpolationOffset;
    uint32_t subPixelInterpolationOffsetBits, maxFramebufferWidth, maxFramebufferHeight,
        maxFramebufferLayers;
    VkSampleCountFlags framebufferColorSampleCounts, framebufferDepthSampleCounts,
        framebufferStencilSampleCounts, framebufferNoAttachmentsSampleCounts;
    uint32_t maxColorAttachments;
    VkSampleCountFlags sampledImageColorSampleCounts, sampledImageIntegerSampleCounts,
        sampledImageDepthSampleCounts, sampledImageStencilSampleCounts,
        storageImageSampleCounts;
    uint32_t maxSampleMaskWords;
    VkBool32 timestampComputeAndGraphics;
    float timestampPeriod;
    uint32_t maxClipDistances, maxCullDistances, maxCombinedClipAndCullDistances,
        discreteQueuePriorities;
    float pointSizeRange[2], lineWidthRange[2], pointSizeGranularity, lineWidthGranularity;
    VkBool32 strictLines, standardSampleLocations;
    VkDeviceSize optimalBufferCopyOffsetAlignment, optimalBufferCopyRowPitchAlignment,
        nonCoherentAtomSize;
} VkPhysicalDeviceLimits;

typedef struct VkPhysicalDeviceSparseProperties {
    VkBool32 residencyStandard2DBlockShape, residencyStandard2DMultisampleBlockShape,
        residencyStandard3DBlockShape, residencyAlignedMipSize, residencyNonResidentStrict;
} VkPhysicalDeviceSparseProperties;

typedef struct VkPhysicalDeviceProperties {
    uint32_t apiVersion, driverVersion, vendorID, deviceID;
    VkPhysicalDeviceType deviceType;
    char deviceName[256];
    uint8_t pipelineCacheUUID[16];
    VkPhysicalDeviceLimits limits;
    VkPhysicalDeviceSparseProperties sparseProperties;
} VkPhysicalDeviceProperties;

typedef struct VkPhysicalDeviceProperties2 {
    VkStructureType sType; void *pNext;
    VkPhysicalDeviceProperties properties;
} VkPhysicalDeviceProperties2;

typedef struct VkPhysicalDeviceSubgroupProperties {
    VkStructureType sType; void *pNext;
    uint32_t subgroupSize;
    VkShaderStageFlags supportedStages;
    VkSubgroupFeatureFlags supportedOperations;
    VkBool32 quadOperationsInAllStages;
} VkPhysicalDeviceSubgroupProperties;

typedef struct VkConformanceVersion {
    uint8_t major, minor, subminor, patch;
} VkConformanceVersion;

typedef struct VkPhysicalDeviceDriverProperties {
    VkStructureType sType; void *pNext;
    VkDriverId driverID;
    char driverName[256];
    char driverInfo[256];
    VkConformanceVersion conformanceVersion;
} VkPhysicalDeviceDriverProperties;

/* Features */
typedef struct VkPhysicalDeviceFeatures {
    VkBool32 robustBufferAccess, fullDrawIndexUint32, imageCubeArray, independentBlend,
        geometryShader, tessellationShader, sampleRateShading, dualSrcBlend, logicOp,
        multiDrawIndirect, drawIndirectFirstInstance, depthClamp, depthBiasClamp,
        fillModeNonSolid, depthBounds, wideLines, largePoints, alphaToOne, multiViewport,
        samplerAnisotropy, textureCompressionETC2, textureCompressionASTC_LDR,
        textureCompressionBC, occlusionQueryPrecise, pipelineStatisticsQuery,
        vertexPipelineStoresAndAtomics, fragmentStoresAndAtomics,
        shaderTessellationAndGeometryPointSize, shaderImageGatherExtended,
        shaderStorageImageExtendedFormats, shaderStorageImageMultisample,
        shaderStorageImageReadWithoutFormat, shaderStorageImageWriteWithoutFormat,
        shaderUniformBufferArrayDynamicIndexing, shaderSampledImageArrayDynamicIndexing,
        shaderStorageBufferArrayDynamicIndexing, shaderStorageImageArrayDynamicIndexing,
        shaderClipDistance, shaderCullDistance, shaderFloat64, shaderInt64, shaderInt16,
        shaderResourceResidency, shaderResourceMinLod, sparseBinding, sparseResidencyBuffer,
        sparseResidencyImage2D, sparseResidencyImage3D, sparseResidency2Samples,
        sparseResidency4Samples, sparseResidency8Samples, sparseResidency16Samples,
        sparseResidencyAliased, variableMultisampleRate, inheritedQueries;
} VkPhysicalDeviceFeatures;

typedef struct VkPhysicalDeviceFeatures2 {
    VkStructureType sType; void *pNext;
    VkPhysicalDeviceFeatures features;
} VkPhysicalDeviceFeatures2;

typedef struct VkPhysicalDeviceVulkan11Features {
    VkStructureType sType; void *pNext;
    VkBool32 storageBuffer16BitAccess, uniformAndStorageBuffer16BitAccess,
        storagePushConstant16, storageInputOutput16, multiview, multiviewGeometryShader,
        multiviewTessellationShader, variablePointersStorageBuffer, variablePointers,
        protectedMemory, samplerYcbcrConversion, shaderDrawParameters;
} VkPhysicalDeviceVulkan11Features;

typedef struct VkPhysicalDeviceVulkan12Features {
    VkStructureType sType; void *pNext;
    VkBool32 samplerMirrorClampToEdge, drawIndirectCount, storageBuffer8BitAccess,
        uniformAndStorageBuffer8BitAccess, storagePushConstant8, shaderBufferInt64Atomics,
        shaderSharedInt64Atomics, shaderFloat16, shaderInt8, descriptorIndexing,
        shaderInputAttachmentArrayDynamicIndexing, shaderUniformTexelBufferArrayDynamicIndexing,
        shaderStorageTexelBufferArrayDynamicIndexing, shaderUniformBufferArrayNonUniformIndexing,
        shaderSampledImageArrayNonUniformIndexing, shaderStorageBufferArrayNonUniformIndexing,
        shaderStorageImageArrayNonUniformIndexing, shaderInputAttachmentArrayNonUniformIndexing,
        shaderUniformTexelBufferArrayNonUniformIndexing,
        shaderStorageTexelBufferArrayNonUniformIndexing,
        descriptorBindingUniformBufferUpdateAfterBind, descriptorBindingSampledImageUpdateAfterBind,
        descriptorBindingStorageImageUpdateAfterBind, descriptorBindingStorageBufferUpdateAfterBind,
        descriptorBindingUniformTexelBufferUpdateAfterBind,
        descriptorBindingStorageTexelBufferUpdateAfterBind,
        descriptorBindingUpdateUnusedWhilePending, descriptorBindingPartiallyBound,
        descriptorBindingVariableDescriptorCount, runtimeDescriptorArray, samplerFilterMinmax,
        scalarBlockLayout, imagelessFramebuffer, uniformBufferStandardLayout,
        shaderSubgroupExtendedTypes, separateDepthStencilLayouts, hostQueryReset,
        timelineSemaphore, bufferDeviceAddress, bufferDeviceAddressCaptureReplay,
        bufferDeviceAddressMultiDevice, vulkanMemoryModel, vulkanMemoryModelDeviceScope,
        vulkanMemoryModelAvailabilityVisibilityChains, shaderOutputViewportIndex,
        shaderOutputLayer, subgroupBroadcastDynamicId;
} VkPhysicalDeviceVulkan12Features;

typedef struct VkPhysicalDeviceVulkan13Features {
    VkStructureType sType; void *pNext;
    VkBool32 robustImageAccess, inlineUniformBlock,
        descriptorBindingInlineUniformBlockUpdateAfterBind, pipelineCreationCacheControl,
        privateData, shaderDemoteToHelperInvocation, shaderTerminateInvocation,
        subgroupSizeControl, computeFullSubgroups, synchronization2,
        textureCompressionASTC_HDR, shaderZeroInitializeWorkgroupMemory, dynamicRendering,
        shaderIntegerDotProduct, maintenance4;
} VkPhysicalDeviceVulkan13Features;

/* Memory and queue families */
typedef struct VkMemoryType {
    VkMemoryPropertyFlags propertyFlags; uint32_t heapIndex;
} VkMemoryType;

typedef struct VkMemoryHeap {
    VkDeviceSize size; VkMemoryHeapFlags flags;
} VkMemoryHeap;

typedef struct VkPhysicalDeviceMemoryProperties {
    uint32_t memoryTypeCount; VkMemoryType memoryTypes[32];
    uint32_t memoryHeapCount; VkMemoryHeap memoryHeaps[16];
} VkPhysicalDeviceMemoryProperties;

typedef struct VkPhysicalDeviceMemoryProperties2 {
    VkStructureType sType; void *pNext;
    VkPhysicalDeviceMemoryProperties memoryProperties;
} VkPhysicalDeviceMemoryProperties2;

typedef struct VkPhysicalDeviceMemoryBudgetPropertiesEXT {
    VkStructureType sType; void *pNext;
    VkDeviceSize heapBudget[16]; VkDeviceSize heapUsage[16];
} VkPhysicalDeviceMemoryBudgetPropertiesEXT;

typedef struct VkExtent3D { uint32_t width, height, depth; } VkExtent3D;

typedef struct VkQueueFamilyProperties {
    VkQueueFlags queueFlags; uint32_t queueCount; uint32_t timestampValidBits;
    VkExtent3D minImageTransferGranularity;
} VkQueueFamilyProperties;

/* Device */
typedef struct VkDeviceQueueCreateInfo {
    VkStructureType sType; const void *pNext;
    VkDeviceQueueCreateFlags flags;
    uint32_t queueFamilyIndex; uint32_t queueCount; const float *pQueuePriorities;
} VkDeviceQueueCreateInfo;

typedef struct VkDeviceCreateInfo {
    VkStructureType sType; const void *pNext;
    VkDeviceCreateFlags flags;
    uint32_t queueCreateInfoCount; const VkDeviceQueueCreateInfo *pQueueCreateInfos;
    uint32_t enabledLayerCount; const char *const *ppEnabledLayerNames;
    uint32_t enabledExtensionCount; const char *const *ppEnabledExtensionNames;
    const VkPhysicalDeviceFeatures *pEnabledFeatures;
} VkDeviceCreateInfo;

/* Buffers and memory */
typedef struct VkBufferCreateInfo {
    VkStructureType sType; const void *pNext;
    VkBufferCreateFlags flags; VkDeviceSize size; VkBufferUsageFlags usage;
    VkSharingMode sharingMode;
    uint32_t queueFamilyIndexCount; const uint32_t *pQueueFamilyIndices;
} VkBufferCreateInfo;

typedef struct VkMemoryRequirements {
    VkDeviceSize size; VkDeviceSize alignment; uint32_t memoryTypeBits;
} VkMemoryRequirements;

typedef struct VkMemoryAllocateInfo {
    VkStructureType sType; const void *pNext;
    VkDeviceSize allocationSize; uint32_t memoryTypeIndex;
} VkMemoryAllocateInfo;

typedef struct VkMappedMemoryRange {
    VkStructureType sType; const void *pNext;
    VkDeviceMemory memory; VkDeviceSize offset; VkDeviceSize size;
} VkMappedMemoryRange;

/* Descriptors */
typedef struct VkDescriptorSetLayoutBinding {
    uint32_t binding; VkDescriptorType descriptorType; uint32_t descriptorCount;
    VkShaderStageFlags stageFlags; const VkSampler *pImmutableSamplers;
} VkDescriptorSetLayoutBinding;

typedef struct VkDescriptorSetLayoutCreateInfo {
    VkStructureType sType; const void *pNext;
    VkDescriptorSetLayoutCreateFlags flags;
    uint32_t bindingCount; const VkDescriptorSetLayoutBinding *pBindings;
} VkDescriptorSetLayoutCreateInfo;

typedef struct VkDescriptorPoolSize {
    VkDescriptorType type; uint32_t descriptorCount;
} VkDescriptorPoolSize;

typedef struct VkDescriptorPoolCreateInfo {
    VkStructureType sType; const void *pNext;
    VkDescriptorPoolCreateFlags flags; uint32_t maxSets;
    uint32_t poolSizeCount; const VkDescriptorPoolSize *pPoolSizes;
} VkDescriptorPoolCreateInfo;

typedef struct VkDescriptorSetAllocateInfo {
    VkStructureType sType; const void *pNext;
    VkDescriptorPool descriptorPool;
    uint32_t descriptorSetCount; const VkDescriptorSetLayout *pSetLayouts;
} VkDescriptorSetAllocateInfo;

typedef struct VkDescriptorBufferInfo {
    VkBuffer buffer; VkDeviceSize offset; VkDeviceSize range;
} VkDescriptorBufferInfo;

typedef struct VkWriteDescriptorSet {
    VkStructureType sType; const void *pNext;
    VkDescriptorSet dstSet; uint32_t dstBinding; uint32_t dstArrayElement;
    uint32_t descriptorCount; VkDescriptorType descriptorType;
    const VkDescriptorImageInfo *pImageInfo;
    const VkDescriptorBufferInfo *pBufferInfo;
    const VkBufferView *pTexelBufferView;
} VkWriteDescriptorSet;

/* Shaders and pipelines */
typedef struct VkShaderModuleCreateInfo {
    VkStructureType sType; const void *pNext;
    VkShaderModuleCreateFlags flags; size_t codeSize; const uint32_t *pCode;
} VkShaderModuleCreateInfo;

typedef struct VkPushConstantRange {
    VkShaderStageFlags stageFlags; uint32_t offset; uint32_t size;
} VkPushConstantRange;

typedef struct VkPipelineLayoutCreateInfo {
    VkStructureType sType; const void *pNext;
    VkPipelineLayoutCreateFlags flags;
    uint32_t setLayoutCount; const VkDescriptorSetLayout *pSetLayouts;
    uint32_t pushConstantRangeCount; const VkPushConstantRange *pPushConstantRanges;
} VkPipelineLayoutCreateInfo;

typedef struct VkSpecializationMapEntry {
    uint32_t constantID; uint32_t offset; size_t size;
} VkSpecializationMapEntry;

typedef struct VkSpecializationInfo {
    uint32_t mapEntryCount; const VkSpecializationMapEntry *pMapEntries;
    size_t dataSize; const void *pData;
} VkSpecializationInfo;

typedef struct VkPipelineShaderStageCreateInfo {
    VkStructureType sType; const void *pNext;
    VkPipelineShaderStageCreateFlags flags; VkShaderStageFlagBits stage;
    VkShaderModule module; const char *pName;
    const VkSpecializationInfo *pSpecializationInfo;
} VkPipelineShaderStageCreateInfo;

typedef struct VkComputePipelineCreateInfo {
    VkStructureType sType; const void *pNext;
    VkPipelineCreateFlags flags; VkPipelineShaderStageCreateInfo stage;
    VkPipelineLayout layout; VkPipeline basePipelineHandle; int32_t basePipelineIndex;
} VkComputePipelineCreateInfo;

/* Commands, synchronisation, submission, queries */
typedef struct VkCommandPoolCreateInfo {
    VkStructureType sType; const void *pNext;
    VkCommandPoolCreateFlags flags; uint32_t queueFamilyIndex;
} VkCommandPoolCreateInfo;

typedef struct VkCommandBufferAllocateInfo {
    VkStructureType sType; const void *pNext;
    VkCommandPool commandPool; VkCommandBufferLevel level; uint32_t commandBufferCount;
} VkCommandBufferAllocateInfo;

typedef struct VkCommandBufferBeginInfo {
    VkStructureType sType; const void *pNext;
    VkCommandBufferUsageFlags flags;
    const VkCommandBufferInheritanceInfo *pInheritanceInfo;
} VkCommandBufferBeginInfo;

typedef struct VkMemoryBarrier {
    VkStructureType sType; const void *pNext;
    VkAccessFlags srcAccessMask; VkAccessFlags dstAccessMask;
} VkMemoryBarrier;

typedef struct VkBufferMemoryBarrier {
    VkStructureType sType; const void *pNext;
    VkAccessFlags srcAccessMask; VkAccessFlags dstAccessMask;
    uint32_t srcQueueFamilyIndex; uint32_t dstQueueFamilyIndex;
    VkBuffer buffer; VkDeviceSize offset; VkDeviceSize size;
} VkBufferMemoryBarrier;

typedef struct VkBufferCopy {
    VkDeviceSize srcOffset; VkDeviceSize dstOffset; VkDeviceSize size;
} VkBufferCopy;

typedef struct VkSubmitInfo {
    VkStructureType sType; const void *pNext;
    uint32_t waitSemaphoreCount; const VkSemaphore *pWaitSemaphores;
    const VkPipelineStageFlags *pWaitDstStageMask;
    uint32_t commandBufferCount; const VkCommandBuffer *pCommandBuffers;
    uint32_t signalSemaphoreCount; const VkSemaphore *pSignalSemaphores;
} VkSubmitInfo;

typedef struct VkFenceCreateInfo {
    VkStructureType sType; const void *pNext; VkFenceCreateFlags flags;
} VkFenceCreateInfo;

typedef struct VkQueryPoolCreateInfo {
    VkStructureType sType; const void *pNext;
    VkQueryPoolCreateFlags flags; VkQueryType queryType; uint32_t queryCount;
    VkQueryPipelineStatisticFlags pipelineStatistics;
} VkQueryPoolCreateInfo;

/* VK_EXT_debug_utils (validation messages) */
typedef struct VkDebugUtilsLabelEXT {
    VkStructureType sType; const void *pNext;
    const char *pLabelName; float color[4];
} VkDebugUtilsLabelEXT;

typedef struct VkDebugUtilsObjectNameInfoEXT {
    VkStructureType sType; const void *pNext;
    VkObjectType objectType; uint64_t objectHandle; const char *pObjectName;
} VkDebugUtilsObjectNameInfoEXT;

typedef struct VkDebugUtilsMessengerCallbackDataEXT {
    VkStructureType sType; const void *pNext;
    VkDebugUtilsMessengerCallbackDataFlagsEXT flags;
    const char *pMessageIdName; int32_t messageIdNumber; const char *pMessage;
    uint32_t queueLabelCount; const VkDebugUtilsLabelEXT *pQueueLabels;
    uint32_t cmdBufLabelCount; const VkDebugUtilsLabelEXT *pCmdBufLabels;
    uint32_t objectCount; const VkDebugUtilsObjectNameInfoEXT *pObjects;
} VkDebugUtilsMessengerCallbackDataEXT;

typedef VkBool32 (*PFN_vkDebugUtilsMessengerCallbackEXT)(
    VkDebugUtilsMessageSeverityFlagBitsEXT messageSeverity,
    VkDebugUtilsMessageTypeFlagsEXT messageTypes,
    const VkDebugUtilsMessengerCallbackDataEXT *pCallbackData, void *pUserData);

typedef struct VkDebugUtilsMessengerCreateInfoEXT {
    VkStructureType sType; const void *pNext;
    VkDebugUtilsMessengerCreateFlagsEXT flags;
    VkDebugUtilsMessageSeverityFlagsEXT messageSeverity;
    VkDebugUtilsMessageTypeFlagsEXT messageType;
    PFN_vkDebugUtilsMessengerCallbackEXT pfnUserCallback;
    void *pUserData;
} VkDebugUtilsMessengerCreateInfoEXT;

typedef void (*PFN_vkVoidFunction)(void);
typedef VkResult (*PFN_vkCreateDebugUtilsMessengerEXT)(VkInstance instance,
    const VkDebugUtilsMessengerCreateInfoEXT *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkDebugUtilsMessengerEXT *pMessenger);
typedef void (*PFN_vkDestroyDebugUtilsMessengerEXT)(VkInstance instance,
    VkDebugUtilsMessengerEXT messenger, const VkAllocationCallbacks *pAllocator);

/* Functions: instance and physical device */
PFN_vkVoidFunction vkGetInstanceProcAddr(VkInstance instance, const char *pName);
VkResult vkEnumerateInstanceVersion(uint32_t *pApiVersion);
VkResult vkEnumerateInstanceLayerProperties(uint32_t *pPropertyCount,
    VkLayerProperties *pProperties);
VkResult vkCreateInstance(const VkInstanceCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkInstance *pInstance);
void vkDestroyInstance(VkInstance instance, const VkAllocationCallbacks *pAllocator);
VkResult vkEnumeratePhysicalDevices(VkInstance instance, uint32_t *pPhysicalDeviceCount,
    VkPhysicalDevice *pPhysicalDevices);
void vkGetPhysicalDeviceProperties2(VkPhysicalDevice physicalDevice,
    VkPhysicalDeviceProperties2 *pProperties);
void vkGetPhysicalDeviceFeatures2(VkPhysicalDevice physicalDevice,
    VkPhysicalDeviceFeatures2 *pFeatures);
void vkGetPhysicalDeviceMemoryProperties2(VkPhysicalDevice physicalDevice,
    VkPhysicalDeviceMemoryProperties2 *pMemoryProperties);
void vkGetPhysicalDeviceQueueFamilyProperties(VkPhysicalDevice physicalDevice,
    uint32_t *pQueueFamilyPropertyCount, VkQueueFamilyProperties *pQueueFamilyProperties);
VkResult vkEnumerateDeviceExtensionProperties(VkPhysicalDevice physicalDevice,
    const char *pLayerName, uint32_t *pPropertyCount, VkExtensionProperties *pProperties);

/* Functions: device and queue */
VkResult vkCreateDevice(VkPhysicalDevice physicalDevice, const VkDeviceCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkDevice *pDevice);
void vkDestroyDevice(VkDevice device, const VkAllocationCallbacks *pAllocator);
VkResult vkDeviceWaitIdle(VkDevice device);
void vkGetDeviceQueue(VkDevice device, uint32_t queueFamilyIndex, uint32_t queueIndex,
    VkQueue *pQueue);
VkResult vkQueueSubmit(VkQueue queue, uint32_t submitCount, const VkSubmitInfo *pSubmits,
    VkFence fence);
VkResult vkQueueWaitIdle(VkQueue queue);

/* Functions: buffers and memory */
VkResult vkCreateBuffer(VkDevice device, const VkBufferCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkBuffer *pBuffer);
void vkDestroyBuffer(VkDevice device, VkBuffer buffer, const VkAllocationCallbacks *pAllocator);
void vkGetBufferMemoryRequirements(VkDevice device, VkBuffer buffer,
    VkMemoryRequirements *pMemoryRequirements);
VkResult vkAllocateMemory(VkDevice device, const VkMemoryAllocateInfo *pAllocateInfo,
    const VkAllocationCallbacks *pAllocator, VkDeviceMemory *pMemory);
void vkFreeMemory(VkDevice device, VkDeviceMemory memory,
    const VkAllocationCallbacks *pAllocator);
VkResult vkBindBufferMemory(VkDevice device, VkBuffer buffer, VkDeviceMemory memory,
    VkDeviceSize memoryOffset);
VkResult vkMapMemory(VkDevice device, VkDeviceMemory memory, VkDeviceSize offset,
    VkDeviceSize size, VkMemoryMapFlags flags, void **ppData);
void vkUnmapMemory(VkDevice device, VkDeviceMemory memory);
VkResult vkFlushMappedMemoryRanges(VkDevice device, uint32_t memoryRangeCount,
    const VkMappedMemoryRange *pMemoryRanges);
VkResult vkInvalidateMappedMemoryRanges(VkDevice device, uint32_t memoryRangeCount,
    const VkMappedMemoryRange *pMemoryRanges);

/* Functions: descriptors */
VkResult vkCreateDescriptorSetLayout(VkDevice device,
    const VkDescriptorSetLayoutCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkDescriptorSetLayout *pSetLayout);
void vkDestroyDescriptorSetLayout(VkDevice device, VkDescriptorSetLayout descriptorSetLayout,
    const VkAllocationCallbacks *pAllocator);
VkResult vkCreateDescriptorPool(VkDevice device, const VkDescriptorPoolCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkDescriptorPool *pDescriptorPool);
void vkDestroyDescriptorPool(VkDevice device, VkDescriptorPool descriptorPool,
    const VkAllocationCallbacks *pAllocator);
VkResult vkAllocateDescriptorSets(VkDevice device, const VkDescriptorSetAllocateInfo *pAllocateInfo,
    VkDescriptorSet *pDescriptorSets);
VkResult vkFreeDescriptorSets(VkDevice device, VkDescriptorPool descriptorPool,
    uint32_t descriptorSetCount, const VkDescriptorSet *pDescriptorSets);
void vkUpdateDescriptorSets(VkDevice device, uint32_t descriptorWriteCount,
    const VkWriteDescriptorSet *pDescriptorWrites, uint32_t descriptorCopyCount,
    const VkCopyDescriptorSet *pDescriptorCopies);

/* Functions: shaders and pipelines */
VkResult vkCreateShaderModule(VkDevice device, const VkShaderModuleCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkShaderModule *pShaderModule);
void vkDestroyShaderModule(VkDevice device, VkShaderModule shaderModule,
    const VkAllocationCallbacks *pAllocator);
VkResult vkCreatePipelineLayout(VkDevice device, const VkPipelineLayoutCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkPipelineLayout *pPipelineLayout);
void vkDestroyPipelineLayout(VkDevice device, VkPipelineLayout pipelineLayout,
    const VkAllocationCallbacks *pAllocator);
VkResult vkCreateComputePipelines(VkDevice device, VkPipelineCache pipelineCache,
    uint32_t createInfoCount, const VkComputePipelineCreateInfo *pCreateInfos,
    const VkAllocationCallbacks *pAllocator, VkPipeline *pPipelines);
void vkDestroyPipeline(VkDevice device, VkPipeline pipeline,
    const VkAllocationCallbacks *pAllocator);

/* Functions: command pools and buffers */
VkResult vkCreateCommandPool(VkDevice device, const VkCommandPoolCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkCommandPool *pCommandPool);
void vkDestroyCommandPool(VkDevice device, VkCommandPool commandPool,
    const VkAllocationCallbacks *pAllocator);
VkResult vkAllocateCommandBuffers(VkDevice device, const VkCommandBufferAllocateInfo *pAllocateInfo,
    VkCommandBuffer *pCommandBuffers);
void vkFreeCommandBuffers(VkDevice device, VkCommandPool commandPool,
    uint32_t commandBufferCount, const VkCommandBuffer *pCommandBuffers);
VkResult vkBeginCommandBuffer(VkCommandBuffer commandBuffer,
    const VkCommandBufferBeginInfo *pBeginInfo);
VkResult vkEndCommandBuffer(VkCommandBuffer commandBuffer);
VkResult vkResetCommandBuffer(VkCommandBuffer commandBuffer, VkCommandBufferResetFlags flags);

/* Functions: recorded commands */
void vkCmdBindPipeline(VkCommandBuffer commandBuffer, VkPipelineBindPoint pipelineBindPoint,
    VkPipeline pipeline);
void vkCmdBindDescriptorSets(VkCommandBuffer commandBuffer, VkPipelineBindPoint pipelineBindPoint,
    VkPipelineLayout layout, uint32_t firstSet, uint32_t descriptorSetCount,
    const VkDescriptorSet *pDescriptorSets, uint32_t dynamicOffsetCount,
    const uint32_t *pDynamicOffsets);
void vkCmdPushConstants(VkCommandBuffer commandBuffer, VkPipelineLayout layout,
    VkShaderStageFlags stageFlags, uint32_t offset, uint32_t size, const void *pValues);
void vkCmdDispatch(VkCommandBuffer commandBuffer, uint32_t groupCountX, uint32_t groupCountY,
    uint32_t groupCountZ);
void vkCmdPipelineBarrier(VkCommandBuffer commandBuffer, VkPipelineStageFlags srcStageMask,
    VkPipelineStageFlags dstStageMask, VkDependencyFlags dependencyFlags,
    uint32_t memoryBarrierCount, const VkMemoryBarrier *pMemoryBarriers,
    uint32_t bufferMemoryBarrierCount, const VkBufferMemoryBarrier *pBufferMemoryBarriers,
    uint32_t imageMemoryBarrierCount, const VkImageMemoryBarrier *pImageMemoryBarriers);
void vkCmdCopyBuffer(VkCommandBuffer commandBuffer, VkBuffer srcBuffer, VkBuffer dstBuffer,
    uint32_t regionCount, const VkBufferCopy *pRegions);
void vkCmdFillBuffer(VkCommandBuffer commandBuffer, VkBuffer dstBuffer, VkDeviceSize dstOffset,
    VkDeviceSize size, uint32_t data);
void vkCmdResetQueryPool(VkCommandBuffer commandBuffer, VkQueryPool queryPool,
    uint32_t firstQuery, uint32_t queryCount);
void vkCmdWriteTimestamp(VkCommandBuffer commandBuffer, VkPipelineStageFlagBits pipelineStage,
    VkQueryPool queryPool, uint32_t query);

/* Functions: fences and queries */
VkResult vkCreateFence(VkDevice device, const VkFenceCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkFence *pFence);
void vkDestroyFence(VkDevice device, VkFence fence, const VkAllocationCallbacks *pAllocator);
VkResult vkWaitForFences(VkDevice device, uint32_t fenceCount, const VkFence *pFences,
    VkBool32 waitAll, uint64_t timeout);
VkResult vkGetFenceStatus(VkDevice device, VkFence fence);
VkResult vkResetFences(VkDevice device, uint32_t fenceCount, const VkFence *pFences);
VkResult vkCreateQueryPool(VkDevice device, const VkQueryPoolCreateInfo *pCreateInfo,
    const VkAllocationCallbacks *pAllocator, VkQueryPool *pQueryPool);
void vkDestroyQueryPool(VkDevice device, VkQueryPool queryPool,
    const VkAllocationCallbacks *pAllocator);
VkResult vkGetQueryPoolResults(VkDevice device, VkQueryPool queryPool, uint32_t firstQuery,
    uint32_t queryCount, size_t dataSize, void *pData, VkDeviceSize stride,
    VkQueryResultFlags flags);
"""

ffi = FFI()
ffi.cdef(_CDEF)

# The VkResults the calls declared here can return (those of VkResult, and the validation layer's
# and NVIDIA's shader compiler's own), with their meaning as the specification's "Return Codes"
# section gives it (error codes are negative; positive codes are successes that still say
# something). Another code is named by its number.
RESULTS = {
    0: ("VK_SUCCESS", "command successfully completed"),
    1: ("VK_NOT_READY", "a fence or query has not yet completed"),
    2: ("VK_TIMEOUT", "a wait operation has not completed in the specified time"),
    3: ("VK_EVENT_SET", "an event is signaled"),
    4: ("VK_EVENT_RESET", "an event is unsignaled"),
    5: ("VK_INCOMPLETE", "a return array was too small for the result"),
    -1: ("VK_ERROR_OUT_OF_HOST_MEMORY", "a host memory allocation has failed"),
    -2: ("VK_ERROR_OUT_OF_DEVICE_MEMORY", "a device memory allocation has failed"),
    -3: ("VK_ERROR_INITIALIZATION_FAILED",
         "initialization of an object could not be completed for implementation-specific reasons"),
    -4: ("VK_ERROR_DEVICE_LOST", "the logical or physical device has been lost"),
    -5: ("VK_ERROR_MEMORY_MAP_FAILED", "mapping of a memory object has failed"),
    -6: ("VK_ERROR_LAYER_NOT_PRESENT", "a requested layer is not present or could not be loaded"),
    -7: ("VK_ERROR_EXTENSION_NOT_PRESENT", "a requested extension is not supported"),
    -8: ("VK_ERROR_FEATURE_NOT_PRESENT", "a requested feature is not supported"),
    -9: ("VK_ERROR_INCOMPATIBLE_DRIVER",
         "the requested version of Vulkan is not supported by the driver or is otherwise "
         "incompatible for implementation-specific reasons"),
    -10: ("VK_ERROR_TOO_MANY_OBJECTS", "too many objects of the type have already been created"),
    -11: ("VK_ERROR_FORMAT_NOT_SUPPORTED", "a requested format is not supported on this device"),
    -12: ("VK_ERROR_FRAGMENTED_POOL",
          "a pool allocation has failed due to fragmentation of the pool's memory"),
    -13: ("VK_ERROR_UNKNOWN",
          "an unknown error has occurred; either the application has provided invalid input, "
          "or an implementation failure has occurred"),
    -1000069000: ("VK_ERROR_OUT_OF_POOL_MEMORY", "a pool memory allocation has failed"),
    -1000072003: ("VK_ERROR_INVALID_EXTERNAL_HANDLE",
                  "an external handle is not a valid handle of the specified type"),
    -1000161000: ("VK_ERROR_FRAGMENTATION",
                  "a descriptor pool creation has failed due to fragmentation"),
    -1000257000: ("VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS",
                  "a buffer creation or memory allocation failed because the requested address "
                  "is not available"),
    1000297000: ("VK_PIPELINE_COMPILE_REQUIRED",
                 "a requested pipeline creation would have required compilation, but the "
                 "application requested compilation to not be performed"),
    -1000011001: ("VK_ERROR_VALIDATION_FAILED_EXT",
                  "a command failed because invalid usage was detected by the implementation "
                  "or a validation layer"),
    -1000012000: ("VK_ERROR_INVALID_SHADER_NV", "one or more shaders failed to compile or link"),
}


def load():
    """Open the Vulkan loader; return (lib, path). Raises LibraryNotFound naming the paths tried."""
    return load_library(ffi, "vulkan", CANDIDATES, ENV_VAR)


_P, _U = ctypes.c_void_p, ctypes.c_uint32
# The commands a launch records (a step records hundreds), for drivers.held_functions: handles
# and arrays are pointers (ints, a handle's its `address`; bytes for pushed values), flags and
# counts 32-bit.
RECORDED = {
    "vkCmdPipelineBarrier": (None, _P, _U, _U, _U, _U, _P, _U, _P, _U, _P),
    "vkCmdBindPipeline": (None, _P, _U, _P),
    "vkCmdBindDescriptorSets": (None, _P, _U, _P, _U, _U, _P, _U, _P),
    "vkCmdPushConstants": (None, _P, _P, _U, _U, _U, _P),
    "vkCmdDispatch": (None, _P, _U, _U, _U),
}


def check(result, call):
    """Raise DriverError for a negative VkResult; return the result otherwise.

    Positive results are not errors but can matter to the caller (VK_NOT_READY from
    vkGetFenceStatus, VK_TIMEOUT from vkWaitForFences, VK_INCOMPLETE from enumerations), so they
    are handed back unchanged.
    """
    if result < 0:
        unknown = (f"VkResult({result})", "a code this binding does not know")
        name, text = RESULTS.get(result, unknown)
        raise DriverError("vulkan", call, result, name, text)
    return result


# A struct's sType is the VkStructureType enumerant that spells its name
# (VkBufferCreateInfo: VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO); a struct no enumerant spells has none.
_STYPES = {name[len("VK_STRUCTURE_TYPE_"):].replace("_", ""): value
           for name, value in ffi.typeof("VkStructureType").relements.items()}
_INCOMPLETE = ffi.typeof("VkResult").relements["VK_INCOMPLETE"]


def _tag(item, struct):
    stype = _STYPES.get(struct[len("Vk"):].upper())
    if stype is not None:
        item.sType = stype


def _string(kind, field, owner):
    return ffi.new("char[]", field) if isinstance(field, bytes) else field


# `new("VkStruct", field=...)`: a Vulkan struct with its `sType` (and its nested structs') filled
# in; a field given as bytes becomes a NUL-terminated string.
_structs = Structs(ffi, _tag, _string)
new, new_array = _structs.new, _structs.new_array


def strings(names):
    """A `const char *const *` array of the given str (layer or extension names), kept alive."""
    owned = [ffi.new("char[]", name.encode()) for name in names]
    value = ffi.new("const char *[]", owned)
    keep_alive(value, *owned)
    return value


def chain(*structs):
    """Link each struct's pNext to the next one (a `pNext` chain); return the first.

    Each struct keeps the next alive, so the head alone can be held.
    """
    for this, following in zip(structs, structs[1:]):
        this.pNext = following
        keep_alive(this, following)
    return structs[0]


def enumerate_all(function, struct, *args):
    """Run a Vulkan enumeration (count, then items); return an owned array of exactly count.

    `function` is a `lib.vkEnumerate...` / `lib.vkGet...` taking (*args, uint32_t *count, T *items)
    and `struct` is T. VK_INCOMPLETE (the list grew between the two calls) is answered by asking
    again.
    """
    count = ffi.new("uint32_t *")
    while True:
        result = function(*args, count, ffi.NULL)
        if result is not None:
            check(result, function.__name__)
        items = ffi.new(f"{struct}[]", count[0])
        result = function(*args, count, items)
        if result is None or check(result, function.__name__) != _INCOMPLETE:
            break
    if count[0] == len(items):
        return items
    exact = ffi.new(f"{struct}[]", count[0])
    ffi.memmove(exact, items, ffi.sizeof(struct) * count[0])
    return exact


def instance_function(lib, instance, name):
    """An extension entry point through vkGetInstanceProcAddr, cast to its PFN type."""
    pointer = lib.vkGetInstanceProcAddr(instance, name.encode())
    if pointer == ffi.NULL:
        raise DriverError("vulkan", "vkGetInstanceProcAddr", None, "not found",
                          f"{name} is not provided (is its extension enabled on the instance?)")
    return ffi.cast(f"PFN_{name}", pointer)


def make_version(major, minor, patch=0):
    """VK_MAKE_API_VERSION(0, major, minor, patch)."""
    return (major << 22) | (minor << 12) | patch


def version_string(version):
    """A packed Vulkan version as "major.minor.patch"."""
    return f"{(version >> 22) & 0x7F}.{(version >> 12) & 0x3FF}.{version & 0xFFF}"


def text(chars):
    """A fixed-size char array of a Vulkan struct (names, descriptions) as a str."""
    return ffi.string(chars).decode("utf-8", "replace")
