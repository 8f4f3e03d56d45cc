"""The runner: one loaded model in a child process.

`protocol` holds the messages both sides speak, `process` is the daemon's handle on the child,
`engine` (imported only inside the child) drives llama.cpp. `python -m localllm.daemon.runner`
starts a child.
"""
