#!/usr/bin/env bash
# llama.cpp's C++ tools (llama-bench, llama-server, llama-lookup, llama-speculative-simple) from the llama.cpp inside the
# llama-cpp-python sdist on PyPI (the registry is the only network here), built for this CPU: `make peers`.
#
# Why not GGML_NATIVE: its -march=native build emits AMX (`tilezero`) on Xeons whose VMs never grant the AMX tile
# state, and dies of SIGILL at the first matmul. So every x86 feature the CPU reports is switched on by name, AMX never.
# The tools land in $PEERS/bin (default .peers/bin); a second run with the same version and flags does nothing.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
PEERS=${PEERS:-$PWD/.peers}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$PEERS"
src=$PEERS/llama_cpp_python-$VERSION

flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DBUILD_SHARED_LIBS=OFF
       -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release)
cpu=$(grep -m1 '^flags' /proc/cpuinfo || true)
for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if [[ " $cpu " == *" ${pair%%:*} "* ]]; then flags+=("-DGGML_${pair#*:}=ON"); else flags+=("-DGGML_${pair#*:}=OFF"); fi
done
stamp="$VERSION ${flags[*]}"
if [[ -f $PEERS/bin/.built && "$(cat "$PEERS/bin/.built")" == "$stamp" ]]; then
  echo "llama.cpp tools up to date in $PEERS/bin"; exit 0
fi

start=$(date +%s)
if [[ ! -d $src ]]; then
  [[ -f $PEERS/llama_cpp_python-$VERSION.tar.gz ]] || python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$PEERS"
  tar -xzf "$PEERS/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS"
fi
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)  # (else cmake's default, make)
cmake -S "$src/vendor/llama.cpp" -B "$src/build" "${generator[@]}" "${flags[@]}" >"$PEERS/cmake.log"
cmake --build "$src/build" -j "$JOBS" --target llama-bench llama-server llama-lookup llama-speculative-simple \
    llama-cli llama-tokenize >"$PEERS/build.log"
mkdir -p "$PEERS/bin"
cp "$src"/build/bin/llama-{bench,server,lookup,speculative-simple,cli,tokenize} "$PEERS/bin/"
ln -sfn "$src/vendor/llama.cpp" "$PEERS/llama.cpp"   # convert_hf_to_gguf.py and gguf-py, for exports
echo "$stamp" >"$PEERS/bin/.built"
echo "llama.cpp $VERSION tools built in $(( $(date +%s) - start )) s into $PEERS/bin (${flags[*]})"
