# Finds RMM for glake's RMM tests and benchmark (GLAKE_WITH_RMM): its headers, the CCCL it was
# built with, NVTX, librmm and librapids_logger, directly under GLAKE_RMM_ROOT. RMM's own CMake
# package config needs CMake >= 4, so it is not used.
#
# GLAKE_RMM_ROOT may be:
#   - a directory holding the pip wheels' packages `librmm/` and `rapids_logger/`: a venv's
#     site-packages after `pip install librmm-cu13==26.10.* rapids-logger`, or the two wheels
#     unzipped into one directory (`unzip -o librmm_cu13-*.whl -d DIR; unzip -o rapids_logger-*.whl -d DIR`);
#   - the venv itself (its lib/python3.*/site-packages is searched);
#   - an install prefix with include/rmm, include/rapids and lib/librmm.so (conda's layout).
#
# Defines the INTERFACE target glake_rmm_deps (glake's own programs only; never installed) and
# glake_use_rmm(<target>), which links it and puts RMM's CCCL first on <target>'s include path:
# the CUDA toolkit's CCCL (3.0 in CUDA 13.0) must not be found before it.
if(NOT TARGET CUDA::cudart)
  message(FATAL_ERROR "glake: GLAKE_WITH_RMM=ON needs the CUDA toolkit (CUDA::cudart), which was not found; "
                      "set CUDAToolkit_ROOT or turn GLAKE_WITH_RMM off")
endif()
if(NOT GLAKE_RMM_ROOT)
  message(FATAL_ERROR "glake: GLAKE_WITH_RMM=ON needs -DGLAKE_RMM_ROOT=<dir> holding librmm/ and rapids_logger/ "
                      "(a venv's site-packages after `pip install librmm-cu13==26.10.* rapids-logger`, or the "
                      "two wheels unzipped into one directory)")
endif()

set(glake_rmm_roots "${GLAKE_RMM_ROOT}")
file(GLOB glake_rmm_site_packages LIST_DIRECTORIES true "${GLAKE_RMM_ROOT}/lib/python3*/site-packages")
list(APPEND glake_rmm_roots ${glake_rmm_site_packages})

# Searched only under GLAKE_RMM_ROOT; a new root forgets what was found under the old one.
if(NOT "${GLAKE_RMM_ROOT}" STREQUAL "${glake_rmm_searched_root}")
  foreach(var GLAKE_RMM_INCLUDE_DIR GLAKE_RMM_CCCL_INCLUDE_DIR GLAKE_RMM_LOGGER_INCLUDE_DIR GLAKE_RMM_LIBRARY
              GLAKE_RMM_LOGGER_LIBRARY)
    unset(${var} CACHE)
  endforeach()
  set(glake_rmm_searched_root "${GLAKE_RMM_ROOT}" CACHE INTERNAL "")
endif()
find_path(GLAKE_RMM_INCLUDE_DIR rmm/version_config.hpp
  PATHS ${glake_rmm_roots} PATH_SUFFIXES librmm/include include NO_DEFAULT_PATH)
find_path(GLAKE_RMM_CCCL_INCLUDE_DIR cuda/memory_resource
  PATHS ${glake_rmm_roots} PATH_SUFFIXES librmm/include/rapids include/rapids NO_DEFAULT_PATH)
find_path(GLAKE_RMM_LOGGER_INCLUDE_DIR rapids_logger/logger.hpp
  PATHS ${glake_rmm_roots} PATH_SUFFIXES rapids_logger/include include NO_DEFAULT_PATH)
find_library(GLAKE_RMM_LIBRARY rmm
  PATHS ${glake_rmm_roots} PATH_SUFFIXES librmm/lib64 librmm/lib lib64 lib NO_DEFAULT_PATH)
find_library(GLAKE_RMM_LOGGER_LIBRARY rapids_logger
  PATHS ${glake_rmm_roots} PATH_SUFFIXES rapids_logger/lib64 rapids_logger/lib lib64 lib NO_DEFAULT_PATH)

set(glake_rmm_missing "")
foreach(pair "GLAKE_RMM_INCLUDE_DIR;rmm/version_config.hpp"
             "GLAKE_RMM_CCCL_INCLUDE_DIR;RMM's CCCL (rapids/cuda/memory_resource)"
             "GLAKE_RMM_LOGGER_INCLUDE_DIR;rapids_logger/logger.hpp"
             "GLAKE_RMM_LIBRARY;librmm.so" "GLAKE_RMM_LOGGER_LIBRARY;librapids_logger.so")
  list(GET pair 0 var)
  list(GET pair 1 what)
  if(NOT ${var})
    list(APPEND glake_rmm_missing "${what}")
  endif()
endforeach()
if(GLAKE_RMM_INCLUDE_DIR AND NOT EXISTS "${GLAKE_RMM_INCLUDE_DIR}/nvtx3/nvToolsExt.h")
  list(APPEND glake_rmm_missing "nvtx3/nvToolsExt.h (beside rmm/)")
endif()
if(glake_rmm_missing)
  list(JOIN glake_rmm_missing ", " glake_rmm_missing)
  message(FATAL_ERROR "glake: GLAKE_WITH_RMM=ON, but GLAKE_RMM_ROOT=${GLAKE_RMM_ROOT} lacks ${glake_rmm_missing}. "
                      "It must hold librmm/ and rapids_logger/ (a venv's site-packages after "
                      "`pip install librmm-cu13==26.10.* rapids-logger`, or the two wheels unzipped into one "
                      "directory), or be a prefix with include/rmm, include/rapids and lib/librmm.so")
endif()

file(STRINGS "${GLAKE_RMM_INCLUDE_DIR}/rmm/version_config.hpp" glake_rmm_version_line
     REGEX "#define RMM_VERSION \"[0-9.]+\"")
string(REGEX MATCH "[0-9][0-9.]*" GLAKE_RMM_VERSION "${glake_rmm_version_line}")
file(STRINGS "${GLAKE_RMM_CCCL_INCLUDE_DIR}/cuda/std/__cccl/version.h" glake_rmm_cccl_line
     REGEX "#define CCCL_VERSION [0-9]+")
string(REGEX MATCH "[0-9]+$" glake_rmm_cccl_version "${glake_rmm_cccl_line}")
math(EXPR glake_rmm_cccl_major "${glake_rmm_cccl_version} / 1000000")
math(EXPR glake_rmm_cccl_minor "(${glake_rmm_cccl_version} / 1000) % 1000")
message(STATUS "glake: RMM ${GLAKE_RMM_VERSION} (CCCL ${glake_rmm_cccl_major}.${glake_rmm_cccl_minor}) from "
               "${GLAKE_RMM_INCLUDE_DIR}")

# RMM's CCCL is not among these: glake_use_rmm puts it on each target, first.
add_library(glake_rmm_deps INTERFACE)
target_include_directories(glake_rmm_deps SYSTEM INTERFACE "${GLAKE_RMM_INCLUDE_DIR}" "${GLAKE_RMM_LOGGER_INCLUDE_DIR}")
# librmm.so finds librapids_logger.so, which lies in another directory, only through the copy this
# program loads itself (by soname): link it even where the linker drops unused libraries.
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  target_link_options(glake_rmm_deps INTERFACE "LINKER:--no-as-needed")
endif()
target_link_libraries(glake_rmm_deps INTERFACE "${GLAKE_RMM_LOGGER_LIBRARY}" "${GLAKE_RMM_LIBRARY}" CUDA::cudart)

# glake_use_rmm(<target>): links glake_rmm_deps, with RMM's CCCL ahead of every other include
# directory of <target>. For C++ sources it is a system directory (-isystem, placed before the
# toolkit's, which CMake also passes as -isystem). For CUDA sources it must be a plain -I: nvcc
# itself adds the toolkit's include directory with -I (after the command line's -I, before every
# -isystem), and that directory holds nv/target, which CCCL >= 3.5's cub needs in its own newer
# version (the toolkit's one lacks NV_HAS_FEATURE_SM_100f).
function(glake_use_rmm target)
  target_include_directories(${target} SYSTEM BEFORE PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${GLAKE_RMM_CCCL_INCLUDE_DIR}>")
  target_include_directories(${target} BEFORE PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:${GLAKE_RMM_CCCL_INCLUDE_DIR}>")
  target_link_libraries(${target} PRIVATE glake_rmm_deps)
endfunction()
