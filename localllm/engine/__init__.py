"""The engine room: every use of llama.cpp's C API, ctypes and NVML, the runner's model and its
lifecycle included (loaded.py; the runner's slot loop calls llama.cpp only through here). Model
and context parameters are built from a Plan here once, for the runner, dry runs and
evaluation alike, so a dry run measures the context that will run."""
