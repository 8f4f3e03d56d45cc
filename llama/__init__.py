"""The engine room: every use of llama.cpp's C API, ctypes and NVML outside the runner's token
loop. Model and context parameters are built from a Plan here once, for the runner, dry runs and
evaluation alike, so a dry run measures the context that will run."""
