"""The runner, the engine's one child program (`python -m localllm.engine.runner`): one loaded
model served to the daemon, or one of the tuner's measurements.

`protocol` holds the messages both sides speak and the op table, `load` the daemon's load
decision that opens a runner of a model, `engine` (imported only inside the child) runs the slot
loop over the model engine/loaded.py holds, `tuner_ops` answers the tuner's ops. The daemon's
handle on a child is engine/local.py, the tuner's engine/probing.py.
"""
