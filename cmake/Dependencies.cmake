# Every dependency comes from a Debian 12 package; scripts/run installs them all.
#
# r2ccl_dependency(<NAME> DEBIAN <package> (PKGCONFIG <module> | CMAKE <package> [CONFIG])
#                  [VERSION <v>] [OPTIONAL])
# finds one dependency. When a required one is missing, configuring stops with an error that names
# the Debian package that provides it. Every dependency found is written, with the file that proved
# it, to ${PROJECT_BINARY_DIR}/r2ccl-dependencies.tsv; tests/check_packages.py checks that each such
# file belongs to the package named here and that scripts/run installs that package.
find_package(PkgConfig REQUIRED)
set(R2CCL_DEPENDENCY_MANIFEST ${PROJECT_BINARY_DIR}/r2ccl-dependencies.tsv)
file(WRITE ${R2CCL_DEPENDENCY_MANIFEST} "# name\tdebian package\tfile that proves it\n")

function(r2ccl_dependency name)
  cmake_parse_arguments(PARSE_ARGV 1 dep "OPTIONAL;CONFIG" "DEBIAN;PKGCONFIG;CMAKE;VERSION" "")
  if(NOT dep_DEBIAN OR (NOT dep_PKGCONFIG AND NOT dep_CMAKE))
    message(FATAL_ERROR "r2ccl_dependency(${name}): DEBIAN and PKGCONFIG or CMAKE are required")
  endif()
  set(found FALSE)
  set(proof "")
  if(dep_PKGCONFIG)
    set(spec ${dep_PKGCONFIG})
    if(dep_VERSION)
      set(spec "${dep_PKGCONFIG}>=${dep_VERSION}")
    endif()
    pkg_check_modules(${name} QUIET IMPORTED_TARGET GLOBAL ${spec})
    if(${name}_FOUND)
      set(found TRUE)
      execute_process(COMMAND ${PKG_CONFIG_EXECUTABLE} --path ${dep_PKGCONFIG}
        OUTPUT_VARIABLE proof OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
    set(what "pkg-config module '${dep_PKGCONFIG}'")
  else()
    set(mode "")
    if(dep_CONFIG)
      set(mode CONFIG)
    endif()
    find_package(${dep_CMAKE} ${dep_VERSION} ${mode} QUIET)
    if(${dep_CMAKE}_FOUND)
      set(found TRUE)
      if(${dep_CMAKE}_CONFIG)
        set(proof ${${dep_CMAKE}_CONFIG})
      elseif(${dep_CMAKE}_INCLUDE_DIRS)
        list(GET ${dep_CMAKE}_INCLUDE_DIRS 0 proof)
      endif()
    endif()
    set(what "CMake package '${dep_CMAKE}'")
  endif()
  if(dep_VERSION)
    string(APPEND what " (version ${dep_VERSION} or newer)")
  endif()
  set(${name}_FOUND ${found} PARENT_SCOPE)
  if(found)
    file(APPEND ${R2CCL_DEPENDENCY_MANIFEST} "${name}\t${dep_DEBIAN}\t${proof}\n")
  elseif(NOT dep_OPTIONAL)
    message(FATAL_ERROR
      "r2ccl: ${what} was not found.\n"
      "It comes from the Debian package '${dep_DEBIAN}': apt-get install ${dep_DEBIAN}\n"
      "(scripts/run installs every package r2ccl needs).")
  else()
    message(STATUS "r2ccl: optional ${what} not found (Debian package: ${dep_DEBIAN})")
  endif()
endfunction()

find_package(Threads REQUIRED)

# Boost.Asio (libboost-dev): the event loop of the tcp provider and the bootstrap.
r2ccl_dependency(Boost DEBIAN libboost-dev CMAKE Boost VERSION 1.74)
add_library(r2ccl_asio INTERFACE)
target_link_libraries(r2ccl_asio INTERFACE Boost::boost Threads::Threads)
target_compile_definitions(r2ccl_asio INTERFACE BOOST_ASIO_NO_DEPRECATED BOOST_ASIO_DISABLE_BOOST_REGEX)

# OpenSSL's libcrypto: HMAC-SHA256 for the challenge-response of every hello (the token never
# crosses the wire) and the probe tag derived from the token.
r2ccl_dependency(OPENSSL DEBIAN libssl-dev PKGCONFIG libcrypto)
# hwloc: NUMA and PCI locality of NICs.
r2ccl_dependency(HWLOC DEBIAN libhwloc-dev PKGCONFIG hwloc)
# rdma-core's libibverbs: the verbs provider. Optional: without it r2ccl builds without verbs.
r2ccl_dependency(IBVERBS DEBIAN libibverbs-dev PKGCONFIG libibverbs OPTIONAL)
if(R2CCL_METRICS OR R2CCL_BUILD_TOOLS)
  # prometheus-cpp: the monitor's exposition (and libr2ccl's R2CCL_METRICS_PORT).
  r2ccl_dependency(prometheus-cpp DEBIAN prometheus-cpp-dev CMAKE prometheus-cpp CONFIG)
  # civetweb (a dependency of prometheus-cpp-dev): /healthz on the exporter's own server.
  r2ccl_dependency(civetweb DEBIAN libcivetweb-dev CMAKE civetweb CONFIG)
  # CLI11: command-line parsing of the benchmarks and the monitor.
  r2ccl_dependency(CLI11 DEBIAN libcli11-dev CMAKE CLI11 CONFIG)
endif()
# fmt: formatting of messages and tables (g++ 12 has no <format>).
r2ccl_dependency(fmt DEBIAN libfmt-dev CMAKE fmt CONFIG)
if(R2CCL_BUILD_TOOLS)
  # nlohmann-json: JSON output of the benchmarks.
  r2ccl_dependency(nlohmann_json DEBIAN nlohmann-json3-dev CMAKE nlohmann_json VERSION 3.10 CONFIG)
endif()
# xxHash: per-block checksums of KV transfers (R2CCL_KV_VERIFY).
r2ccl_dependency(XXHASH DEBIAN libxxhash-dev PKGCONFIG libxxhash)
# GoogleTest: unit tests.
if(R2CCL_BUILD_TESTS)
  r2ccl_dependency(GTest DEBIAN libgtest-dev CMAKE GTest CONFIG)
endif()

# CUDA and NCCL are optional; they come from NVIDIA's CUDA toolkit, not from Debian.
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
