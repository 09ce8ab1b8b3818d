"""Thin cffi binding of wgpu-native (29.x, the library inside the `wgpu` wheel) for compute work.

What is here: the declarations a compute backend needs, written from that version's `webgpu.h`
and `wgpu.h` (trimmed to compute: render, texture and surface parts are left out, enums used
only as "binding not used" keep only that value), a loader that finds the library without
importing the `wgpu` Python package, and helpers for what wgpu-native makes tedious from Python:
string views, chained structs, the callback dance of the asynchronous requests, error scopes.
What is not here: any choice of adapter, limits or features. Those belong to
`poot/backends/wgpu.py`.

Facts this binding is built around (PLATFORM-NOTES.md): request callbacks fire inside the request
call; buffer-map callbacks fire in `wgpuDevicePoll(wait=1)`; `wgpuInstanceWaitAny` aborts the
process, so it is not declared; an invalid pipeline reaching `wgpuQueueSubmit` aborts the process,
so errors must be collected with `error_scope` before submitting; an error outside any scope on a
device without an uncaptured-error callback aborts the process too, so every device should be
requested with `uncaptured_error_callback`; a compute pipeline made from a SPIR-V module that naga
could not even parse aborts the process (one that parsed but failed validation is reported), so
a module whose error scope raised must never be used. Every SPIR-V module goes through wgpu's
translator (naga): this build offers no passthrough. Shader push constants are "immediates" in
this version: `WGPUPipelineLayoutDescriptor.immediateSize`, `wgpuComputePassEncoderSetImmediates`,
`WGPULimits.maxImmediateSize`, and the device needs `WGPUNativeFeature_Immediates` (without it a
module using them fails validation).
"""

import contextlib
import ctypes
import importlib.util
import site
from pathlib import Path

from cffi import FFI

from drivers import DriverError, Structs, keep_alive, load_library

ENV_VAR = "POOT_WGPU_LIB"
HEADER_MAJOR = 29  # the wgpu-native version whose webgpu.h / wgpu.h the declarations follow
# the `wgpu` releases whose wheel carries wgpu-native 29.x: scripts/setup installs it and
# scripts/bundle carries it, without its Python dependencies (the package is never imported)
WHEEL = "wgpu==0.32.*"
LIBRARY_NAMES = ("libwgpu_native-release.so", "libwgpu_native-release.dylib",
                 "wgpu_native-release.dll")

_CDEF = r"""
#define WGPU_STRLEN 0xFFFFFFFFFFFFFFFF
#define WGPU_WHOLE_SIZE 0xFFFFFFFFFFFFFFFF
#define WGPU_WHOLE_MAP_SIZE 0xFFFFFFFFFFFFFFFF
#define WGPU_LIMIT_U32_UNDEFINED 0xFFFFFFFF
#define WGPU_LIMIT_U64_UNDEFINED 0xFFFFFFFFFFFFFFFF

typedef uint64_t WGPUFlags;
typedef uint32_t WGPUBool;

typedef struct WGPUAdapterImpl *WGPUAdapter;
typedef struct WGPUBindGroupImpl *WGPUBindGroup;
typedef struct WGPUBindGroupLayoutImpl *WGPUBindGroupLayout;
typedef struct WGPUBufferImpl *WGPUBuffer;
typedef struct WGPUCommandBufferImpl *WGPUCommandBuffer;
typedef struct WGPUCommandEncoderImpl *WGPUCommandEncoder;
typedef struct WGPUComputePassEncoderImpl *WGPUComputePassEncoder;
typedef struct WGPUComputePipelineImpl *WGPUComputePipeline;
typedef struct WGPUDeviceImpl *WGPUDevice;
typedef struct WGPUInstanceImpl *WGPUInstance;
typedef struct WGPUPipelineLayoutImpl *WGPUPipelineLayout;
typedef struct WGPUQuerySetImpl *WGPUQuerySet;
typedef struct WGPUQueueImpl *WGPUQueue;
typedef struct WGPUSamplerImpl *WGPUSampler;
typedef struct WGPUShaderModuleImpl *WGPUShaderModule;
typedef struct WGPUSurfaceImpl *WGPUSurface;
typedef struct WGPUTextureViewImpl *WGPUTextureView;

typedef struct WGPUStringView { const char *data; size_t length; } WGPUStringView;

/* webgpu.h enums */
typedef enum WGPUAdapterType {
    WGPUAdapterType_DiscreteGPU = 1, WGPUAdapterType_IntegratedGPU = 2, WGPUAdapterType_CPU = 3,
    WGPUAdapterType_Unknown = 4, WGPUAdapterType_Force32 = 0x7FFFFFFF
} WGPUAdapterType;

typedef enum WGPUBackendType {
    WGPUBackendType_Undefined = 0, WGPUBackendType_Null = 1, WGPUBackendType_WebGPU = 2,
    WGPUBackendType_D3D11 = 3, WGPUBackendType_D3D12 = 4, WGPUBackendType_Metal = 5,
    WGPUBackendType_Vulkan = 6, WGPUBackendType_OpenGL = 7, WGPUBackendType_OpenGLES = 8,
    WGPUBackendType_Force32 = 0x7FFFFFFF
} WGPUBackendType;

typedef enum WGPUBufferBindingType {
    WGPUBufferBindingType_BindingNotUsed = 0, WGPUBufferBindingType_Undefined = 1,
    WGPUBufferBindingType_Uniform = 2, WGPUBufferBindingType_Storage = 3,
    WGPUBufferBindingType_ReadOnlyStorage = 4, WGPUBufferBindingType_Force32 = 0x7FFFFFFF
} WGPUBufferBindingType;


typedef enum WGPUCallbackMode {
    WGPUCallbackMode_WaitAnyOnly = 1, WGPUCallbackMode_AllowProcessEvents = 2,
    WGPUCallbackMode_AllowSpontaneous = 3, WGPUCallbackMode_Force32 = 0x7FFFFFFF
} WGPUCallbackMode;



typedef enum WGPUDeviceLostReason {
    WGPUDeviceLostReason_Unknown = 1, WGPUDeviceLostReason_Destroyed = 2,
    WGPUDeviceLostReason_CallbackCancelled = 3, WGPUDeviceLostReason_FailedCreation = 4,
    WGPUDeviceLostReason_Force32 = 0x7FFFFFFF
} WGPUDeviceLostReason;

typedef enum WGPUErrorFilter {
    WGPUErrorFilter_Validation = 1, WGPUErrorFilter_OutOfMemory = 2,
    WGPUErrorFilter_Internal = 3, WGPUErrorFilter_Force32 = 0x7FFFFFFF
} WGPUErrorFilter;

typedef enum WGPUErrorType {
    WGPUErrorType_NoError = 1, WGPUErrorType_Validation = 2, WGPUErrorType_OutOfMemory = 3,
    WGPUErrorType_Internal = 4, WGPUErrorType_Unknown = 5, WGPUErrorType_Force32 = 0x7FFFFFFF
} WGPUErrorType;

typedef enum WGPUFeatureLevel {
    WGPUFeatureLevel_Undefined = 0, WGPUFeatureLevel_Compatibility = 1,
    WGPUFeatureLevel_Core = 2, WGPUFeatureLevel_Force32 = 0x7FFFFFFF
} WGPUFeatureLevel;

typedef enum WGPUFeatureName {
    WGPUFeatureName_CoreFeaturesAndLimits = 0x01, WGPUFeatureName_DepthClipControl = 0x02,
    WGPUFeatureName_Depth32FloatStencil8 = 0x03, WGPUFeatureName_TextureCompressionBC = 0x04,
    WGPUFeatureName_TextureCompressionBCSliced3D = 0x05,
    WGPUFeatureName_TextureCompressionETC2 = 0x06, WGPUFeatureName_TextureCompressionASTC = 0x07,
    WGPUFeatureName_TextureCompressionASTCSliced3D = 0x08, WGPUFeatureName_TimestampQuery = 0x09,
    WGPUFeatureName_IndirectFirstInstance = 0x0A, WGPUFeatureName_ShaderF16 = 0x0B,
    WGPUFeatureName_RG11B10UfloatRenderable = 0x0C, WGPUFeatureName_BGRA8UnormStorage = 0x0D,
    WGPUFeatureName_Float32Filterable = 0x0E, WGPUFeatureName_Float32Blendable = 0x0F,
    WGPUFeatureName_ClipDistances = 0x10, WGPUFeatureName_DualSourceBlending = 0x11,
    WGPUFeatureName_Subgroups = 0x12, WGPUFeatureName_TextureFormatsTier1 = 0x13,
    WGPUFeatureName_TextureFormatsTier2 = 0x14, WGPUFeatureName_PrimitiveIndex = 0x15,
    WGPUFeatureName_TextureComponentSwizzle = 0x16, WGPUFeatureName_Force32 = 0x7FFFFFFF
} WGPUFeatureName;

typedef enum WGPUInstanceFeatureName {
    WGPUInstanceFeatureName_TimedWaitAny = 1, WGPUInstanceFeatureName_ShaderSourceSPIRV = 2,
    WGPUInstanceFeatureName_MultipleDevicesPerAdapter = 3,
    WGPUInstanceFeatureName_Force32 = 0x7FFFFFFF
} WGPUInstanceFeatureName;

typedef enum WGPUMapAsyncStatus {
    WGPUMapAsyncStatus_Success = 1, WGPUMapAsyncStatus_CallbackCancelled = 2,
    WGPUMapAsyncStatus_Error = 3, WGPUMapAsyncStatus_Aborted = 4,
    WGPUMapAsyncStatus_Force32 = 0x7FFFFFFF
} WGPUMapAsyncStatus;

typedef enum WGPUPopErrorScopeStatus {
    WGPUPopErrorScopeStatus_Success = 1, WGPUPopErrorScopeStatus_CallbackCancelled = 2,
    WGPUPopErrorScopeStatus_Error = 3, WGPUPopErrorScopeStatus_Force32 = 0x7FFFFFFF
} WGPUPopErrorScopeStatus;

typedef enum WGPUPowerPreference {
    WGPUPowerPreference_Undefined = 0, WGPUPowerPreference_LowPower = 1,
    WGPUPowerPreference_HighPerformance = 2, WGPUPowerPreference_Force32 = 0x7FFFFFFF
} WGPUPowerPreference;

typedef enum WGPURequestAdapterStatus {
    WGPURequestAdapterStatus_Success = 1, WGPURequestAdapterStatus_CallbackCancelled = 2,
    WGPURequestAdapterStatus_Unavailable = 3, WGPURequestAdapterStatus_Error = 4,
    WGPURequestAdapterStatus_Force32 = 0x7FFFFFFF
} WGPURequestAdapterStatus;

typedef enum WGPURequestDeviceStatus {
    WGPURequestDeviceStatus_Success = 1, WGPURequestDeviceStatus_CallbackCancelled = 2,
    WGPURequestDeviceStatus_Error = 3, WGPURequestDeviceStatus_Force32 = 0x7FFFFFFF
} WGPURequestDeviceStatus;

typedef enum WGPUStatus {
    WGPUStatus_Success = 1, WGPUStatus_Error = 2, WGPUStatus_Force32 = 0x7FFFFFFF
} WGPUStatus;

typedef enum WGPUSType {
    WGPUSType_ShaderSourceSPIRV = 1, WGPUSType_ShaderSourceWGSL = 2,
    WGPUSType_Force32 = 0x7FFFFFFF
} WGPUSType;

/* Parts of a bind group layout entry that compute leaves unused (zero = BindingNotUsed). */
typedef enum WGPUSamplerBindingType {
    WGPUSamplerBindingType_BindingNotUsed = 0, WGPUSamplerBindingType_Force32 = 0x7FFFFFFF
} WGPUSamplerBindingType;
typedef enum WGPUTextureSampleType {
    WGPUTextureSampleType_BindingNotUsed = 0, WGPUTextureSampleType_Force32 = 0x7FFFFFFF
} WGPUTextureSampleType;
typedef enum WGPUStorageTextureAccess {
    WGPUStorageTextureAccess_BindingNotUsed = 0, WGPUStorageTextureAccess_Force32 = 0x7FFFFFFF
} WGPUStorageTextureAccess;
typedef enum WGPUTextureViewDimension {
    WGPUTextureViewDimension_Undefined = 0, WGPUTextureViewDimension_Force32 = 0x7FFFFFFF
} WGPUTextureViewDimension;
typedef enum WGPUTextureFormat {
    WGPUTextureFormat_Undefined = 0, WGPUTextureFormat_Force32 = 0x7FFFFFFF
} WGPUTextureFormat;

/* webgpu.h flags (64-bit `static const` values in the header) */
typedef WGPUFlags WGPUBufferUsage;
#define WGPUBufferUsage_None 0x0
#define WGPUBufferUsage_MapRead 0x1
#define WGPUBufferUsage_MapWrite 0x2
#define WGPUBufferUsage_CopySrc 0x4
#define WGPUBufferUsage_CopyDst 0x8
#define WGPUBufferUsage_Uniform 0x40
#define WGPUBufferUsage_Storage 0x80
#define WGPUBufferUsage_Indirect 0x100
#define WGPUBufferUsage_QueryResolve 0x200
typedef WGPUFlags WGPUMapMode;
#define WGPUMapMode_None 0x0
#define WGPUMapMode_Read 0x1
#define WGPUMapMode_Write 0x2
typedef WGPUFlags WGPUShaderStage;
#define WGPUShaderStage_None 0x0
#define WGPUShaderStage_Compute 0x4

/* Callbacks */
typedef void (*WGPUBufferMapCallback)(WGPUMapAsyncStatus status, WGPUStringView message,
    void *userdata1, void *userdata2);
typedef void (*WGPUDeviceLostCallback)(WGPUDevice const *device, WGPUDeviceLostReason reason,
    WGPUStringView message, void *userdata1, void *userdata2);
typedef void (*WGPUPopErrorScopeCallback)(WGPUPopErrorScopeStatus status, WGPUErrorType type,
    WGPUStringView message, void *userdata1, void *userdata2);
typedef void (*WGPURequestAdapterCallback)(WGPURequestAdapterStatus status, WGPUAdapter adapter,
    WGPUStringView message, void *userdata1, void *userdata2);
typedef void (*WGPURequestDeviceCallback)(WGPURequestDeviceStatus status, WGPUDevice device,
    WGPUStringView message, void *userdata1, void *userdata2);
typedef void (*WGPUUncapturedErrorCallback)(WGPUDevice const *device, WGPUErrorType type,
    WGPUStringView message, void *userdata1, void *userdata2);

typedef struct WGPUChainedStruct {
    struct WGPUChainedStruct *next; WGPUSType sType;
} WGPUChainedStruct;

typedef struct WGPUBufferMapCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUCallbackMode mode; WGPUBufferMapCallback callback;
    void *userdata1; void *userdata2;
} WGPUBufferMapCallbackInfo;
typedef struct WGPUDeviceLostCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUCallbackMode mode; WGPUDeviceLostCallback callback;
    void *userdata1; void *userdata2;
} WGPUDeviceLostCallbackInfo;
typedef struct WGPUPopErrorScopeCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUCallbackMode mode; WGPUPopErrorScopeCallback callback;
    void *userdata1; void *userdata2;
} WGPUPopErrorScopeCallbackInfo;
typedef struct WGPURequestAdapterCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUCallbackMode mode; WGPURequestAdapterCallback callback;
    void *userdata1; void *userdata2;
} WGPURequestAdapterCallbackInfo;
typedef struct WGPURequestDeviceCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUCallbackMode mode; WGPURequestDeviceCallback callback;
    void *userdata1; void *userdata2;
} WGPURequestDeviceCallbackInfo;
typedef struct WGPUUncapturedErrorCallbackInfo {
    WGPUChainedStruct *nextInChain; WGPUUncapturedErrorCallback callback;
    void *userdata1; void *userdata2;
} WGPUUncapturedErrorCallbackInfo;

typedef struct WGPUFuture { uint64_t id; } WGPUFuture;

/* Instance and adapter */
typedef struct WGPUInstanceLimits {
    WGPUChainedStruct *nextInChain; size_t timedWaitAnyMaxCount;
} WGPUInstanceLimits;

typedef struct WGPUInstanceDescriptor {
    WGPUChainedStruct *nextInChain;
    size_t requiredFeatureCount; WGPUInstanceFeatureName const *requiredFeatures;
    WGPUInstanceLimits const *requiredLimits;
} WGPUInstanceDescriptor;

typedef struct WGPURequestAdapterOptions {
    WGPUChainedStruct *nextInChain;
    WGPUFeatureLevel featureLevel; WGPUPowerPreference powerPreference;
    WGPUBool forceFallbackAdapter; WGPUBackendType backendType;
    WGPUSurface compatibleSurface;
} WGPURequestAdapterOptions;

typedef struct WGPUAdapterInfo {
    WGPUChainedStruct *nextInChain;
    WGPUStringView vendor, architecture, device, description;
    WGPUBackendType backendType; WGPUAdapterType adapterType;
    uint32_t vendorID, deviceID, subgroupMinSize, subgroupMaxSize;
} WGPUAdapterInfo;

typedef struct WGPUSupportedFeatures {
    size_t featureCount; WGPUFeatureName const *features;
} WGPUSupportedFeatures;

typedef struct WGPULimits {
    WGPUChainedStruct *nextInChain;
    uint32_t maxTextureDimension1D, maxTextureDimension2D, maxTextureDimension3D,
        maxTextureArrayLayers, maxBindGroups, maxBindGroupsPlusVertexBuffers,
        maxBindingsPerBindGroup, maxDynamicUniformBuffersPerPipelineLayout,
        maxDynamicStorageBuffersPerPipelineLayout, maxSampledTexturesPerShaderStage,
        maxSamplersPerShaderStage, maxStorageBuffersPerShaderStage,
        maxStorageTexturesPerShaderStage, maxUniformBuffersPerShaderStage;
    uint64_t maxUniformBufferBindingSize, maxStorageBufferBindingSize;
    uint32_t minUniformBufferOffsetAlignment, minStorageBufferOffsetAlignment, maxVertexBuffers;
    uint64_t maxBufferSize;
    uint32_t maxVertexAttributes, maxVertexBufferArrayStride, maxInterStageShaderVariables,
        maxColorAttachments, maxColorAttachmentBytesPerSample, maxComputeWorkgroupStorageSize,
        maxComputeInvocationsPerWorkgroup, maxComputeWorkgroupSizeX, maxComputeWorkgroupSizeY,
        maxComputeWorkgroupSizeZ, maxComputeWorkgroupsPerDimension, maxImmediateSize;
} WGPULimits;

/* Device */
typedef struct WGPUQueueDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
} WGPUQueueDescriptor;

typedef struct WGPUDeviceDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
    size_t requiredFeatureCount; WGPUFeatureName const *requiredFeatures;
    WGPULimits const *requiredLimits;
    WGPUQueueDescriptor defaultQueue;
    WGPUDeviceLostCallbackInfo deviceLostCallbackInfo;
    WGPUUncapturedErrorCallbackInfo uncapturedErrorCallbackInfo;
} WGPUDeviceDescriptor;

/* Buffers */
typedef struct WGPUBufferDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
    WGPUBufferUsage usage; uint64_t size; WGPUBool mappedAtCreation;
} WGPUBufferDescriptor;

/* Shader modules */
typedef struct WGPUShaderModuleDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
} WGPUShaderModuleDescriptor;

typedef struct WGPUShaderSourceSPIRV {
    WGPUChainedStruct chain; uint32_t codeSize; uint32_t const *code;
} WGPUShaderSourceSPIRV;

typedef struct WGPUShaderSourceWGSL {
    WGPUChainedStruct chain; WGPUStringView code;
} WGPUShaderSourceWGSL;



/* Bind groups and pipelines */
typedef struct WGPUBufferBindingLayout {
    WGPUChainedStruct *nextInChain; WGPUBufferBindingType type; WGPUBool hasDynamicOffset;
    uint64_t minBindingSize;
} WGPUBufferBindingLayout;

typedef struct WGPUSamplerBindingLayout {
    WGPUChainedStruct *nextInChain; WGPUSamplerBindingType type;
} WGPUSamplerBindingLayout;

typedef struct WGPUTextureBindingLayout {
    WGPUChainedStruct *nextInChain; WGPUTextureSampleType sampleType;
    WGPUTextureViewDimension viewDimension; WGPUBool multisampled;
} WGPUTextureBindingLayout;

typedef struct WGPUStorageTextureBindingLayout {
    WGPUChainedStruct *nextInChain; WGPUStorageTextureAccess access; WGPUTextureFormat format;
    WGPUTextureViewDimension viewDimension;
} WGPUStorageTextureBindingLayout;

typedef struct WGPUBindGroupLayoutEntry {
    WGPUChainedStruct *nextInChain; uint32_t binding; WGPUShaderStage visibility;
    uint32_t bindingArraySize;
    WGPUBufferBindingLayout buffer; WGPUSamplerBindingLayout sampler;
    WGPUTextureBindingLayout texture; WGPUStorageTextureBindingLayout storageTexture;
} WGPUBindGroupLayoutEntry;

typedef struct WGPUBindGroupLayoutDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
    size_t entryCount; WGPUBindGroupLayoutEntry const *entries;
} WGPUBindGroupLayoutDescriptor;

typedef struct WGPUBindGroupEntry {
    WGPUChainedStruct *nextInChain; uint32_t binding;
    WGPUBuffer buffer; uint64_t offset; uint64_t size;
    WGPUSampler sampler; WGPUTextureView textureView;
} WGPUBindGroupEntry;

typedef struct WGPUBindGroupDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label; WGPUBindGroupLayout layout;
    size_t entryCount; WGPUBindGroupEntry const *entries;
} WGPUBindGroupDescriptor;

typedef struct WGPUPipelineLayoutDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
    size_t bindGroupLayoutCount; WGPUBindGroupLayout const *bindGroupLayouts;
    uint32_t immediateSize;
} WGPUPipelineLayoutDescriptor;

typedef struct WGPUConstantEntry {
    WGPUChainedStruct *nextInChain; WGPUStringView key; double value;
} WGPUConstantEntry;

typedef struct WGPUComputeState {
    WGPUChainedStruct *nextInChain; WGPUShaderModule module; WGPUStringView entryPoint;
    size_t constantCount; WGPUConstantEntry const *constants;
} WGPUComputeState;

typedef struct WGPUComputePipelineDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label; WGPUPipelineLayout layout;
    WGPUComputeState compute;
} WGPUComputePipelineDescriptor;

/* Commands and queries */
typedef struct WGPUCommandEncoderDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
} WGPUCommandEncoderDescriptor;

typedef struct WGPUCommandBufferDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
} WGPUCommandBufferDescriptor;

typedef struct WGPUPassTimestampWrites {
    WGPUChainedStruct *nextInChain; WGPUQuerySet querySet;
    uint32_t beginningOfPassWriteIndex, endOfPassWriteIndex;
} WGPUPassTimestampWrites;

typedef struct WGPUComputePassDescriptor {
    WGPUChainedStruct *nextInChain; WGPUStringView label;
    WGPUPassTimestampWrites const *timestampWrites;
} WGPUComputePassDescriptor;

/* wgpu.h: native extensions */
typedef enum WGPUNativeSType {
    WGPUSType_DeviceExtras = 0x00030001, WGPUSType_NativeLimits = 0x00030002,
    WGPUSType_InstanceExtras = 0x00030004, WGPUNativeSType_Force32 = 0x7FFFFFFF
} WGPUNativeSType;

typedef enum WGPUNativeFeature {
    WGPUNativeFeature_Immediates = 0x00030001,
    WGPUNativeFeature_TextureAdapterSpecificFormatFeatures = 0x00030002,
    WGPUNativeFeature_MultiDrawIndirectCount = 0x00030004,
    WGPUNativeFeature_VertexWritableStorage = 0x00030005,
    WGPUNativeFeature_TextureBindingArray = 0x00030006,
    WGPUNativeFeature_SampledTextureAndStorageBufferArrayNonUniformIndexing = 0x00030007,
    WGPUNativeFeature_PipelineStatisticsQuery = 0x00030008,
    WGPUNativeFeature_StorageResourceBindingArray = 0x00030009,
    WGPUNativeFeature_PartiallyBoundBindingArray = 0x0003000A,
    WGPUNativeFeature_TextureFormat16bitNorm = 0x0003000B,
    WGPUNativeFeature_TextureCompressionAstcHdr = 0x0003000C,
    WGPUNativeFeature_MappablePrimaryBuffers = 0x0003000E,
    WGPUNativeFeature_BufferBindingArray = 0x0003000F,
    WGPUNativeFeature_StorageTextureArrayNonUniformIndexing = 0x00030010,
    WGPUNativeFeature_AddressModeClampToZero = 0x00030011,
    WGPUNativeFeature_AddressModeClampToBorder = 0x00030012,
    WGPUNativeFeature_PolygonModeLine = 0x00030013, WGPUNativeFeature_PolygonModePoint = 0x00030014,
    WGPUNativeFeature_ConservativeRasterization = 0x00030015,
    WGPUNativeFeature_ClearTexture = 0x00030016, WGPUNativeFeature_Multiview = 0x00030018,
    WGPUNativeFeature_VertexAttribute64bit = 0x00030019,
    WGPUNativeFeature_TextureFormatNv12 = 0x0003001A, WGPUNativeFeature_RayQuery = 0x0003001C,
    WGPUNativeFeature_ShaderF64 = 0x0003001D, WGPUNativeFeature_ShaderI16 = 0x0003001E,
    WGPUNativeFeature_ShaderEarlyDepthTest = 0x00030020, WGPUNativeFeature_Subgroup = 0x00030021,
    WGPUNativeFeature_SubgroupVertex = 0x00030022, WGPUNativeFeature_SubgroupBarrier = 0x00030023,
    WGPUNativeFeature_TimestampQueryInsideEncoders = 0x00030024,
    WGPUNativeFeature_TimestampQueryInsidePasses = 0x00030025,
    WGPUNativeFeature_ShaderInt64 = 0x00030026, WGPUNativeFeature_ShaderFloat32Atomic = 0x00030027,
    WGPUNativeFeature_TextureAtomic = 0x00030028, WGPUNativeFeature_TextureFormatP010 = 0x00030029,
    WGPUNativeFeature_PipelineCache = 0x0003002B,
    WGPUNativeFeature_ShaderInt64AtomicMinMax = 0x0003002C,
    WGPUNativeFeature_ShaderInt64AtomicAllOps = 0x0003002D,
    WGPUNativeFeature_TextureInt64Atomic = 0x00030030,
    WGPUNativeFeature_ShaderBarycentrics = 0x00030037,
    WGPUNativeFeature_SelectiveMultiview = 0x00030038,
    WGPUNativeFeature_MultisampleArray = 0x0003003A,
    WGPUNativeFeature_CooperativeMatrix = 0x0003003B,
    WGPUNativeFeature_ShaderPerVertex = 0x0003003C,
    WGPUNativeFeature_ShaderDrawIndex = 0x0003003D,
    WGPUNativeFeature_AccelerationStructureBindingArray = 0x0003003E,
    WGPUNativeFeature_MemoryDecorationCoherent = 0x0003003F,
    WGPUNativeFeature_MemoryDecorationVolatile = 0x00030040,
    WGPUNativeFeature_Force32 = 0x7FFFFFFF
} WGPUNativeFeature;

typedef WGPUFlags WGPUInstanceBackend;
#define WGPUInstanceBackend_All 0x0
#define WGPUInstanceBackend_Vulkan 0x1
#define WGPUInstanceBackend_GL 0x2
#define WGPUInstanceBackend_Metal 0x4
#define WGPUInstanceBackend_DX12 0x8
typedef WGPUFlags WGPUInstanceFlag;
#define WGPUInstanceFlag_Empty 0x0
#define WGPUInstanceFlag_Debug 0x1
#define WGPUInstanceFlag_Validation 0x2
#define WGPUInstanceFlag_Default 0x1000000

/* Fields of WGPUInstanceExtras for other backends and windowing: only their zero is used. */
typedef enum WGPUDx12Compiler {
    WGPUDx12Compiler_Undefined = 0, WGPUDx12Compiler_Force32 = 0x7FFFFFFF
} WGPUDx12Compiler;
typedef enum WGPUGles3MinorVersion {
    WGPUGles3MinorVersion_Automatic = 0, WGPUGles3MinorVersion_Force32 = 0x7FFFFFFF
} WGPUGles3MinorVersion;
typedef enum WGPUGLFenceBehaviour {
    WGPUGLFenceBehaviour_Normal = 0, WGPUGLFenceBehaviour_Force32 = 0x7FFFFFFF
} WGPUGLFenceBehaviour;
typedef enum WGPUDxcMaxShaderModel {
    WGPUDxcMaxShaderModel_V6_0 = 0, WGPUDxcMaxShaderModel_Force32 = 0x7FFFFFFF
} WGPUDxcMaxShaderModel;
typedef enum WGPUDx12SwapchainKind {
    WGPUDx12SwapchainKind_Undefined = 0, WGPUDx12SwapchainKind_Force32 = 0x7FFFFFFF
} WGPUDx12SwapchainKind;
typedef enum WGPUNativeDisplayHandleType {
    WGPUNativeDisplayHandleType_None = 0, WGPUNativeDisplayHandleType_Force32 = 0x7FFFFFFF
} WGPUNativeDisplayHandleType;

typedef struct WGPUXlibDisplayHandle { void *display; int screen; } WGPUXlibDisplayHandle;
typedef struct WGPUXcbDisplayHandle { void *connection; int screen; } WGPUXcbDisplayHandle;
typedef struct WGPUWaylandDisplayHandle { void *display; } WGPUWaylandDisplayHandle;
typedef struct WGPUNativeDisplayHandle {
    WGPUNativeDisplayHandleType type;
    union {
        WGPUXlibDisplayHandle xlib; WGPUXcbDisplayHandle xcb; WGPUWaylandDisplayHandle wayland;
    } data;
} WGPUNativeDisplayHandle;

typedef struct WGPUInstanceExtras {
    WGPUChainedStruct chain;
    WGPUInstanceBackend backends; WGPUInstanceFlag flags;
    WGPUDx12Compiler dx12ShaderCompiler; WGPUGles3MinorVersion gles3MinorVersion;
    WGPUGLFenceBehaviour glFenceBehaviour; WGPUStringView dxcPath;
    WGPUDxcMaxShaderModel dxcMaxShaderModel; WGPUDx12SwapchainKind dx12PresentationSystem;
    const uint8_t *budgetForDeviceCreation; const uint8_t *budgetForDeviceLoss;
    WGPUNativeDisplayHandle displayHandle;
} WGPUInstanceExtras;

typedef struct WGPUDeviceExtras {
    WGPUChainedStruct chain; WGPUStringView tracePath;
} WGPUDeviceExtras;

typedef struct WGPUNativeLimits {
    WGPUChainedStruct chain;
    uint32_t maxNonSamplerBindings, maxBindingArrayElementsPerShaderStage,
        maxBindingArraySamplerElementsPerShaderStage, maxMultiviewViewCount;
} WGPUNativeLimits;

typedef struct WGPUInstanceEnumerateAdapterOptions {
    WGPUChainedStruct const *nextInChain; WGPUInstanceBackend backends;
} WGPUInstanceEnumerateAdapterOptions;

typedef uint64_t WGPUSubmissionIndex;

/* Functions. Not declared, though in the headers: wgpuInstanceWaitAny (aborts the process), and
   what wgpu-native 29.0.1.1 leaves unimplemented (a call aborts the process):
   wgpuBufferGetMapState, wgpuDeviceGetAdapterInfo, wgpuShaderModuleGetCompilationInfo. */

/* Functions: instance and adapter */
WGPUInstance wgpuCreateInstance(WGPUInstanceDescriptor const *descriptor);
void wgpuInstanceRelease(WGPUInstance instance);
void wgpuInstanceProcessEvents(WGPUInstance instance);
WGPUFuture wgpuInstanceRequestAdapter(WGPUInstance instance,
    WGPURequestAdapterOptions const *options, WGPURequestAdapterCallbackInfo callbackInfo);
size_t wgpuInstanceEnumerateAdapters(WGPUInstance instance,
    WGPUInstanceEnumerateAdapterOptions const *options, WGPUAdapter *adapters);
WGPUStatus wgpuAdapterGetInfo(WGPUAdapter adapter, WGPUAdapterInfo *info);
void wgpuAdapterInfoFreeMembers(WGPUAdapterInfo adapterInfo);
WGPUStatus wgpuAdapterGetLimits(WGPUAdapter adapter, WGPULimits *limits);
void wgpuAdapterGetFeatures(WGPUAdapter adapter, WGPUSupportedFeatures *features);
WGPUBool wgpuAdapterHasFeature(WGPUAdapter adapter, WGPUFeatureName feature);
void wgpuSupportedFeaturesFreeMembers(WGPUSupportedFeatures supportedFeatures);
WGPUFuture wgpuAdapterRequestDevice(WGPUAdapter adapter, WGPUDeviceDescriptor const *descriptor,
    WGPURequestDeviceCallbackInfo callbackInfo);
void wgpuAdapterRelease(WGPUAdapter adapter);

/* Functions: device, errors, queue */
WGPUStatus wgpuDeviceGetLimits(WGPUDevice device, WGPULimits *limits);
WGPUQueue wgpuDeviceGetQueue(WGPUDevice device);
void wgpuDevicePushErrorScope(WGPUDevice device, WGPUErrorFilter filter);
WGPUFuture wgpuDevicePopErrorScope(WGPUDevice device, WGPUPopErrorScopeCallbackInfo callbackInfo);
/* wgpu.h says WGPUBool, but the function is Rust `bool` (one byte; the upper bytes of the
   returned register are garbage): declared as what the library really returns. */
_Bool wgpuDevicePoll(WGPUDevice device, _Bool wait, WGPUSubmissionIndex const *submissionIndex);
void wgpuDeviceRelease(WGPUDevice device);
void wgpuQueueSubmit(WGPUQueue queue, size_t commandCount, WGPUCommandBuffer const *commands);
void wgpuQueueWriteBuffer(WGPUQueue queue, WGPUBuffer buffer, uint64_t bufferOffset,
    void const *data, size_t size);
void wgpuQueueRelease(WGPUQueue queue);

/* Functions: buffers */
WGPUBuffer wgpuDeviceCreateBuffer(WGPUDevice device, WGPUBufferDescriptor const *descriptor);
WGPUFuture wgpuBufferMapAsync(WGPUBuffer buffer, WGPUMapMode mode, size_t offset, size_t size,
    WGPUBufferMapCallbackInfo callbackInfo);
void const *wgpuBufferGetConstMappedRange(WGPUBuffer buffer, size_t offset, size_t size);
void wgpuBufferUnmap(WGPUBuffer buffer);
void wgpuBufferDestroy(WGPUBuffer buffer);
void wgpuBufferRelease(WGPUBuffer buffer);

/* Functions: shaders, layouts, pipelines */
WGPUShaderModule wgpuDeviceCreateShaderModule(WGPUDevice device,
    WGPUShaderModuleDescriptor const *descriptor);
void wgpuShaderModuleRelease(WGPUShaderModule shaderModule);
WGPUBindGroupLayout wgpuDeviceCreateBindGroupLayout(WGPUDevice device,
    WGPUBindGroupLayoutDescriptor const *descriptor);
void wgpuBindGroupLayoutRelease(WGPUBindGroupLayout bindGroupLayout);
WGPUBindGroup wgpuDeviceCreateBindGroup(WGPUDevice device,
    WGPUBindGroupDescriptor const *descriptor);
void wgpuBindGroupRelease(WGPUBindGroup bindGroup);
WGPUPipelineLayout wgpuDeviceCreatePipelineLayout(WGPUDevice device,
    WGPUPipelineLayoutDescriptor const *descriptor);
void wgpuPipelineLayoutRelease(WGPUPipelineLayout pipelineLayout);
WGPUComputePipeline wgpuDeviceCreateComputePipeline(WGPUDevice device,
    WGPUComputePipelineDescriptor const *descriptor);
void wgpuComputePipelineRelease(WGPUComputePipeline computePipeline);

/* Functions: encoding */
WGPUCommandEncoder wgpuDeviceCreateCommandEncoder(WGPUDevice device,
    WGPUCommandEncoderDescriptor const *descriptor);
WGPUComputePassEncoder wgpuCommandEncoderBeginComputePass(WGPUCommandEncoder commandEncoder,
    WGPUComputePassDescriptor const *descriptor);
void wgpuCommandEncoderCopyBufferToBuffer(WGPUCommandEncoder commandEncoder, WGPUBuffer source,
    uint64_t sourceOffset, WGPUBuffer destination, uint64_t destinationOffset, uint64_t size);
WGPUCommandBuffer wgpuCommandEncoderFinish(WGPUCommandEncoder commandEncoder,
    WGPUCommandBufferDescriptor const *descriptor);
void wgpuCommandEncoderRelease(WGPUCommandEncoder commandEncoder);
void wgpuCommandBufferRelease(WGPUCommandBuffer commandBuffer);
void wgpuComputePassEncoderSetPipeline(WGPUComputePassEncoder computePassEncoder,
    WGPUComputePipeline pipeline);
void wgpuComputePassEncoderSetBindGroup(WGPUComputePassEncoder computePassEncoder,
    uint32_t groupIndex, WGPUBindGroup group, size_t dynamicOffsetCount,
    uint32_t const *dynamicOffsets);
void wgpuComputePassEncoderSetImmediates(WGPUComputePassEncoder computePassEncoder,
    uint32_t offset, void const *data, size_t size);
void wgpuComputePassEncoderDispatchWorkgroups(WGPUComputePassEncoder computePassEncoder,
    uint32_t workgroupCountX, uint32_t workgroupCountY, uint32_t workgroupCountZ);
void wgpuComputePassEncoderEnd(WGPUComputePassEncoder computePassEncoder);
void wgpuComputePassEncoderRelease(WGPUComputePassEncoder computePassEncoder);

/* Functions: library */
uint32_t wgpuGetVersion(void);
"""

ffi = FFI()
ffi.cdef(_CDEF)


def candidates():
    """Paths where the `wgpu` wheel may have put the library, found without importing `wgpu`.

    `importlib.util.find_spec` of a top-level package only locates it (nothing is executed);
    site-packages directories are searched as well for an install that is not on sys.path.
    """
    folders = []
    spec = importlib.util.find_spec("wgpu")
    if spec is not None and spec.submodule_search_locations:
        folders.extend(Path(location) for location in spec.submodule_search_locations)
    for packages in [*site.getsitepackages(), site.getusersitepackages()]:
        folders.append(Path(packages) / "wgpu")
    paths = []
    for folder in folders:
        for name in LIBRARY_NAMES:
            path = str(folder / "resources" / name)
            if path not in paths:
                paths.append(path)
    return paths


_P, _U, _SIZE = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t
# The calls a launch makes in its compute pass (a step makes hundreds), for
# drivers.held_functions: handles and arrays are pointers (ints, a handle's its address; bytes
# for immediates).
RECORDED = {
    "wgpuComputePassEncoderSetPipeline": (None, _P, _P),
    "wgpuComputePassEncoderSetBindGroup": (None, _P, _U, _P, _SIZE, _P),
    "wgpuComputePassEncoderSetImmediates": (None, _P, _U, _P, _SIZE),
    "wgpuComputePassEncoderDispatchWorkgroups": (None, _P, _U, _U, _U),
}


def load():
    """Open wgpu-native; return (lib, path). Raises LibraryNotFound naming the paths tried, and
    DriverError for a library of another major version (its struct layouts differ)."""
    lib, path = load_library(ffi, "wgpu-native", candidates(), ENV_VAR)
    try:
        version = lib.wgpuGetVersion()
    except AttributeError:
        raise DriverError("wgpu-native", "wgpuGetVersion", None, "not wgpu-native",
                          f"{path} does not export wgpuGetVersion") from None
    if version >> 24 != HEADER_MAJOR:
        raise DriverError("wgpu-native", "wgpuGetVersion", version, "unsupported version",
                          f"{path} is wgpu-native {version_string(version)}; this binding "
                          f"declares the {HEADER_MAJOR}.x headers")
    return lib, path


def version_string(version):
    """wgpuGetVersion()'s packed 0xMMmmppbb as "major.minor.patch.build"."""
    return ".".join(str((version >> shift) & 0xFF) for shift in (24, 16, 8, 0))


def text(view):
    """A WGPUStringView as a str ('' for the null view)."""
    if view.data == ffi.NULL:
        return ""
    if view.length == _STRLEN:  # NUL-terminated
        return ffi.string(view.data).decode("utf-8", "replace")
    return ffi.unpack(view.data, view.length).decode("utf-8", "replace")


def enum_name(enum, value):
    """The enumerant's name in a declared enum (e.g. 'WGPUErrorType_Validation'), or the number."""
    for declared in (enum, "WGPUNativeFeature") if enum == "WGPUFeatureName" else (enum,):
        name = ffi.typeof(declared).elements.get(value)
        if name is not None:
            return name
    return f"{enum}({value:#x})"


# An extension struct's chain.sType is the enumerant that spells its name
# (WGPUInstanceExtras: WGPUSType_InstanceExtras), of WGPUSType or of wgpu-native's own.
_STYPES = {**ffi.typeof("WGPUSType").relements, **ffi.typeof("WGPUNativeSType").relements}
_STRING_VIEW = ffi.typeof("WGPUStringView")
_STRLEN = int(ffi.cast("size_t", -1))  # WGPU_STRLEN


def _tag(item, struct):
    stype = _STYPES.get("WGPUSType_" + struct[len("WGPU"):])
    if stype is not None:
        item.chain.sType = stype


def _string_view(kind, field, owner):
    if isinstance(field, str) and kind == _STRING_VIEW:
        chars = ffi.new("char[]", field.encode())
        keep_alive(owner, chars)
        return {"data": chars, "length": len(chars) - 1}
    return field


# `new("WGPUStruct", field=...)`: a wgpu struct with an extension struct's `chain.sType` filled
# in; a str given for a WGPUStringView field becomes a string view. Unset string views are
# {NULL, 0}: the empty string (a label wgpu does not need).
_structs = Structs(ffi, _tag, _string_view)
new, new_array = _structs.new, _structs.new_array


def chain(descriptor, *extensions):
    """Hang extension structs (each starting with a WGPUChainedStruct) off `nextInChain`."""
    links = [ffi.cast("WGPUChainedStruct *", extension) for extension in extensions]
    for this, following in zip(links, links[1:]):
        this.next = following
    descriptor.nextInChain = links[0] if links else ffi.NULL
    keep_alive(descriptor, *extensions)
    return descriptor


def _callback_info(struct, lib, callback):
    """A callback info struct (passed by value) whose callback may fire in ProcessEvents."""
    return ffi.new(f"{struct} *", {"mode": lib.WGPUCallbackMode_AllowProcessEvents,
                                   "callback": callback})[0]


def _completed(lib, instance, outcome, call):
    """Make sure a request's callback has fired: they fire inside the call on wgpu-native 29,
    and `wgpuInstanceProcessEvents` delivers any that has not."""
    if not outcome:
        lib.wgpuInstanceProcessEvents(instance)
    if not outcome:
        raise DriverError("wgpu", call, None, "no answer", "the callback never fired")
    return outcome[0]


def request_adapter(lib, instance, options=ffi.NULL):
    """wgpuInstanceRequestAdapter, answered; returns the WGPUAdapter or raises DriverError."""
    outcome = []

    @ffi.callback("WGPURequestAdapterCallback")
    def answer(status, adapter, message, userdata1, userdata2):
        outcome.append((status, adapter, text(message)))

    lib.wgpuInstanceRequestAdapter(instance, options,
        _callback_info("WGPURequestAdapterCallbackInfo", lib, answer))
    status, adapter, message = _completed(lib, instance, outcome, "wgpuInstanceRequestAdapter")
    if status != lib.WGPURequestAdapterStatus_Success:
        raise DriverError("wgpu", "wgpuInstanceRequestAdapter", status,
                          enum_name("WGPURequestAdapterStatus", status), message)
    return adapter


def request_device(lib, instance, adapter, descriptor=ffi.NULL):
    """wgpuAdapterRequestDevice, answered; returns the WGPUDevice or raises DriverError.

    The callbacks a descriptor carries (uncaptured errors, device lost) must be kept alive by
    the caller for as long as the device lives.
    """
    outcome = []

    @ffi.callback("WGPURequestDeviceCallback")
    def answer(status, device, message, userdata1, userdata2):
        outcome.append((status, device, text(message)))

    lib.wgpuAdapterRequestDevice(adapter, descriptor,
        _callback_info("WGPURequestDeviceCallbackInfo", lib, answer))
    status, device, message = _completed(lib, instance, outcome, "wgpuAdapterRequestDevice")
    if status != lib.WGPURequestDeviceStatus_Success:
        raise DriverError("wgpu", "wgpuAdapterRequestDevice", status,
                          enum_name("WGPURequestDeviceStatus", status), message)
    return device


def uncaptured_error_callback(errors):
    """A WGPUUncapturedErrorCallback appending each error outside any scope to `errors`, as a
    DriverError. Give it in `WGPUDeviceDescriptor.uncapturedErrorCallbackInfo.callback` and keep it
    (and the list) alive as long as the device."""

    @ffi.callback("WGPUUncapturedErrorCallback")
    def collect(device, error_type, message, userdata1, userdata2):
        errors.append(DriverError("wgpu", "a call outside any error scope", error_type,
                                  enum_name("WGPUErrorType", error_type), text(message)))

    return collect


def map_buffer(lib, instance, device, buffer, mode, offset, size):
    """wgpuBufferMapAsync, then wgpuDevicePoll(wait=1) until it is answered; raises DriverError
    when the mapping failed. Read it afterwards with wgpuBufferGetConstMappedRange."""
    outcome = []

    @ffi.callback("WGPUBufferMapCallback")
    def answer(status, message, userdata1, userdata2):
        outcome.append((status, text(message)))

    lib.wgpuBufferMapAsync(buffer, mode, offset, size,
        _callback_info("WGPUBufferMapCallbackInfo", lib, answer))
    lib.wgpuDevicePoll(device, 1, ffi.NULL)
    status, message = _completed(lib, instance, outcome, "wgpuBufferMapAsync")
    if status != lib.WGPUMapAsyncStatus_Success:
        raise DriverError("wgpu", "wgpuBufferMapAsync", status,
                          enum_name("WGPUMapAsyncStatus", status), message)


# WGPUErrorFilter_Internal is declared but wgpu-native 29.0.1.1 panics on it ("invalid error
# filter", the process aborts), so scopes cover validation and out-of-memory errors only.
_FILTERS = ("WGPUErrorFilter_Validation", "WGPUErrorFilter_OutOfMemory")


@contextlib.contextmanager
def error_scope(lib, instance, device, call):
    """Run the block inside validation and out-of-memory error scopes; raise the first error they
    caught as DriverError(call, error type, wgpu's message).

    This is how a caller learns that a module or pipeline is invalid before it reaches
    wgpuQueueSubmit (where wgpu-native aborts the process instead of reporting).
    """
    for name in _FILTERS:
        lib.wgpuDevicePushErrorScope(device, getattr(lib, name))
    try:
        yield
    finally:
        caught = [_pop_error_scope(lib, instance, device) for _ in _FILTERS]
    for error_type, message in caught:
        if error_type != lib.WGPUErrorType_NoError:
            raise DriverError("wgpu", call, error_type, enum_name("WGPUErrorType", error_type),
                              message)


def _pop_error_scope(lib, instance, device):
    outcome = []

    @ffi.callback("WGPUPopErrorScopeCallback")
    def answer(status, error_type, message, userdata1, userdata2):
        outcome.append((status, error_type, text(message)))

    lib.wgpuDevicePopErrorScope(device,
        _callback_info("WGPUPopErrorScopeCallbackInfo", lib, answer))
    status, error_type, message = _completed(lib, instance, outcome, "wgpuDevicePopErrorScope")
    if status != lib.WGPUPopErrorScopeStatus_Success:
        raise DriverError("wgpu", "wgpuDevicePopErrorScope", status,
                          enum_name("WGPUPopErrorScopeStatus", status), message)
    return error_type, message
