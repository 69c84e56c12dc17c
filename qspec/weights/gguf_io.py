"""Read and write llama.cpp `qwen4exp` GGUF files as the canonical weight dict (see `names.py`).

Reading goes through `gguf.GGUFReader` (`gguf_open.py`: one file or every part of a split one), which memory-maps
the file: tensors are copied out one at a time,
and the per-layer n-gram table (`per_layer_token_embd.weight`, ~100 GB in the real model) is never copied at
all: it is returned as a `HostRowTable` over the mmap, from which the model gathers the rows it needs.
Matrices stored in a type of `qweight.PACKED_QTYPES` (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) are copied to the device as
their blocks (`QuantWeight`) and never expanded; `weights_summary` says what a load kept in which format.
Everything is validated (names, shapes, quant types, file size) before the first tensor is materialised.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from qspec.config import (
    ARCH,
    ConfigError,
    ModelConfig,
    from_gguf_metadata,
    ple_head_tables,
    ple_multipliers,
    to_gguf_metadata,
)
from qspec.weights.dequant import SUPPORTED_QTYPES, WeightsError, dequantize, qtype_nbytes
from qspec.weights.gguf_open import CheckedReader, open_gguf
from qspec.weights.host_experts import (
    HOST_TRANSIENT_LAYERS,
    HostExperts,
    expert_layer,
    fewest_layers,
)
from qspec.weights.names import mtp_shapes, tensor_shapes, writable_shapes
from qspec.weights.quant_mix import keep_packed
from qspec.weights.quantize import quantize
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight, row_bytes

PLE_TABLE = "per_layer_token_embd.weight"
# The converter writes these three as uint64 arrays (multipliers exceed int32; llama.cpp narrows the others).
UINT64_ARRAY_KEYS = frozenset(f"{ARCH}.ple.{k}" for k in ("layer_multipliers", "head_offsets", "head_vocab_sizes"))
# Types `write_gguf` can produce: the block types through qspec.weights.quantize (gguf-py has no K-quant quantizer).
WRITABLE_QTYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}) | \
    PACKED_QTYPES
_TORCH_QTYPE = {torch.float32: GGMLQuantizationType.F32, torch.float16: GGMLQuantizationType.F16,
                torch.bfloat16: GGMLQuantizationType.BF16}
_CHUNK_ELEMS = 1 << 26  # elements encoded per write step (256 MiB of float32)


# ---- the host-resident PLE table ---------------------------------------------------------------------------------
class HostRowTable:
    """A [rows, cols] embedding table left in host memory, usually a read-only mmap of the model file.

    The table is stored as raw GGML rows (F32/F16/BF16 or whole quant blocks per row) in one or more
    segments stacked along the rows (HF checkpoints shard it). `gather` copies only the requested rows,
    expands them and moves them to the device, so the table itself never lands in RAM or on the GPU."""

    def __init__(self, segments: Sequence[np.ndarray], qtype: GGMLQuantizationType, cols: int,
                 owner: object = None) -> None:
        self.qtype = GGMLQuantizationType(qtype)
        if self.qtype not in SUPPORTED_QTYPES:
            raise WeightsError(f"{PLE_TABLE}: unsupported quant type {self.qtype.name}")
        self.cols = int(cols)
        self.row_bytes = qtype_nbytes(self.qtype, (self.cols,))
        self.segments = [s.reshape(s.shape[0], -1) for s in segments]
        for s in self.segments:
            if s.dtype != np.uint8 or s.shape[1] != self.row_bytes:
                raise WeightsError(f"{PLE_TABLE}: segment of {s.shape} {s.dtype} is not [rows, {self.row_bytes}] bytes")
        self._starts = np.cumsum([0] + [s.shape[0] for s in self.segments])
        self.shape = (int(self._starts[-1]), self.cols)
        self._owner = owner  # keeps a tensor alive when the segments are views of it

    @classmethod
    def from_tensor(cls, table: torch.Tensor) -> HostRowTable:
        """Wrap an in-memory CPU table (F32/F16/BF16) without copying it."""
        if table.dim() != 2 or table.dtype not in _TORCH_QTYPE:
            raise WeightsError(f"{PLE_TABLE}: expected a 2-D float32/float16/bfloat16 tensor, got "
                               f"{tuple(table.shape)} {table.dtype}")
        t = table.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.bfloat16 else t.view(torch.int16).view(torch.uint8)
        return cls([raw.numpy()], _TORCH_QTYPE[t.dtype], t.shape[1], owner=t)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def _raw_rows(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"{PLE_TABLE}: row index out of range [0, {self.shape[0]})")
        if len(self.segments) == 1:
            return self.segments[0][idx]  # fancy indexing copies just these rows out of the mmap
        out = np.empty((idx.size, self.row_bytes), dtype=np.uint8)
        seg = np.searchsorted(self._starts, idx, side="right") - 1
        for s in np.unique(seg):
            m = seg == s
            out[m] = self.segments[s][idx[m] - self._starts[s]]
        return out

    def gather(self, rows: torch.Tensor, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (any shape of ints) as a `rows.shape + (cols,)` tensor on `device`."""
        idx = rows.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        raw = torch.from_numpy(self._raw_rows(idx)).to(device)
        return dequantize(raw, self.qtype, (idx.size, self.cols), dtype).reshape(*rows.shape, self.cols)

    def rows(self, start: int, stop: int, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous block of rows (used to stream the table into another file)."""
        return self.gather(torch.arange(start, min(stop, self.shape[0])), device, dtype)

    def materialize(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table as one tensor: for tests and small models only."""
        return self.rows(0, self.shape[0], device, dtype)

    def __repr__(self) -> str:
        return f"HostRowTable(shape={self.shape}, qtype={self.qtype.name}, segments={len(self.segments)})"


Weights = dict[str, torch.Tensor | HostRowTable | QuantWeight]


# ---- metadata ----------------------------------------------------------------------------------------------------
def _f32(v: float) -> float:
    """The shortest decimal that round-trips in float32, so a stored 1e-6 reads back as 1e-6."""
    return float(str(np.float32(v)))


def _field_value(field: Any) -> Any:
    types = field.types
    if types and types[0] == GGUFValueType.FLOAT32:
        return _f32(field.contents())
    value = field.contents()
    if types and types[0] == GGUFValueType.ARRAY and types[-1] == GGUFValueType.FLOAT32 and len(value) <= 4096:
        value = [_f32(v) for v in value]
    return value


def _metadata(reader: GGUFReader, keys: Sequence[str] | None = None, prefixes: Sequence[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        if keys is None or k in keys or k.startswith(tuple(prefixes)):
            out[k] = _field_value(f)
    return out


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every key/value of a GGUF file as Python values (strings decoded, arrays as lists)."""
    return _metadata(open_gguf(path))


def _ne_rows(reader: GGUFReader, name: str) -> int:
    for t in reader.tensors:
        if t.name == name:
            return int(t.shape[-1]) if len(t.shape) > 1 else 0
    return 0


def _hf_extras(cfg: ModelConfig) -> ModelConfig:
    """Recover the config.json knobs (n-gram vocab base, hash seed) that GGUF stores only as derived tables.

    Any base in (previous prime, first head size] yields the same tables, so the first head size is used."""
    if not cfg.has_ple or not cfg.ple_head_vocab:
        return cfg
    extra = dict(cfg.extra)
    base = cfg.ple_head_vocab[0]
    n = cfg.ple_heads
    if ple_head_tables(n, base) == (cfg.ple_head_offsets[:n], cfg.ple_head_vocab[:n]):
        extra["ngram_vocab_size_base"] = base
    if ple_multipliers(cfg.vocab_size, cfg.ngram_size, 0, 1234) == cfg.ple_multipliers[:cfg.ngram_size]:
        extra["seed"] = 1234
    return cfg.with_(extra=extra)


def _config(reader: CheckedReader, vocab: int, ple_rows: int) -> ModelConfig:
    kv = _metadata(reader, keys=("tokenizer.ggml.eos_token_id",), prefixes=("general.", f"{ARCH}."))
    kv["_vocab_size"] = vocab
    kv["_ple_rows"] = ple_rows
    return from_gguf_metadata(kv)


# ---- load planning -----------------------------------------------------------------------------------------------
def _torch_shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _check(path: Path, t: Any, expect: tuple[int, ...], name: str | None = None) -> None:
    name = name or t.name
    if t.tensor_type not in SUPPORTED_QTYPES:
        raise WeightsError(f"{path}: tensor {name!r} has unsupported quant type {t.tensor_type.name}")
    got = _torch_shape(t)
    # A 1-D gamma may be stored as [S, D] (same bytes, stream-major), as llama.cpp's reshape-on-load allows.
    if got != expect and not (len(expect) == 1 and math.prod(got) == expect[0]):
        raise WeightsError(f"{path}: tensor {name!r} has wrong shape: expected {expect}, got {got}")


def _drop_pages(a: np.ndarray) -> None:
    """Let the kernel drop the file pages under `a`, a view of the reader's mmap already copied out. Mapped pages
    that were read count towards the process's resident memory until unmapped, so without this a load's peak grows
    by the file's size on top of the weights; the pages are read again from the file if anything touches them."""
    root = a
    while isinstance(root.base, np.ndarray):  # views of views: the array that owns the mapping holds it as .base
        root = root.base
    mm = root.base
    if not isinstance(mm, mmap.mmap) or not isinstance(root, np.memmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = a.ctypes.data - root.ctypes.data + root.offset % mmap.ALLOCATIONGRANULARITY
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    mm.madvise(mmap.MADV_DONTNEED, lo, start + a.nbytes - lo)


def _as_blocks(t: Any, shape: tuple[int, ...], packed: bool) -> bool:
    """Whether file tensor t (of `shape`) loads as its blocks: `packed` asked, a matrix, a type in PACKED_QTYPES."""
    return packed and len(shape) >= 2 and t.tensor_type in PACKED_QTYPES


def _materialize(t: Any, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype,
                 packed: bool) -> torch.Tensor | QuantWeight:
    """One file tensor on `device`: as its blocks (`packed` and a type in PACKED_QTYPES) or expanded to `dtype`.

    The bytes pass through host memory once, as one tensor's copy out of the mmap (the load's host peak is the
    largest tensor, never the file)."""
    raw = np.array(np.asarray(t.data).reshape(-1).view(np.uint8))  # the one host copy
    _drop_pages(t.data)
    if _as_blocks(t, shape, packed):
        # shaped before torch sees it: a tensor of its own shape (not a view), so nothing is copied again, on the
        # device or (blocks on the CPU) by from_blocks
        blocks = torch.from_numpy(raw.reshape(*shape[:-1], row_bytes(t.tensor_type, shape[-1])))
        return QuantWeight.from_blocks(blocks.to(device), t.tensor_type, shape)
    return dequantize(torch.from_numpy(raw).to(device), t.tensor_type, shape, dtype)


class LoadProgress:
    """Tensors and bytes loaded so far, on one stderr line: shown when stderr is a terminal or when asked."""

    def __init__(self, total_tensors: int, total_bytes: int, show: bool | None = None) -> None:
        self.n, self.total, self.bytes, self.total_bytes = 0, total_tensors, 0, max(total_bytes, 1)
        self.show = sys.stderr.isatty() if show is None else show
        self.host_peak = 0  # the largest single host copy (bytes)

    def step(self, nbytes: int) -> None:
        self.n += 1
        self.bytes += nbytes
        self.host_peak = max(self.host_peak, nbytes)
        if self.show:
            end = "\n" if self.n == self.total else ""
            print(f"\rqspec: loading {self.n}/{self.total} tensors, {self.bytes / 2**30:.2f}/"
                  f"{self.total_bytes / 2**30:.2f} GiB ({100 * self.bytes / self.total_bytes:.0f}%)",
                  end=end, file=sys.stderr, flush=True)


def _load_plain(name: str, job: tuple[Any, ...], device: torch.device | str, dtype: torch.dtype, packed: bool
                ) -> torch.Tensor | HostRowTable | QuantWeight:
    t, shape = job[1], job[2]
    if name == PLE_TABLE:
        rows, cols = shape
        seg = t.data.reshape(-1).view(np.uint8).reshape(rows, -1)  # stays an np.memmap: no copy
        return HostRowTable([seg], t.tensor_type, cols)
    return _materialize(t, shape, device, dtype, packed and keep_packed(name))


def _split_fused(full: torch.Tensor | QuantWeight, kind: str) -> torch.Tensor | QuantWeight:
    """The gate (first) or up (second) half of the rows of a fused [E, 2F, D] gate_up tensor."""
    f = full.shape[1] // 2
    lo, hi = (0, f) if kind == "gate" else (f, 2 * f)
    if isinstance(full, QuantWeight):
        return full.rows(lo, hi)
    return full[:, lo:hi].contiguous()


def _resolve(path: Path, have: dict[str, Any], shapes: dict[str, tuple[int, ...]],
             ignore_prefix: str | None) -> dict[str, Any]:
    """Every expected name -> its load job, after checking the names, shapes and types of the file's tensors."""
    jobs: dict[str, Any] = {}
    missing: list[str] = []
    for name, shape in shapes.items():
        if name in jobs:
            continue
        if name in have:
            _check(path, have[name], shape)
            jobs[name] = ("plain", have[name], shape)
        elif name == "output.weight" and "token_embd.weight" in have:
            jobs[name] = ("alias", "token_embd.weight")  # llama.cpp's TENSOR_DUPLICATED fallback
        elif name.endswith((".ffn_gate_exps.weight", ".ffn_up_exps.weight")):
            blk = name.rsplit(".", 2)[0]
            fused = f"{blk}.ffn_gate_up_exps.weight"
            if fused not in have:
                missing.append(name)
                continue
            e, f, d = shape
            _check(path, have[fused], (e, 2 * f, d))
            jobs[f"{blk}.ffn_gate_exps.weight"] = ("gate", have[fused], (e, 2 * f, d))
            jobs[f"{blk}.ffn_up_exps.weight"] = ("up", have[fused], (e, 2 * f, d))
        else:
            missing.append(name)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{path}: missing tensor {missing[0]!r}: {', '.join(missing[:5])}{more}")
    used = {j[1].name for j in jobs.values() if j[0] != "alias"}
    unknown = [n for n in have if n not in used and not (ignore_prefix and n.startswith(ignore_prefix))]
    if unknown:
        warnings.warn(f"{path}: ignoring {len(unknown)} unexpected tensors: {', '.join(unknown[:5])}", stacklevel=4)
    return jobs


def _plan_and_load(path: Path, reader: CheckedReader, shapes: dict[str, tuple[int, ...]],
                   device: torch.device | str, dtype: torch.dtype, ignore_prefix: str | None,
                   dequantize_all: bool = False, progress: bool | None = None,
                   host: HostExperts | None = None) -> Weights:
    """Resolve every expected name to file tensors, check all of them, then load them in order.

    Matrices of a type in PACKED_QTYPES stay as their blocks (`QuantWeight`) unless `dequantize_all`;
    `progress`: a tensor/byte count on stderr (None: when stderr is a terminal); `host`: the routed experts it
    wants go to page-locked host memory as each one loads (weights/host_experts.py)."""
    jobs = _resolve(path, {t.name: t for t in reader.tensors}, shapes, ignore_prefix)
    files = {j[1].name: j[1] for j in jobs.values() if j[0] != "alias" and j[1].name != PLE_TABLE}
    check_weights_fit(path, device_bytes(jobs, dtype, dequantize_all), torch.device(device),
                      experts_by_layer=expert_bytes_by_layer(jobs), host_layers=host.layers if host else 0)
    bar = LoadProgress(len(files), sum(int(t.n_bytes) for t in files.values()), progress)
    out = LoadedWeights()
    fused_cache: dict[str, torch.Tensor | QuantWeight] = {}
    for name in shapes:
        job = jobs[name]
        kind = job[0]
        if kind == "alias":
            out[name] = out[job[1]]
        elif kind == "plain":
            out[name] = _load_plain(name, job, device, dtype, not dequantize_all)
            if name != PLE_TABLE:
                bar.step(int(job[1].n_bytes))
        else:  # halves of a fused gate_up tensor: [E, 2F, D] with gate rows first
            t = job[1]
            full = fused_cache.pop(t.name, None)
            if full is None:
                full = fused_cache[t.name] = _materialize(t, job[2], device, dtype, not dequantize_all)
                bar.step(int(t.n_bytes))
            out[name] = _split_fused(full, kind)
        if host is not None and kind != "alias":
            out[name] = host.place(name, out[name], path)
    out.host_peak = bar.host_peak
    out.files = len(reader.parts) or 1
    return out


def device_bytes(jobs: dict[str, Any], dtype: torch.dtype, dequantize_all: bool) -> int:
    """The bytes the load jobs put on the device, at least: a matrix kept as its blocks takes its file bytes, any
    other tensor its elements at `dtype` (the n-gram table stays in host memory; a fused gate_up tensor counts
    once)."""
    total, seen = 0, set()
    for name, job in jobs.items():
        if job[0] == "alias" or name == PLE_TABLE or job[1].name in seen:
            continue
        t, shape = job[1], job[2]
        seen.add(t.name)
        blocks = _as_blocks(t, shape, not dequantize_all and keep_packed(name))
        total += int(t.n_bytes) if blocks else math.prod(shape) * dtype.itemsize
    return total


def expert_bytes_by_layer(jobs: dict[str, Any]) -> list[int]:
    """The file bytes of each trunk layer's routed experts that load as blocks, by layer (a fused gate_up tensor
    counted once; the MTP block's left out)."""
    by_layer: dict[int, int] = {}
    seen: set[str] = set()
    mtp = {int(n.split(".")[1]) for n in jobs if ".nextn." in n}  # the MTP block's experts stay on the device
    for name, job in jobs.items():
        layer = expert_layer(name)
        if (layer is None or layer in mtp or job[0] == "alias" or job[1].name in seen
                or job[1].tensor_type not in PACKED_QTYPES):
            continue
        seen.add(job[1].name)
        by_layer[layer] = by_layer.get(layer, 0) + int(job[1].n_bytes)
    return [by_layer.get(i, 0) for i in range(max(by_layer, default=-1) + 1)]


def check_weights_fit(path: Path, need: int, device: torch.device, free: int | None = None, *,
                      experts_by_layer: Sequence[int] = (), host_layers: int = 0) -> None:
    """WeightsError before anything loads when a GPU's free memory (`free`, default asked of the device) is less
    than the weights need: a file too large for the GPU is one error up front, not an out-of-memory error minutes
    into the load. `host_layers` layers' routed experts (`experts_by_layer`, bytes) go to host memory instead; a
    prefill step then holds one layer's on the device, and the load two of its tensors (HOST_TRANSIENT_LAYERS).
    Where host experts would make the weights fit, the error names the fewest layers that do."""
    if free is None:
        if device.type != "cuda":
            return
        free = torch.cuda.mem_get_info(device)[0]
    transient = HOST_TRANSIENT_LAYERS * max(experts_by_layer, default=0)
    on_device = need - sum(experts_by_layer[:host_layers]) + (transient if host_layers else 0)
    if on_device <= free:
        return
    fewest = fewest_layers(experts_by_layer, need + transient - free)
    hint = (f", or --host-experts {fewest} (the routed experts of the first {fewest} layers in host memory, read "
            f"over PCIe: slower decoding)" if fewest and fewest > host_layers else "")
    first = "the first layer's" if host_layers == 1 else f"the first {host_layers} layers'"
    held = f" with {first} routed experts in host memory" if host_layers else ""
    raise WeightsError(f"{path}: its weights take at least {_size(on_device)} of GPU memory{held} and "
                       f"{_size(free)} is free on {device}: a smaller quantization of the model, or a GPU with more "
                       f"memory{hint}")


class LoadedWeights(dict):  # type: ignore[type-arg]
    """A loaded weight dict that remembers its load's host-memory peak (the largest single host copy, bytes) and
    how many files it was read from (a split GGUF's parts)."""

    host_peak: int = 0
    files: int = 1


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.2f} MiB"


def weights_summary(w: Weights, host_peak: int | None = None) -> str:
    """What a loaded weight set holds in which format: tensor count and GiB per type, the n-gram table's place,
    and the load's host-memory peak where known."""
    by: dict[str, list[int]] = {}
    seen: set[int] = set()
    table = ""
    for v in w.values():
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, HostRowTable):
            table = f"; n-gram table in host memory ({v.qtype.name}, {_size(v.nbytes)})"
            continue
        if isinstance(v, QuantWeight):
            key, nbytes = f"{v.qtype.name} ({'planes' if v.planes else 'blocks'})", v.nbytes
        elif isinstance(v, torch.Tensor):
            key, nbytes = str(v.dtype).removeprefix("torch."), v.numel() * v.element_size()
        else:
            continue
        c = by.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += nbytes
    parts = [f"{k} {n} tensors {_size(b)}" for k, (n, b) in sorted(by.items(), key=lambda kv: -kv[1][1])]
    peak = host_peak if host_peak is not None else getattr(w, "host_peak", 0)
    extra = f"; load host-memory peak {_size(peak)} (the largest tensor)" if peak else ""
    files = getattr(w, "files", 1)
    split = f"; read from the {files} parts of a split GGUF" if files > 1 else ""
    return ", ".join(parts) + table + extra + split


# ---- public readers ----------------------------------------------------------------------------------------------
def read_gguf(path: str | os.PathLike[str], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              with_mtp: bool | None = None, *, dequantize_all: bool = False, progress: bool | None = None,
              host: HostExperts | None = None) -> tuple[ModelConfig, Weights]:
    """(config, canonical weights) from a `qwen4exp` GGUF file.

    Matrices of a type in PACKED_QTYPES load as `QuantWeight` (their blocks, on `device`); `dequantize_all`
    expands every tensor to `dtype` instead (the reference for the quantized products). `progress`, `host` (routed
    experts kept in host memory): see `_plan_and_load`.

    `with_mtp=None` loads the MTP block when the file has one. The config always describes the file
    (n_mtp_layers included), even when the MTP tensors are skipped."""
    p = Path(path)
    reader = open_gguf(p)
    cfg = _file_config(p, reader)
    if with_mtp and not cfg.has_mtp:
        raise WeightsError(f"{p}: MTP requested but the file has no MTP block ({ARCH}.nextn_predict_layers is 0)")
    with_mtp = cfg.has_mtp if with_mtp is None else with_mtp
    skip = None if with_mtp or not cfg.has_mtp else f"blk.{cfg.mtp_layer}."
    if host is not None:
        host.bind(cfg.n_layers)
    return cfg, _plan_and_load(p, reader, tensor_shapes(cfg, with_mtp), device, dtype, skip, dequantize_all, progress,
                               host)


def _file_config(p: Path, reader: CheckedReader) -> ModelConfig:
    """The config a full (not draft-only) `qwen4exp` GGUF describes, checked."""
    have = {t.name for t in reader.tensors}
    if "token_embd.weight" not in have and any(".nextn." in n for n in have):
        raise WeightsError(f"{p}: draft-only GGUF (MTP block only, no token_embd.weight); load it with "
                           "read_draft_gguf(path, target_cfg)")
    cfg = _config(reader, _ne_rows(reader, "token_embd.weight"), _ne_rows(reader, PLE_TABLE))
    if "token_embd.weight" not in have:
        raise WeightsError(f"{p}: missing tensor 'token_embd.weight'")
    return _hf_extras(cfg).validate()


def read_gguf_layout(path: str | os.PathLike[str]
                     ) -> tuple[ModelConfig, dict[str, GGMLQuantizationType], dict[str, int]]:
    """From the header alone (no tensor data read): (config, the file's type and the bytes of each canonical tensor
    it holds). A fused gate_up tensor gives each half its type and half its bytes; an aliased head is absent."""
    p = Path(path)
    reader = open_gguf(p)
    cfg = _file_config(p, reader)
    types: dict[str, GGMLQuantizationType] = {}
    nbytes: dict[str, int] = {}
    for t in reader.tensors:
        if t.name.endswith(".ffn_gate_up_exps.weight"):
            blk = t.name.rsplit(".", 2)[0]
            for half in ("gate", "up"):
                types[f"{blk}.ffn_{half}_exps.weight"] = t.tensor_type
                nbytes[f"{blk}.ffn_{half}_exps.weight"] = int(t.n_bytes) // 2
        else:
            types[t.name], nbytes[t.name] = t.tensor_type, int(t.n_bytes)
    return cfg, types, nbytes


# Hyperparameters a draft block must share with the target it is attached to.
_DRAFT_MUST_MATCH = ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "rope_dim", "n_experts",
                     "n_experts_used", "expert_ff", "shared_ff", "hc_count", "hc_rank", "indexer_heads",
                     "indexer_head_dim")


def read_draft_gguf(path: str | os.PathLike[str], target_cfg: ModelConfig, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, *, dequantize_all: bool = False) -> Weights:
    """The MTP tensors of a draft-only GGUF (llama.cpp `-md` layout: only `blk.{n_layers}.*`; it borrows
    `token_embd`/`output` from the target), checked against the target's config."""
    p = Path(path)
    reader = open_gguf(p)
    draft = _config(reader, target_cfg.vocab_size, target_cfg.ple_rows)
    if not draft.has_mtp:
        raise WeightsError(f"{p}: not a draft GGUF: {ARCH}.nextn_predict_layers is 0")
    for field in _DRAFT_MUST_MATCH:
        if getattr(draft, field) != getattr(target_cfg, field):
            raise WeightsError(f"{p}: draft {field}={getattr(draft, field)} does not match the target's "
                               f"{getattr(target_cfg, field)}")
    shapes = mtp_shapes(target_cfg.with_(n_mtp_layers=max(1, target_cfg.n_mtp_layers)))
    return _plan_and_load(p, reader, shapes, device, dtype, None, dequantize_all)


# ---- writer ------------------------------------------------------------------------------------------------------
def _int_type(values: Sequence[int]) -> GGUFValueType:
    lo, hi = min(values), max(values)
    if lo >= 0:
        return GGUFValueType.UINT32 if hi < 1 << 32 else GGUFValueType.UINT64
    return GGUFValueType.INT32 if lo >= -(1 << 31) and hi < 1 << 31 else GGUFValueType.INT64


def _add_kv(w: GGUFWriter, key: str, value: Any) -> None:
    """Write one key with the GGUF type llama.cpp expects: ints uint32 (arrays int32), floats float32.

    A `(value, GGUFValueType)` pair forces the (element) type."""
    forced: GGUFValueType | None = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
        value, forced = value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            return  # GGUF cannot hold an empty array; readers fall back to their default
        if forced is None:
            if key in UINT64_ARRAY_KEYS:
                forced = GGUFValueType.UINT64
            elif all(isinstance(v, str) for v in value):
                forced = GGUFValueType.STRING
            elif all(isinstance(v, bool) for v in value):
                forced = GGUFValueType.BOOL
            elif all(isinstance(v, int) for v in value):
                t = _int_type(value)
                forced = GGUFValueType.INT32 if t == GGUFValueType.UINT32 and max(value) < 1 << 31 else t
            else:
                forced = GGUFValueType.FLOAT32
        w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=forced)
        return
    if forced is None:
        if isinstance(value, str):
            forced = GGUFValueType.STRING
        elif isinstance(value, bool):
            forced = GGUFValueType.BOOL
        elif isinstance(value, int):
            forced = _int_type([value])
        elif isinstance(value, float):
            forced = GGUFValueType.FLOAT32
        else:
            raise WeightsError(f"GGUF metadata {key!r}: cannot store a {type(value).__name__}")
    w.add_key_value(key, value, forced)


def _choose_qtype(name: str, shape: tuple[int, ...],
                  qtypes: GGMLQuantizationType | Mapping[str, GGMLQuantizationType]) -> GGMLQuantizationType:
    if len(shape) == 1:
        return GGMLQuantizationType.F32  # norms, biases, ssm_a: always exact
    q = qtypes.get(name, GGMLQuantizationType.F32) if isinstance(qtypes, Mapping) else qtypes
    q = GGMLQuantizationType(q)
    if q not in WRITABLE_QTYPES:
        raise WeightsError(f"{name}: cannot write quant type {q.name} (writable: "
                           f"{', '.join(sorted(t.name for t in WRITABLE_QTYPES))})")
    if shape[-1] % GGML_QUANT_SIZES[q][0]:
        return GGMLQuantizationType.F32  # rows too short for whole blocks (e.g. conv kernels): keep exact
    return q


def _encode(x: torch.Tensor, q: GGMLQuantizationType) -> np.ndarray:
    """A chunk's bytes as type q: the block types qspec quantizes itself on the chunk's device (a model drawn on the
    GPU is written without its 16-bit tensors passing through host memory), the rest on the host."""
    if q in PACKED_QTYPES:
        return quantize(x.float(), q).reshape(-1).cpu().numpy()
    x = x.cpu()
    if q == GGMLQuantizationType.F32:
        return x.float().contiguous().numpy().view(np.uint8)
    if q == GGMLQuantizationType.F16:
        return x.half().contiguous().numpy().view(np.uint8)
    if q == GGMLQuantizationType.BF16:
        return x.bfloat16().contiguous().view(torch.int16).numpy().view(np.uint8)
    return np.asarray(gguf_quants.quantize(x.float().numpy(), q)).view(np.uint8)


def quantize_blocks(x: torch.Tensor, q: GGMLQuantizationType) -> torch.Tensor:
    """x [..., K] as GGUF blocks of type `q` (one kept packed on the device): uint8 [..., row bytes] on x's device."""
    if q not in PACKED_QTYPES:
        raise WeightsError(f"{GGMLQuantizationType(q).name} is not a block type kept on the device")
    return quantize(x, q)


def _chunks(name: str, value: torch.Tensor | HostRowTable, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """The tensor as row blocks of its flattened [-1, last] view, so huge tensors encode in bounded memory."""
    got = tuple(value.shape)
    if got != shape:
        raise WeightsError(f"{name}: wrong shape: expected {shape}, got {got}")
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    step = max(1, _CHUNK_ELEMS // max(shape[-1], 1))
    if isinstance(value, HostRowTable):
        for i in range(0, rows, step):
            yield value.rows(i, i + step)
        return
    flat = value.detach().reshape(rows, -1)  # on its device: _encode moves each chunk
    for i in range(0, rows, step):
        yield flat[i:i + step]


def write_gguf(path: str | os.PathLike[str], cfg: ModelConfig, tensors: Mapping[str, torch.Tensor | HostRowTable],
               *, qtypes: GGMLQuantizationType | Mapping[str, GGMLQuantizationType] = GGMLQuantizationType.F32,
               extra_kv: Mapping[str, Any] | None = None, draft_only: bool = False, split_max_bytes: int = 0
               ) -> list[Path]:
    """Write canonical weights as a `qwen4exp` GGUF, one tensor at a time; returns the files written.

    `tensors` may be a lazy Mapping: each value is requested once, in file order, and dropped after writing.
    `qtypes` is one type for every matrix or a per-name mapping (absent names: F32); 1-D tensors and rows
    that are not whole blocks are written F32. The MTP block is written when all its tensors are present
    (else the metadata says no MTP). `draft_only` writes just the MTP block (llama.cpp's `-md` layout).
    `extra_kv` adds metadata (e.g. tokenizer.ggml.*); a `(value, GGUFValueType)` pair forces a type.
    `split_max_bytes` > 0 splits the file as llama-gguf-split does: parts PATH-00001-of-0000N.gguf of at most that
    many tensor bytes (a larger tensor alone), the metadata in the first, `split.*` keys in each."""
    extra_kv = dict(extra_kv or {})
    if draft_only:
        if not cfg.has_mtp:
            raise WeightsError("draft_only: the config has no MTP block (n_mtp_layers is 0)")
        shapes = mtp_shapes(cfg)
        missing = [n for n in shapes if n not in tensors]
        if missing:
            raise WeightsError(f"missing tensor {missing[0]!r} ({len(missing)} missing)")
    else:
        cfg, shapes = writable_shapes(cfg, tensors)
    unknown = [n for n in tensors if n not in shapes and not (draft_only or n.startswith(f"blk.{cfg.mtp_layer}."))]
    if unknown:
        raise WeightsError(f"unknown tensor {unknown[0]!r} is not part of this config's weight set")
    plan = {n: _choose_qtype(n, s, qtypes) for n, s in shapes.items()}

    w = GGUFWriter(os.fspath(path), ARCH, split_max_size=split_max_bytes)  # writes general.architecture itself
    try:
        for key, value in to_gguf_metadata(cfg).items():
            if key != "general.architecture":
                _add_kv(w, key, value)
        if "tokenizer.ggml.eos_token_id" not in extra_kv:
            _add_kv(w, "tokenizer.ggml.eos_token_id", cfg.eos_token_id)
        for key, value in extra_kv.items():
            if key == "general.architecture":
                if value != ARCH:
                    raise ConfigError(f"general.architecture: {value!r} conflicts with {ARCH!r}")
                continue
            _add_kv(w, key, value)
        for name, q in plan.items():
            # A dummy non-uint8 dtype makes gguf take `shape` as element (not byte) shape.
            w.add_tensor_info(name, shapes[name], np.dtype(np.float32), qtype_nbytes(q, shapes[name]), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        for fout, part in zip(w.fout, w.tensors, strict=True):  # each part's tensors, in the order of its header
            for name in part:
                _write_tensor(w, fout, name, tensors[name], shapes[name], plan[name])
            fout.flush()
        return w.format_shard_names(Path(path))
    finally:
        w.close()


def _write_tensor(w: GGUFWriter, fout: Any, name: str, value: Any, shape: tuple[int, ...],
                  q: GGMLQuantizationType) -> None:
    w.write_padding(fout, fout.tell())  # tensor data starts aligned, matching the offsets in the header
    written = 0
    for chunk in _chunks(name, value, shape):
        data = _encode(chunk, q)
        data.tofile(fout)
        written += data.nbytes
    if written != qtype_nbytes(q, shape):
        raise WeightsError(f"{name}: wrote {written} bytes, expected {qtype_nbytes(q, shape)}")
