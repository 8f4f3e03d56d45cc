#!/usr/bin/env python3
"""Run `localllm run MODEL` in a real terminal (tmux), type a prompt, read the answer and the
stats line off the screen with `tmux capture-pane`, then quit with /bye.

    python -m scripts.tmux_run_check [--model smollm2] [--prompt "..."] [--size 100x30]

Uses the daemon that `localllm` itself would use (LOCALLLM_HOST, the socket; started when
none runs). Prints the last screen and the figures it read; exits 1 when something is missing.
tests/test_tui_tmux.py calls `check()` against a test daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from localllm.client import installed_command

FINAL_STATS = re.compile(r"([\d.]+k?) tok/s · (\d+) tok .*ctx (\d+)/(\d+)")


@dataclass(frozen=True)
class Seen:
    screen: str  # the last capture
    ready_line: str  # "smollm2 ready in 0.4 s: ..."
    answer: str  # the text under the model's name
    decode_tps: float
    answer_tokens: int
    context_used: int
    context_length: int
    exited: bool  # /bye ended the program


class Tmux:
    """One private tmux server (its own socket), so nothing touches the user's sessions."""

    def __init__(self, env: dict, width: int, height: int):
        self.socket = f"localllm-check-{os.getpid()}"
        self.env = env
        self.width, self.height = width, height

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], env=self.env, check=check,
                              capture_output=True, text=True, timeout=30)

    def start(self, command: list[str]) -> None:
        self.run("new-session", "-d", "-s", "check", "-x", str(self.width), "-y",
                 str(self.height), shlex.join(command))
        self.run("set-option", "-t", "check", "remain-on-exit", "on")

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "check").stdout

    def type(self, text: str) -> None:
        # Text, then Enter on its own: a real user's Enter never arrives glued to the text.
        self.run("send-keys", "-t", "check", "-l", text)
        self.run("send-keys", "-t", "check", "Enter")

    def pane_dead(self) -> bool:
        out = self.run("list-panes", "-t", "check", "-F", "#{pane_dead}", check=False)
        return out.stdout.strip() == "1"

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if predicate(screen):
                return screen
            if self.pane_dead() or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}; the screen shows:\n{screen}")
            time.sleep(0.1)  # ok-sleep: the poll interval of a deadline loop

    def kill(self) -> None:
        path = self.run("display-message", "-p", "#{socket_path}", check=False).stdout.strip()
        self.run("kill-server", check=False)
        if path.endswith(self.socket):  # tmux leaves the socket file behind
            with contextlib.suppress(OSError):
                os.unlink(path)


def answer_text(screen: str, model: str) -> str:
    """The lines under the last line that is exactly the model's name, up to a blank line."""
    lines = [line.rstrip() for line in screen.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.strip() == model]
    if not starts:
        return ""
    out = []
    for line in lines[starts[-1] + 1:]:
        if not line.strip():
            break
        out.append(line.strip())
    return " ".join(out)


def check(model: str = "smollm2", prompt: str = "Name three colours.", env: dict | None = None,
          width: int = 100, height: int = 30, timeout: float = 120,
          num_predict: int = 24) -> Seen:
    if shutil.which("tmux") is None:
        raise RuntimeError("tmux is not installed (apt-get install tmux)")
    tmux = Tmux(dict(env or os.environ), width, height)
    try:
        tmux.start([installed_command(), "run", model])
        screen = tmux.wait_for(lambda s: " ready in " in s, timeout, "the model to load")
        ready = next(line.strip() for line in screen.splitlines() if " ready in " in line)
        tmux.type(f"/set parameter num_predict {num_predict}")
        tmux.type("/set parameter temperature 0")  # greedy: the answer is as long as asked
        tmux.wait_for(lambda s: "Set parameter 'temperature'" in s, 30, "the parameters")
        tmux.type(prompt)
        screen = tmux.wait_for(lambda s: FINAL_STATS.search(s) is not None, timeout,
                               "the answer and its stats")
        rate, tokens, used, n_ctx = FINAL_STATS.search(screen).groups()
        tps = float(rate.rstrip("k")) * (1000 if rate.endswith("k") else 1)
        tmux.type("/bye")
        deadline = time.monotonic() + 30
        while not tmux.pane_dead() and time.monotonic() < deadline:
            time.sleep(0.1)  # ok-sleep: the poll interval of a deadline loop
        return Seen(screen, ready, answer_text(screen, model), tps, int(tokens), int(used),
                    int(n_ctx), tmux.pane_dead())
    finally:
        tmux.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", default="Name three colours.")
    parser.add_argument("--size", default="100x30", help="terminal WIDTHxHEIGHT")
    args = parser.parse_args()
    width, height = map(int, args.size.split("x"))
    try:
        seen = check(args.model, args.prompt, width=width, height=height)
    except RuntimeError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(seen.screen)
    print(f"ready:   {seen.ready_line}")
    print(f"answer:  {seen.answer}")
    print(f"decode:  {seen.decode_tps} tok/s over {seen.answer_tokens} tokens")
    print(f"context: {seen.context_used}/{seen.context_length}")
    print(f"/bye ended it: {seen.exited}")
    ok = seen.answer and seen.decode_tps > 0 and seen.context_used > 0 and seen.exited
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
