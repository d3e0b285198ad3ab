#!/bin/bash
# The peer's source, small enough to carry to the GPU machine: llama.cpp as vendored in the llama-cpp-python sdist,
# cut to the CUDA and CPU backends (no docs, models, tests, examples). ~4.4 MB for 0.3.36.
#   bash benchmarks/peer/trim_llama_src.sh .peer/llama.tar.xz      (.peer/ is git-ignored; carry it)
set -eu
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$(dirname "$1")"; out=$(readlink -f "$1"); work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
mv "$work"/llama_cpp_python-*/vendor/llama.cpp "$work/llama.cpp"
cd "$work/llama.cpp"
rm -rf docs models media tests benches pocs tools/ui app skills ci .github examples/*
touch examples/CMakeLists.txt
for backend in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn rpc; do
  rm -rf "ggml/src/ggml-$backend"
done
cd "$work" && tar cJf "$out" llama.cpp
ls -la "$out"
