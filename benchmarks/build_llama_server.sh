#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (continuous batching: -np N --cont-batching) for
# benchmarks/serve_load.py --against llama.cpp.
#
#   benchmarks/build_llama_server.sh SOURCE [WORKDIR]
#
# SOURCE is a llama.cpp checkout, or a source tarball that holds one: llama.cpp's own release
# tarball, or llama-cpp-python's sdist (which vendors it under vendor/llama.cpp). WORKDIR (default
# /tmp/llserver-src) receives the extracted sources and the build folder. The last line printed is
# the path of the binary; pass it as `serve_load.py --llama-server PATH` or env LLAMA_SERVER.
# Environment: JOBS (default: the CPU count), NICE (default 10).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: build_llama_server.sh SOURCE (a llama.cpp checkout or a source tarball) [WORKDIR]" >&2
    exit 2
fi
src=$1
work=${2:-/tmp/llserver-src}
jobs=${JOBS:-$(nproc)}
niceness=${NICE:-10}

if [ -f "$src" ]; then
    mkdir -p "$work"
    tar -xzf "$src" -C "$work"
    search=$work
elif [ -d "$src" ]; then
    search=$src
else
    echo "build_llama_server.sh: no such tarball or folder: $src" >&2
    exit 2
fi

# The llama.cpp root: the folder whose CMakeLists.txt sits beside tools/server (or examples/server).
root=""
while IFS= read -r f; do
    d=$(dirname "$f")
    if [ -d "$d/tools/server" ] || [ -d "$d/examples/server" ]; then root=$d; break; fi
done < <(find "$search" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp*' 2>/dev/null; \
         find "$search" -maxdepth 1 -name CMakeLists.txt)
if [ -z "$root" ]; then
    echo "build_llama_server.sh: no llama.cpp sources (CMakeLists.txt beside tools/server) under $search" >&2
    exit 2
fi

build=$root/build
nice -n "$niceness" cmake -S "$root" -B "$build" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=Release >&2
nice -n "$niceness" cmake --build "$build" --target llama-server -j "$jobs" >&2

bin=$build/bin/llama-server
if [ ! -x "$bin" ]; then
    echo "build_llama_server.sh: the build finished but $bin is missing" >&2
    exit 1
fi
echo "$bin"
