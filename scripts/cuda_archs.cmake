# Which CUDA architectures dtenjax's kernels are built for: included by CMakeLists.txt before
# enable_language(CUDA), and run alone by scripts/setup.sh (`cmake -P scripts/cuda_archs.cmake`
# prints the list and why, what a build here would choose) for its progress line. Sets
# DTENJAX_CUDA_ARCHS_CHOSEN (CMake's CUDA_ARCHITECTURES syntax), DTENJAX_CUDA_ARCHS_SOURCE and
# DTENJAX_CUDA_COMPILE_CHECK (case 3 below):
# 1. DTENJAX_CUDA_ARCHS in the environment (e.g. "80;90", "100-real;120"), or
#    CMAKE_CUDA_ARCHITECTURES, when given (the environment variable wins over a value cached by an
#    earlier configure of the same build directory, so `DTENJAX_CUDA_ARCHS=... bash
#    scripts/setup.sh` takes effect on a rebuild; CMakeLists.txt caches it);
# 2. else the GPUs of this machine (nvidia-smi's compute capabilities): one architecture per GPU
#    kind, SASS and PTX, so a build for the local GPU costs one nvcc pass per kind;
# 3. else (no GPU) DTENJAX_CUDA_ARCHS_WITHOUT_GPU from the environment when given: scripts/test.sh
#    asks for "80-virtual", one device-code pass per .cu file to compute_80 PTX, so the suite's
#    build still compiles every kernel, for a fraction of the CPU of the default list
#    (docs/testing.md). Such a build is a compile check of kernels this machine cannot run, so it
#    also sets DTENJAX_CUDA_COMPILE_CHECK: CMakeLists.txt compiles the device code unoptimised
#    (cicc and ptxas at -O0, for about a third of their CPU) and keeps each unit's PTX, which
#    scripts/test.sh has ptxas compile to sm_80 beside the tests (scripts/ptxas_check.sh);
# 4. else sm_80 and sm_90 SASS plus compute_90 PTX, which the driver compiles for newer GPUs
#    (Blackwell): A100/A10/RTX 30-40 and H100/H200 natively. The README's default for a build
#    machine without a GPU (images for GPU clusters): an H100 must not JIT from sm_80 PTX.
# Every extra architecture is one more device-code pass per .cu file in the set-up's build.
set(DTENJAX_CUDA_COMPILE_CHECK OFF)
if(DEFINED ENV{DTENJAX_CUDA_ARCHS} AND NOT "$ENV{DTENJAX_CUDA_ARCHS}" STREQUAL "")
  set(DTENJAX_CUDA_ARCHS_CHOSEN "$ENV{DTENJAX_CUDA_ARCHS}")
  set(DTENJAX_CUDA_ARCHS_SOURCE "DTENJAX_CUDA_ARCHS")
elseif(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(DTENJAX_CUDA_ARCHS_CHOSEN "${CMAKE_CUDA_ARCHITECTURES}")
  set(DTENJAX_CUDA_ARCHS_SOURCE "CMAKE_CUDA_ARCHITECTURES")
elseif(DEFINED ENV{DTENJAX_CUDA_ARCH} AND NOT "$ENV{DTENJAX_CUDA_ARCH}" STREQUAL "")
  set(DTENJAX_CUDA_ARCHS_CHOSEN "$ENV{DTENJAX_CUDA_ARCH}")   # the old name
  set(DTENJAX_CUDA_ARCHS_SOURCE "DTENJAX_CUDA_ARCH")
else()
  set(_dtenjax_local_archs "")
  find_program(_dtenjax_nvidia_smi nvidia-smi)
  if(_dtenjax_nvidia_smi)
    execute_process(COMMAND ${_dtenjax_nvidia_smi} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE _dtenjax_caps RESULT_VARIABLE _dtenjax_smi_rc
                    ERROR_QUIET TIMEOUT 20)
    if(_dtenjax_smi_rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _dtenjax_caps "${_dtenjax_caps}")
      foreach(_cap IN LISTS _dtenjax_caps)
        string(REPLACE "." "" _arch "${_cap}")
        list(APPEND _dtenjax_local_archs "${_arch}")
      endforeach()
      list(REMOVE_DUPLICATES _dtenjax_local_archs)
    endif()
  endif()
  if(_dtenjax_local_archs)
    set(DTENJAX_CUDA_ARCHS_CHOSEN "${_dtenjax_local_archs}")
    set(DTENJAX_CUDA_ARCHS_SOURCE "this machine's GPUs")
  elseif(DEFINED ENV{DTENJAX_CUDA_ARCHS_WITHOUT_GPU}
         AND NOT "$ENV{DTENJAX_CUDA_ARCHS_WITHOUT_GPU}" STREQUAL "")
    set(DTENJAX_CUDA_ARCHS_CHOSEN "$ENV{DTENJAX_CUDA_ARCHS_WITHOUT_GPU}")
    set(DTENJAX_CUDA_ARCHS_SOURCE
        "DTENJAX_CUDA_ARCHS_WITHOUT_GPU, no GPU here: device code at -O0, a compile check")
    set(DTENJAX_CUDA_COMPILE_CHECK ON)
  else()
    set(DTENJAX_CUDA_ARCHS_CHOSEN "80-real;90")
    set(DTENJAX_CUDA_ARCHS_SOURCE "the default without a GPU")
  endif()
endif()
if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  message("${DTENJAX_CUDA_ARCHS_CHOSEN} (${DTENJAX_CUDA_ARCHS_SOURCE})")
endif()
