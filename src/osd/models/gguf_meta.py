"""A GGUF's metadata values by key, read from the file's header and no further (no weights, no tokenizer arrays)."""
from __future__ import annotations

from pathlib import Path

from osd.errors import InvalidArgument

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: Path, keys: list[str]) -> dict:
    """The named scalar/string metadata values of a GGUF, read from its header until all are found (gguf.GGUFReader
    parses the whole header, the tokenizer's 150,000-entry arrays included: ~9 s for a 1.5B file on this machine;
    this reads the few keys before them in milliseconds). Arrays are skipped (their keys map to None)."""
    import struct

    wanted, out = set(keys), {}
    with open(path, "rb") as f:
        def read(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(read("<Q")).decode("utf-8", "replace")

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                inner, count = read("<I"), read("<Q")
                if inner in _SCALARS:
                    f.seek(struct.calcsize(_SCALARS[inner]) * count, 1)
                else:
                    for _ in range(count):
                        value(inner)
                return None
            return read(_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise InvalidArgument(f"{path} is not a GGUF file")
        read("<I"), read("<Q")  # version, tensor count
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            got = value(kind)
            if key in wanted:
                out[key] = got
                if len(out) == len(wanted):
                    break
    return out
