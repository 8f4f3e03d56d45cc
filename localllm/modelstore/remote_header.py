"""A GGUF's header read from a hub by HTTP range requests: a model's shape before pulling it.

A header is the metadata (mostly the tokenizer's vocabulary and merges: 3-10 MiB for 150-260k
tokens) and then the tensor table. The reader asks for the first FIRST_BYTES and, each time the
header goes on past what it holds, for as much again as it has, so it reads at most about twice
the header and never a weight. A split GGUF's parts each carry a header with their own tensors:
all are read and joined into one.
"""

from __future__ import annotations

import io
from dataclasses import replace

from .download import RemoteFile
from .gguf_header import GGUFError, GGUFHeader, HeaderTruncated, parse_header
from .hub import HubClient

FIRST_BYTES = 4 << 20
MAX_HEADER_BYTES = 256 << 20  # no real header is near this; a bigger one is not a model file


async def read_remote_header(client: HubClient, remote: RemoteFile,
                             label: str) -> tuple[GGUFHeader, int]:
    """(the header of one file, bytes read for it)."""
    data = b""
    want = FIRST_BYTES
    while True:
        more = await client.read_range(remote.url, len(data), want - len(data), label)
        data += more
        try:
            return parse_header(io.BytesIO(data), label, remote.size or len(data)), len(data)
        except HeaderTruncated:
            if len(data) < want:
                raise GGUFError(f"{label} is truncated: the file ends inside its GGUF "
                                "header") from None
            if want >= MAX_HEADER_BYTES:
                raise GGUFError(f"{label}: its GGUF header is larger than "
                                f"{MAX_HEADER_BYTES >> 20} MiB; is it a model file?") from None
            want *= 2


def join_split(headers: list[GGUFHeader]) -> GGUFHeader:
    """One header for a split model: part 1's metadata, every part's tensors, the parts' sizes
    summed. Tensor offsets stay relative to their own part (nothing here reads data)."""
    first = headers[0]
    return replace(first, tensors=tuple(t for h in headers for t in h.tensors),
                   file_size=sum(h.file_size for h in headers))


async def read_model_header(client: HubClient, files: list[RemoteFile],
                            label: str) -> tuple[GGUFHeader, int]:
    """(the header of a model, one file or a split GGUF's parts in order; bytes read)."""
    headers, total = [], 0
    for remote in files:
        header, n = await read_remote_header(client, remote, f"{label}/{remote.filename}")
        headers.append(header)
        total += n
    return (join_split(headers) if len(headers) > 1 else headers[0]), total
