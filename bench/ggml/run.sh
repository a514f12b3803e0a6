#!/usr/bin/env bash
# The ggml peer of the CPU benchmarks, built from source here: llama.cpp's
# ggml as vendored in llama-cpp-python's source distribution on PyPI (a
# pinned version, checked by its sha256; ggml 0.25.3), built CPU-only for this
# machine (bench/ggml/CMakeLists.txt) with bench/ggml/ggml_peer.cc, then run.
# Writes the CSV that `bench/cpu_peers.py --ggml-csv` merges
# (impl,model,dtype,T,threads,us_per_call,GB/s; dtype f16 for the rows that
# stand for bf16) and keeps Google Benchmark's JSON beside it.
#
#   bench/ggml/run.sh [CSV] [Google Benchmark flags...]
#   e.g. bench/ggml/run.sh build/ggml-peer/ggml.csv --benchmark_filter='Llama.*T:(1|16)/'
#
# Needs python3, cmake, a C/C++ compiler and Google Benchmark (scripts/test.sh
# installs them); the download is cached in build/ggml-peer.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${GGML_PEER_DIR:-$ROOT/build/ggml-peer}
CSV=${1:-$WORK/ggml.csv}
[ $# -gt 0 ] && shift
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST=$WORK/llama_cpp_python-$VERSION.tar.gz
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp/ggml
mkdir -p "$WORK"

if [ ! -f "$SRC/CMakeLists.txt" ]; then
  if ! echo "$SHA256  $SDIST" | sha256sum -c --status 2>/dev/null; then
    echo "downloading llama-cpp-python $VERSION (source) from PyPI"
    python3 - "$VERSION" "$SDIST" <<'PY'
import re, sys, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/simple/llama-cpp-python/"  # PEP 503, as pip reads it
page = urllib.request.urlopen(index, timeout=60).read().decode()
name = re.escape(f"llama_cpp_python-{version}.tar.gz")
href = re.search(r'href="([^"#]*' + name + ')', page).group(1)
urllib.request.urlretrieve(urllib.parse.urljoin(index, href), out)
PY
    echo "$SHA256  $SDIST" | sha256sum -c
  fi
  tar -xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
fi

cmake -S "$ROOT/bench/ggml" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_SOURCE_DIR="$SRC" >/dev/null
cmake --build "$WORK/build" --target ggml_peer -j"$(nproc)"

JSON=${CSV%.csv}.json
"$WORK/build/ggml_peer" --benchmark_counters_tabular=true --benchmark_out="$JSON" \
  --benchmark_out_format=json "$@"
python3 - "$JSON" "$CSV" <<'PY'
import json, re, sys
rows = json.load(open(sys.argv[1]))["benchmarks"]
with open(sys.argv[2], "w") as f:
    f.write("impl,model,dtype,T,threads,us_per_call,GB/s\n")
    for r in rows:
        m = re.match(r"ggml/([^/]+)/(\w+)/threads:(\d+)/T:(\d+)", r["name"])
        if m and "us_per_call" in r:
            model, dtype, threads, T = m.groups()
            f.write(f"ggml,{model},{dtype},{T},{threads},{r['us_per_call']:.3f},{r['GB/s']:.3f}\n")
print("wrote", sys.argv[2])
PY
