"""The template workers (real worker processes): a daemon holding a thousand connections still
renders (its pipes' descriptors are past 1023), and a worker that died is not reported as the
template's memory limit."""

from __future__ import annotations

import os
import signal

import pytest

from localllm.daemon.chat import template
from localllm.daemon.chat.template import close_workers, render_in_worker

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
VARIABLES = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def many_open_files():
    """1100 descriptors held open, so the next ones (a new worker's pipes) are past 1023."""
    close_workers()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    yield
    for fd in fds:
        os.close(fd)
    close_workers()


def test_a_render_with_descriptors_past_1023_succeeds(many_open_files):
    assert render_in_worker(TEMPLATE, VARIABLES) == "<user>hi"
    worker = template._idle[-1]
    assert worker.proc.stdout.fileno() > 1023  # what select() could not wait on


def test_a_worker_killed_while_idle_is_replaced_not_blamed_on_memory():
    close_workers()
    assert render_in_worker(TEMPLATE, VARIABLES) == "<user>hi"
    worker = template._idle[-1]
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    assert render_in_worker(TEMPLATE, VARIABLES) == "<user>hi"
    close_workers()
