"""The real runner, except that the first one started (while $GARBAGE_MARKER does not exist)
writes a line that is not JSON after its first token: a runner gone wrong, for the tests of
how the daemon fails closed."""

import os
import sys

from localllm.engine.runner import __main__ as runner

marker = os.environ["GARBAGE_MARKER"]
if not os.path.exists(marker):
    open(marker, "w").close()
    send = runner.Channel.send

    def send_then_garbage(self, message):
        send(self, message)
        if message.get("event") == "token":
            with self._lock:
                self._out.write("this is not a protocol line\n")

    runner.Channel.send = send_then_garbage
sys.exit(runner.main())
