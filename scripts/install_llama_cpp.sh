#!/usr/bin/env bash
# Optional peer for `kvmosaic bench`: llama-cpp-python (compiles llama.cpp from source,
# about 4 minutes on a 2-core machine). The benchmark skips this peer when it is absent.
# Usage: scripts/install_llama_cpp.sh   (inside the project's virtual environment)
set -euo pipefail
if python -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already installed: $(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" pip install llama-cpp-python
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
