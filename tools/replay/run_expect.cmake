# cmake -DCMD=<prog;args...> -DEXPECT_RC=<n>[|<n>...] -DEXPECT_REGEX=<re> -P run_expect.cmake
# Runs CMD; passes when its exit status is EXPECT_RC and its output (stdout
# and stderr) matches EXPECT_REGEX. Prints the output either way.
# "<NL>" in EXPECT_REGEX stands for a newline.
cmake_minimum_required(VERSION 3.24)
string(REPLACE "<NL>" "\n" EXPECT_REGEX "${EXPECT_REGEX}")
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
# EXPECT_RC may list several accepted statuses: "2|0".
string(REPLACE "|" ";" _accepted "${EXPECT_RC}")
if(NOT "${rc}" IN_LIST _accepted)
  message(FATAL_ERROR "exit status ${rc}, expected ${EXPECT_RC}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "output does not match: ${EXPECT_REGEX}")
endif()
