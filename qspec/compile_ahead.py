"""Compiling while the weights load: a fresh process's first request then finds its kernels compiled.

A cold process spends its first request compiling (torch.compile's step functions, Triton's kernels, fla's
prefill kernels; BENCHMARKS.md §5c), while loading a large GGUF is mostly waiting on the disk. Both depend on the
model's geometry and tensor types, not on its values. So while a thread loads the file, the main thread builds a
*stand-in*: the file's config cut to one trunk layer of each kind the file has (the layer's mixer, its n-gram
input, its tensors' types), the MTP block when drafting, the embedding and the head, with random weights drawn and
quantized on the device in the file's types. It runs one short generation with the request's own options and
prompt, which compiles what the real model's first request would (dynamo's compiled functions and Triton's
kernels stay in the process, inductor's and Triton's files on the disk), and is freed before the real engine
allocates its cache.

It runs only when asked (`--compile-ahead`) and where it can: CUDA, compilation on, a GGUF file, and room on the
device for the file and the stand-in together. It is off by default: on the H200 the real model's first request
then compiled nothing, but a process whose caches were already warm recompiled Triton's kernels on the stand-in,
unexplained so far (BENCHMARKS.md §5c). A failure of the stand-in is reported and the load goes on; a failure of
the load is the load's error.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from qspec.config import ModelConfig, pad_rows, ple_head_tables
from qspec.model.model import Model
from qspec.options import EngineOptions
from qspec.weights.gguf_io import PLE_TABLE

# Generated tokens of the stand-in's request: enough steps that every decoding shape replays (and so captures) its
# graph, and, when drafting, that rounds verify, extend and draft at the chosen depth.
STAND_IN_TOKENS = 16
# Device memory kept free beside the file and the stand-in's weights: its caches, graph pools and workspaces.
STAND_IN_MARGIN = 6 << 30
# The stand-in's n-gram table: rows per head (its kernels do not depend on the table's size).
STAND_IN_NGRAM_BASE = 1000

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def stand_in_layers(cfg: ModelConfig, types: Mapping[str, GGMLQuantizationType]) -> list[int]:
    """The first trunk layer of each kind: the same mixer, compress ratio, n-gram input and tensor types."""
    seen: dict[tuple[Any, ...], int] = {}
    by_layer: dict[int, list[tuple[str, int]]] = {}
    for name, q in types.items():
        m = _BLOCK.match(name)
        if m and int(m.group(1)) < cfg.n_layers:
            by_layer.setdefault(int(m.group(1)), []).append((m.group(2), int(q)))
    for i in range(cfg.n_layers):
        kind = (cfg.layer_recurrent[i], cfg.compress_ratios[i], i == cfg.ple_layer,
                tuple(sorted(by_layer.get(i, []))))
        seen.setdefault(kind, i)
    return sorted(seen.values())


def stand_in_config(cfg: ModelConfig, layers: list[int], with_mtp: bool) -> ModelConfig:
    """`cfg` cut to `layers` (in order), its n-gram table shrunk, the MTP block kept only `with_mtp`."""
    over: dict[str, Any] = {
        "n_layers": len(layers), "layer_recurrent": tuple(cfg.layer_recurrent[i] for i in layers),
        "compress_ratios": tuple(cfg.compress_ratios[i] for i in layers),
        "n_mtp_layers": cfg.n_mtp_layers if with_mtp else 0,
    }
    if cfg.has_ple:
        offsets, sizes = ple_head_tables(cfg.ple_heads, STAND_IN_NGRAM_BASE)
        over |= {"ple_layer": layers.index(cfg.ple_layer), "ple_head_offsets": offsets, "ple_head_vocab": sizes,
                 "ple_rows": pad_rows(sum(sizes), 128)}
    return cfg.with_(**over).validate()


def stand_in_names(cfg: ModelConfig, layers: list[int]) -> Callable[[str], str | None]:
    """A file tensor's name -> its name in the stand-in (None: a layer the stand-in leaves out)."""
    index = {old: new for new, old in enumerate(layers)}

    def rename(name: str) -> str | None:
        m = _BLOCK.match(name)
        if not m:
            return name
        i = int(m.group(1))
        j = index.get(i) if i < cfg.n_layers else len(layers) + i - cfg.n_layers
        return None if j is None else f"blk.{j}.{m.group(2)}"
    return rename


def stand_in_plan(cfg: ModelConfig, layers: list[int], types: Mapping[str, GGMLQuantizationType],
                  nbytes: Mapping[str, int]) -> tuple[dict[str, GGMLQuantizationType], int]:
    """(the stand-in's tensor types, named as in the stand-in; the file's bytes of the tensors it draws). A head
    the file aliases to the embedding takes the embedding's type."""
    rename = stand_in_names(cfg, layers)
    plan: dict[str, GGMLQuantizationType] = {}
    total = 0
    for name, q in types.items():
        new = rename(name)
        if new is not None and name != PLE_TABLE:
            plan[new] = q
            total += nbytes.get(name, 0)
    if "output.weight" not in plan and "token_embd.weight" in plan:
        plan["output.weight"] = plan["token_embd.weight"]
        total += nbytes.get("token_embd.weight", 0)
    return plan, total


def stand_in_weights(cfg: ModelConfig, layers: list[int], plan: Mapping[str, GGMLQuantizationType], *,
                     device: torch.device, dtype: torch.dtype, with_mtp: bool) -> tuple[ModelConfig, dict[str, Any]]:
    """The stand-in of a file of config `cfg` (its `layers` and `plan` from stand_in_layers and stand_in_plan): its
    config and random weights drawn on `device`, blocks of the file's types where the file has blocks."""
    from qspec.bench.device_model import device_random_weights

    small = stand_in_config(cfg, layers, with_mtp)
    return small, device_random_weights(small, device=device, dtype=dtype, plan=plan, with_mtp=with_mtp)


def warm_on_stand_in(model: Model, opts: EngineOptions, prompt: list[int], tokens: int = STAND_IN_TOKENS) -> None:
    """One greedy generation of `tokens` after `prompt` on the stand-in with the request's options (no replayed
    acceptance: its rounds accept what the random drafts earn)."""
    from qspec.engine import Engine, cells_needed

    tokens = min(tokens, opts.capacity - cells_needed(len(prompt), 0, opts.draft))
    if tokens < 1:
        return
    Engine(model, opts).generate(prompt, tokens)


def _room_for(file_bytes: int, stand_in_bytes: int, device: torch.device) -> bool:
    """Whether the device holds the file's weights and the stand-in at once (host memory is not checked: the
    stand-in of a CPU load, which tests use, is small)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return file_bytes + stand_in_bytes + STAND_IN_MARGIN <= free


def load_compiling_ahead(path: Path, load: Callable[[], Model], opts: EngineOptions,
                         prompt: Callable[[ModelConfig], list[int]], *,
                         device: torch.device, dtype: torch.dtype, with_mtp: bool, hnorm_per_stream: bool = False,
                         say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> Model:
    """`load()` (which loads `path`) in a thread while a stand-in of the file compiles here the steps of a request
    with `opts` and the prompt `prompt(config)` (the first request's, or a warm-up's) -> the loaded model. The
    load's copies run on a stream of their own, and graph captures here forbid only this thread's unsafe calls
    (runner.py), so the two do not interfere. The prompt's errors are raised before anything starts."""
    from qspec.weights.gguf_io import read_gguf_layout

    result: dict[str, Any] = {}

    def loading() -> None:
        try:
            if device.type != "cuda":
                result["model"] = load()
                return
            with torch.cuda.stream(torch.cuda.Stream(device)):
                result["model"] = load()
                torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # re-raised by the caller's thread
            result["error"] = e

    cfg, types, nbytes = read_gguf_layout(path)  # a bad header fails here, before anything starts
    ids = prompt(cfg)
    with_mtp = with_mtp and cfg.has_mtp
    layers = stand_in_layers(cfg, types)
    plan, stand_in_bytes = stand_in_plan(cfg, layers, types, nbytes)
    file_bytes = sum(b for n, b in nbytes.items() if n != PLE_TABLE)
    if not _room_for(file_bytes, stand_in_bytes, device):
        say("qspec: no room on the device for a stand-in beside the weights: the first request compiles")
        return load()
    loader = threading.Thread(target=loading, name="qspec-load", daemon=True)
    t0 = time.perf_counter()
    loader.start()
    try:
        small, w = stand_in_weights(cfg, layers, plan, device=device, dtype=dtype, with_mtp=with_mtp)
        stand_in = Model(small, w, with_mtp=with_mtp, hnorm_per_stream=hnorm_per_stream)
        warm_on_stand_in(stand_in, opts, ids)
        say(f"qspec: compiled on a {len(layers)}-layer stand-in while the weights loaded "
            f"({time.perf_counter() - t0:.1f} s)")
    except Exception as e:  # the stand-in only saves time: the load goes on without it
        say(f"qspec: compiling on a stand-in failed ({type(e).__name__}: {e}); the first request compiles")
    finally:
        stand_in = w = None  # its memory back before the real engine allocates its cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    loader.join()
    if "error" in result:
        raise result["error"]
    return result["model"]
