#!/bin/bash
# Build llama-bench, llama-completion and llama-quantize (CUDA, sm_90) from the trimmed source archive into $2 (default
# /tmp/llama.cpp). Progress in $2.log; "$2.done" holds the exit status when it ends. Run it under setsid so it outlives the call that starts it.
#   setsid nohup bash benchmarks/peer/build_llama.sh $PWD/.peer/llama.tar.xz /tmp/llama.cpp &
archive=$1; dest=${2:-/tmp/llama.cpp}; jobs=${BUILD_JOBS:-$(nproc)}
targets=${BUILD_TARGETS:-llama-bench llama-completion llama-quantize}  # BUILD_TARGETS=llama-bench: the greedy peer alone, sooner
rm -rf "$dest" "$dest.done" && mkdir -p "$(dirname "$dest")" && tar xJf "$archive" -C "$(dirname "$dest")" && \
  { [ "$(dirname "$dest")/llama.cpp" = "$dest" ] || mv "$(dirname "$dest")/llama.cpp" "$dest"; } && cd "$dest" && \
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$dest.log" 2>&1 && \
  cmake --build build --target $targets -j "$jobs" >> "$dest.log" 2>&1
echo "rc=$?" > "$dest.done"
