"""The runner: one loaded model in a child process.

`protocol` holds the messages both sides speak and the op table, `process` is the daemon's
handle on the child, `engine` (imported only inside the child) runs the slot loop over the
model llama/loaded.py holds. `python -m localllm.daemon.runner`
starts a child.
"""
