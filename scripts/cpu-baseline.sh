#!/usr/bin/env bash
# Prints the compiler flags that make this machine's CPU the baseline of a
# build for it (nothing where the CPU has no AVX2): -march=haswell -maes. With
# AVX2 as the baseline Highway compiles only its AVX2 and AVX-512 kernels;
# -march=haswell alone does not enable AES, which Highway's AVX2 target
# requires, so without -maes its baseline stays at SSSE3 and the SSE4 and
# SSSE3 kernels are compiled too. Used by setup.sh (the Python package),
# sanitize.sh and gpu-check.sh; the regular C++ build compiles every target.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw aes /proc/cpuinfo; then
  echo "-march=haswell -maes"
fi
