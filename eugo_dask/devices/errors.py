"""Device errors: their kinds and the CUDA statuses and library names that say which kind.

A device classifies an error it raised (:meth:`~eugo_dask.devices.base.Device.classify_error`)
into one of :data:`ERROR_KINDS`: out of memory (CuPy's, RMM's plain ``MemoryError``), library
status errors (cuBLAS, cuFFT, cuRAND, cuSOLVER, cuSPARSE), kernel compilation (NVRTC), other CUDA
errors, and two kinds after which the device is off for the process (:data:`FATAL_KINDS`), with
the reason kept: *sticky* CUDA errors (an illegal address, a launch failure: the context is lost)
and *unavailable* (a CUDA library missing). This module holds the tables both devices read and
the classification by name (:func:`_classify_by_name`), which needs no CuPy.
"""

from __future__ import annotations

#: Kinds of device error (:meth:`~eugo_dask.devices.base.Device.classify_error`).
OUT_OF_MEMORY = "out-of-memory"
STICKY = "sticky"
UNAVAILABLE = "unavailable"
LIBRARY = "library"
COMPILE = "compile"
RUNTIME = "runtime"
ERROR_KINDS = (OUT_OF_MEMORY, STICKY, UNAVAILABLE, LIBRARY, COMPILE, RUNTIME)
#: Kinds after which the device is off for the rest of the process.
FATAL_KINDS = frozenset({STICKY, UNAVAILABLE})

#: CUDA errors after which the context is unusable (CUDA runtime API docs: "the process must be
#: terminated and relaunched"), plus uncorrectable hardware errors and cudaErrorUnknown.
STICKY_CUDA_STATUSES = frozenset({
    214,  # cudaErrorECCUncorrectable
    220,  # cudaErrorNvlinkUncorrectable
    700,  # cudaErrorIllegalAddress
    702,  # cudaErrorLaunchTimeout
    709,  # cudaErrorContextIsDestroyed
    710,  # cudaErrorAssert
    714,  # cudaErrorHardwareStackError
    715,  # cudaErrorIllegalInstruction
    716,  # cudaErrorMisalignedAddress
    717,  # cudaErrorInvalidAddressSpace
    718,  # cudaErrorInvalidPc
    719,  # cudaErrorLaunchFailure
    999,  # cudaErrorUnknown
})
#: CUDA errors that say the device cannot be used at all here.
UNAVAILABLE_CUDA_STATUSES = frozenset({
    3,    # cudaErrorInitializationError
    4,    # cudaErrorCudartUnloading
    35,   # cudaErrorInsufficientDriver
    46,   # cudaErrorDevicesUnavailable
    100,  # cudaErrorNoDevice
    101,  # cudaErrorInvalidDevice
    209,  # cudaErrorNoKernelImageForDevice
    222,  # cudaErrorUnsupportedPtxVersion
})
_LIBRARY_ERRORS = frozenset({"CUBLASError", "CuFFTError", "CURANDError", "CUSOLVERError",
                             "CUSPARSEError", "CUTENSORError"})
_CUDA_LIBRARIES = ("libcublas", "libcufft", "libcurand", "libcusolver", "libcusparse", "libnvrtc",
                   "libnvjitlink", "libcudart", "libcuda.")
#: How to get the CUDA libraries CuPy wheels leave out.
CTK_HINT = ("install the CUDA libraries CuPy loads: pip install 'cupy-cuda12x[ctk]' (or "
            "'cupy-cuda13x[ctk]' for CUDA 13), or use an image with the CUDA toolkit")


def _classify_by_name(exc: BaseException) -> str | None:
    """Kinds recognised without importing the library that raised them (it may be missing)."""
    name, module = type(exc).__name__, type(exc).__module__ or ""
    if name in _LIBRARY_ERRORS and module.startswith(("cupy", "cupy_backends")):
        return LIBRARY
    if name in ("NVRTCError", "CompileException") and module.startswith(("cupy", "cupy_backends")):
        return COMPILE
    message = str(exc)
    if name == "DynamicLibNotFoundError" or (
            isinstance(exc, (ImportError, OSError, RuntimeError))
            and any(lib in message for lib in _CUDA_LIBRARIES)
            and ("cannot open shared object" in message or "Failure finding" in message
                 or "failed to load" in message.lower())):
        return UNAVAILABLE
    return None
