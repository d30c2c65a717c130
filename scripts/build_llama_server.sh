#!/usr/bin/env bash
# llama.cpp's own C++ `llama-server` from the llama-cpp-python 0.3.36 sdist, for
# benchmarks/bench_server.py (built once, then cached; see build_llama_cpp_tool.sh). Prints its path.
exec bash "$(dirname "$0")/build_llama_cpp_tool.sh" llama-server
