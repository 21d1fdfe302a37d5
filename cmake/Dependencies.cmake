# Every dependency comes from a Debian 12 package (scripts/run installs them).
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)

# Boost.Asio (libboost-dev): the event loop of the tcp provider and the bootstrap.
find_package(Boost 1.74 REQUIRED)
add_library(r2ccl_asio INTERFACE)
target_link_libraries(r2ccl_asio INTERFACE Boost::boost Threads::Threads)
target_compile_definitions(r2ccl_asio INTERFACE BOOST_ASIO_NO_DEPRECATED BOOST_ASIO_DISABLE_BOOST_REGEX)

# hwloc (libhwloc-dev): NUMA and PCI locality of NICs.
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
# rdma-core (libibverbs-dev, librdmacm-dev): the verbs provider.
pkg_check_modules(IBVERBS REQUIRED IMPORTED_TARGET libibverbs)
pkg_check_modules(RDMACM REQUIRED IMPORTED_TARGET librdmacm)
# prometheus-cpp (prometheus-cpp-dev): the monitor's exposition.
find_package(prometheus-cpp CONFIG REQUIRED)
# fmt (libfmt-dev): formatting of messages and tables (g++ 12 has no <format>).
find_package(fmt REQUIRED)
# CLI11 (libcli11-dev): command-line parsing of the benchmarks and tools.
find_package(CLI11 CONFIG REQUIRED)
# nlohmann-json (nlohmann-json3-dev): JSON output of the benchmarks.
find_package(nlohmann_json 3.10 REQUIRED)
# xxHash (libxxhash-dev): per-block checksums of KV transfers (R2CCL_KV_VERIFY).
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
# GoogleTest (libgtest-dev): unit tests.
if(R2CCL_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# CUDA and NCCL are optional.
set(R2CCL_HAVE_CUDA OFF)
if(NOT R2CCL_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    set(R2CCL_HAVE_CUDA ON)
  elseif(R2CCL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "R2CCL_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "r2ccl: CUDA parts ${R2CCL_HAVE_CUDA}")
