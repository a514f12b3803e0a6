# ctest "consumer.install": installs the current build of ropekv into a fresh
# prefix, configures and builds examples/consumer against that prefix alone
# (find_package(ropekv CONFIG REQUIRED) through CMAKE_PREFIX_PATH), and runs
# the program.
#
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=...
#         -DCXX_COMPILER=... -DBUILD_TYPE=... [-DSANITIZE=...] -P consumer_test.cmake
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "consumer_test.cmake: ${var} not set")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("== ${what}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc})")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

run("install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(f include/ropekv/ropekv.h include/ropekv/reference.h)
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "the install has no ${f}")
  endif()
endforeach()

set(flags "")
if(SANITIZE)  # an instrumented static library needs an instrumented program
  set(flags "-DCMAKE_CXX_FLAGS=-fsanitize=${SANITIZE}"
            "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=${SANITIZE}")
endif()
run("configure" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/examples/consumer" -B "${build}"
    -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${flags})

# The package must come from the fresh prefix, not from the build tree.
file(STRINGS "${build}/CMakeCache.txt" dir REGEX "^ropekv_DIR:")
string(FIND "${dir}" "${prefix}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "ropekv was not found in ${prefix}: ${dir}")
endif()

run("build" "${CMAKE_COMMAND}" --build "${build}")
run("run" "${build}/app")
