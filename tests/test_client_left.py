"""A client that leaves between two parts of a stream ends its request as a cancel (as when
aiohttp cancels the handler for it), not as an error of the server's: the write that finds the
connection closed comes a moment before that cancel on a loaded machine."""

from __future__ import annotations

import asyncio

import pytest

from localllm.daemon.api.respond import Writer


class Gone:
    """A stream response whose client has left (what aiohttp's write raises then)."""

    async def write(self, data: bytes) -> None:
        raise ConnectionResetError("Cannot write to closing transport")


class Lines(Writer):
    def whole(self, parsed, done, logprobs):
        return {}

    async def part(self, part):
        await self.write(b"part\n")

    async def done(self, part):
        await self.write(b"done\n")

    async def error(self, message):
        await self.write(message.encode())


async def test_a_write_after_the_client_left_is_a_cancel_not_an_error():
    writer = Lines()
    writer.response = Gone()
    with pytest.raises(asyncio.CancelledError) as caught:
        await writer.part(None)
    assert isinstance(caught.value.__cause__, ConnectionResetError)
