# Build only the parts of llama.cpp that localllm runs: libllama, ggml (base, cpu, rpc, and any
# GPU backend asked for) and, from llama-cpp-python's own CMakeLists, libmtmd for images.
#
# Used as CMAKE_ARGS="-DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file>": CMake includes it right
# after the project("llama.cpp") call of the vendored llama.cpp, which comes after
# llama-cpp-python 0.3.36 forced LLAMA_BUILD_COMMON on, and before llama.cpp's option() reads
# it. llama-common (argument parsing, downloads, chat templates for llama.cpp's own tools) and
# the cpp-httplib it alone pulls in were about a third of the compile, and nothing in
# llama-cpp-python or localllm loads libllama-common.so.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)

# One file per library: without a versioned SONAME, CMake writes libllama.so alone instead of
# libllama.so, .so.0 and .so.0.5.0, which a wheel (no symlinks) stores as three full copies.
set(CMAKE_PLATFORM_NO_VERSIONED_SONAME ON CACHE BOOL "shared libraries without SOVERSION" FORCE)
