# Configures, builds and runs the consumer project in this directory against glake.
#   cmake -DMODE=find_package|add_subdirectory|fetchcontent -DGLAKE_SOURCE_DIR=... \
#         -DGLAKE_BINARY_DIR=... -DWORK_DIR=... [-DCONFIG=...] [-DGENERATOR=...] \
#         [-DMAKE_PROGRAM=...] [-DCXX_COMPILER=...] [-DBOOST_DIR=...] [-DEXPECT_CHECKED=0|1] \
#         [-DEXPECT_CUDA=0|1] -P run.cmake
# find_package installs GLAKE_BINARY_DIR into WORK_DIR/prefix first and checks that the consumer
# found glake there (not in the build tree or a package registry).
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS MODE GLAKE_SOURCE_DIR GLAKE_BINARY_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run_step what)
  message(STATUS "[package.${MODE}] ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "[package.${MODE}] ${what} failed (${result}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(configure_args
  -S "${CMAKE_CURRENT_LIST_DIR}" -B "${build}"
  "-DGLAKE_CONSUMER_MODE=${MODE}"
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(BOOST_DIR)
  list(APPEND configure_args "-DBoost_DIR=${BOOST_DIR}")
endif()
if(CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
  set(config_args --config "${CONFIG}")
endif()

if(MODE STREQUAL "find_package")
  run_step("install to ${prefix}"
    "${CMAKE_COMMAND}" --install "${GLAKE_BINARY_DIR}" --prefix "${prefix}" ${config_args})
  list(APPEND configure_args "-DCMAKE_PREFIX_PATH=${prefix}")
elseif(MODE STREQUAL "add_subdirectory")
  list(APPEND configure_args "-DGLAKE_SOURCE_DIR=${GLAKE_SOURCE_DIR}")
elseif(MODE STREQUAL "fetchcontent")
  list(APPEND configure_args "-DFETCHCONTENT_SOURCE_DIR_GLAKE=${GLAKE_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run.cmake: unknown MODE '${MODE}'")
endif()

run_step("configure" "${CMAKE_COMMAND}" ${configure_args})

if(MODE STREQUAL "find_package")
  file(STRINGS "${build}/CMakeCache.txt" glake_dir_line REGEX "^glake_DIR:")
  string(REGEX REPLACE "^glake_DIR:[A-Z]+=" "" glake_dir "${glake_dir_line}")
  cmake_path(IS_PREFIX prefix "${glake_dir}" NORMALIZE found_in_prefix)
  if(NOT found_in_prefix)
    message(FATAL_ERROR "[package.${MODE}] glake was found in '${glake_dir}', not under ${prefix}")
  endif()
endif()

run_step("build" "${CMAKE_COMMAND}" --build "${build}" ${config_args})

set(exe "${build}/glake_consumer${CMAKE_EXECUTABLE_SUFFIX}")
if(CONFIG AND NOT EXISTS "${exe}")
  set(exe "${build}/${CONFIG}/glake_consumer${CMAKE_EXECUTABLE_SUFFIX}")
endif()
# glake::cuda must reach consumers of a build that has it (compiled and linked, not run).
if(EXPECT_CUDA)
  get_filename_component(exe_dir "${exe}" DIRECTORY)
  if(NOT EXISTS "${exe_dir}/glake_cuda_consumer${CMAKE_EXECUTABLE_SUFFIX}")
    message(FATAL_ERROR "[package.${MODE}] glake::cuda was not available to the consumer")
  endif()
endif()
run_step("run" "${exe}")
message(STATUS "[package.${MODE}] ${step_output}")
# An install carries this build's GLAKE_CHECKED; a subproject gets glake's default, ON.
set(checked 1)
if(MODE STREQUAL "find_package" AND DEFINED EXPECT_CHECKED)
  set(checked "${EXPECT_CHECKED}")
endif()
if(NOT step_output MATCHES "^glake consumer: 3\\.00 MiB \\(GLAKE_CHECKED=${checked}\\)")
  message(FATAL_ERROR "[package.${MODE}] unexpected output: ${step_output}")
endif()
