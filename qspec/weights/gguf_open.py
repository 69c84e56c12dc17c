"""Opening a GGUF: one file, or every part of a split one (llama-gguf-split's layout, as large downloads come),
checked before any tensor data is read. A truncated file names the first tensor that does not fit; a split file
names the part that is missing, out of place or renamed. Readers hand back one `GGUFReader` whose `tensors` are every
part's, so the loaders never see the split.
"""

from __future__ import annotations

import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from qspec.weights.dequant import WeightsError

GGUF_MAGIC = b"GGUF"


class CheckedReader(GGUFReader):
    """GGUFReader that refuses a truncated file (with the first tensor that does not fit) before mapping tensors."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.parts: list[Path] = []  # a split GGUF's files, when this reader holds all their tensors (open_gguf)
        super().__init__(path, "r")

    def _build_fields(self, offs: int, count: int) -> int:
        # Parse the key/values from a plain ndarray view of the map: numpy's memmap wraps every small
        # slice in a memmap object, which made a Qwen-vocabulary header (750k strings) take ~25 s.
        mm = self.data
        self.data = mm.view(np.ndarray)
        try:
            return super()._build_fields(offs, count)
        finally:
            self.data = mm

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        # Arrays of scalars and of strings in one pass each (gguf-py builds a few small arrays per element: ~7 s
        # for a Qwen-vocabulary header of 750k strings, parsed again at every open). A scalar array is one part;
        # a string array one part per string (a slice of the map), as contents() reads them. Nested arrays and
        # byte-swapped files take gguf-py's path.
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        n, offs = int(alen[0]), orig_offs + 12
        sub = GGUFValueType(int(itype[0]))
        nptype = self.gguf_scalar_to_np.get(sub)
        types = [GGUFValueType.ARRAY] + ([sub] if n else [])  # gguf-py gives an empty array no element type
        past_end = ValueError(f"the array at offset {orig_offs} runs past the end of the file")
        if nptype is not None:
            values = self._get(offs, nptype, n)
            if values.size != n:
                raise past_end
            return offs + int(values.nbytes) - orig_offs, [itype, alen, values], [2], types
        if sub != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        strings = []
        buf = memoryview(self.data)
        try:
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", buf, offs)
                strings.append(self.data[offs + 8:offs + 8 + length])
                offs += 8 + length
        except struct.error:
            raise past_end from None
        if offs > len(self.data):
            raise past_end
        return offs - orig_offs, [itype, alen, *strings], list(range(2, 2 + n)), types

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for f in fields:
            _, name_data, _, dims, raw_dtype, offset = f.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise WeightsError(f"{self._path}: tensor {name!r} has unknown ggml type id {int(raw_dtype[0])}") \
                    from None
            end = start_offs + int(offset[0]) + math.prod(int(d) for d in dims) * type_size // block
            if end > size:
                raise WeightsError(f"{self._path}: truncated file: tensor {name!r} needs bytes up to {end}, "
                                   f"the file has {size}")
        super()._build_tensors(start_offs, fields)


def _open_one(p: Path) -> CheckedReader:
    if not p.exists():
        raise WeightsError(f"{p}: file not found")
    if not p.is_file():
        raise WeightsError(f"{p}: not a file")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise WeightsError(f"{p}: not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return CheckedReader(p)
    except WeightsError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise WeightsError(f"{p}: corrupt or truncated GGUF header: {e}") from e


# llama.cpp's names for the parts of a split GGUF (llama-gguf-split, and gguf-py's writer): PREFIX-00001-of-00003.gguf
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _split_field(p: Path, reader: GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WeightsError(f"{p}: metadata {key} must be a non-negative integer, got {value!r}")
    return value


def split_parts(p: Path, no: int, count: int) -> list[Path]:
    """Every part's path of a split GGUF, given part `no` (0-based) of `count` at path p, by llama.cpp's naming."""
    m = _SPLIT_NAME.match(p.name)
    if m is None or int(m["no"]) != no + 1 or int(m["count"]) != count:
        raise WeightsError(f"{p}: part {no + 1} of a {count}-part split GGUF whose name does not end in "
                           f"-{no + 1:05d}-of-{count:05d}.gguf, so its other parts cannot be found")
    return [p.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def open_gguf(path: str | os.PathLike[str]) -> CheckedReader:
    """A GGUF file's reader; for any part of a split GGUF, its first part's reader (the metadata is there) holding
    every part's tensors, after checking that the parts are all there, in order, and complete."""
    p = Path(path)
    reader = _open_one(p)
    count = _split_field(p, reader, "split.count")
    if count is None or count <= 1:
        return reader
    no = _split_field(p, reader, "split.no") or 0
    parts = split_parts(p, no, count)
    readers = []
    for i, q in enumerate(parts):
        if i != no and not q.exists():
            raise WeightsError(f"{p}: part {i + 1} of this {count}-part split GGUF is missing: {q}")
        r = reader if i == no else _open_one(q)
        if (_split_field(q, r, "split.no"), _split_field(q, r, "split.count")) != (i, count):
            raise WeightsError(f"{q}: not part {i + 1} of {count} of the split GGUF {parts[0].name} (its split.no / "
                               f"split.count say otherwise)")
        readers.append(r)
    first = readers[0]
    first.tensors = [t for r in readers for t in r.tensors]
    first.parts = parts
    names = [t.name for t in first.tensors]
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise WeightsError(f"{parts[0]}: tensor {dup!r} is in more than one part of the split GGUF")
    total = _split_field(parts[0], first, "split.tensors.count")
    if total is not None and total != len(names):
        raise WeightsError(f"{parts[0]}: the {count} parts hold {len(names)} tensors, split.tensors.count says {total}")
    return first
