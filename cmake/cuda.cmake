# Every CUDA-specific build setting: explicit architectures, the C++ standard, visibility and
# the CUDA libraries, for libkvcap's device objects (kernels/cuda, runtime), the calibration
# tools' GPU paths (calibrate/cuda) and the GPU benchmark.
find_package(CUDAToolkit REQUIRED GLOBAL)

function(kvcap_cuda_settings target)
  set_target_properties(${target} PROPERTIES
    CUDA_ARCHITECTURES "${KVCAP_CUDA_ARCHITECTURES}"
    CUDA_STANDARD 17
    CUDA_VISIBILITY_PRESET hidden
    POSITION_INDEPENDENT_CODE ON)
  target_link_libraries(${target} PRIVATE kvcap_internal)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endfunction()

# The CUDA runtime for a library target. The static runtime keeps libkvcap loadable where no
# CUDA libraries are installed; without a driver or device it reports zero devices.
function(kvcap_link_cudart target scope)
  target_link_libraries(${target} ${scope} CUDA::cudart_static ${CMAKE_DL_LIBS})
endfunction()
