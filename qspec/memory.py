"""How much memory a context needs, checked before the caches are allocated.

A cache's size is affine in its capacity: KV cells, indexer raw and pooled keys and the host-side cell tables grow
with it; recurrent states and conv snapshots (per rollback slot) do not. Rather than restate every cache's layout
here, the footprint is measured on two small caches of the same model and options and extrapolated, so it follows
whatever the caches hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from qspec.model.model import CacheOptions, Model
from qspec.runner import ContextError
from qspec.weights.pinned import available_host_bytes

# the two capacities measured (multiples of every pooling ratio and KV bucket, so the fit has no rounding steps)
_PROBES = (1024, 2048)
# what a context may take of the memory free when the engine starts; the rest is left to the steps' activations
BUDGET = 0.9


class CacheMemoryError(ContextError):
    """The requested context does not fit the memory there is."""


@dataclass(frozen=True)
class Footprint:
    """Cache bytes as fixed + per_token * capacity, on the model's device and on the host."""

    device_fixed: float
    device_per_token: float
    host_fixed: float
    host_per_token: float

    def bytes(self, capacity: int) -> tuple[int, int]:
        """(device bytes, host bytes) of a cache of `capacity` tokens."""
        return (round(self.device_fixed + self.device_per_token * capacity),
                round(self.host_fixed + self.host_per_token * capacity))


def _collect(obj: Any, seen: set[int], sizes: dict[str, int], depth: int = 0) -> None:
    """Add the bytes of every tensor and array reachable from a cache object to sizes[device type] ('host' for
    numpy), each storage once."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            key = "host" if obj.device.type == "cpu" else "device"
            sizes[key] = sizes.get(key, 0) + st.nbytes()
        return
    if isinstance(obj, np.ndarray):
        base = obj if obj.base is None else obj.base
        if isinstance(base, np.ndarray) and id(base) not in seen:
            seen.add(id(base))
            sizes["host"] = sizes.get("host", 0) + base.nbytes
        return
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif type(obj).__module__.startswith("qspec.") and not isinstance(obj, torch.nn.Module):
        items = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    else:
        return
    for x in items:
        _collect(x, seen, sizes, depth + 1)


def cache_bytes(model: Model, opts: CacheOptions) -> tuple[int, int]:
    """(device bytes, host bytes) of the cache `model.new_cache(opts)` allocates (it allocates it to count)."""
    return held_bytes(model, [model.new_cache(opts)])


def held_bytes(model: Model, caches: list[Any]) -> tuple[int, int]:
    """(device bytes, host bytes) of these caches, each storage once (on a CPU model, all of it host bytes)."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for c in caches:
        _collect(c, seen, sizes)
    if model.device.type == "cpu":
        return 0, sizes.get("host", 0) + sizes.get("device", 0)
    return sizes.get("device", 0), sizes.get("host", 0)


def footprint(model: Model, opts: CacheOptions) -> Footprint:
    """The cache's bytes against its capacity, measured at two small capacities."""
    (d0, h0), (d1, h1) = (cache_bytes(model, replace(opts, capacity=c)) for c in _PROBES)
    span = _PROBES[1] - _PROBES[0]
    dp, hp = (d1 - d0) / span, (h1 - h0) / span
    return Footprint(d0 - dp * _PROBES[0], dp, h0 - hp * _PROBES[0], hp)


def available_bytes(dev: torch.device) -> int:
    """Memory free for new allocations: the GPU's free memory, or the host's available memory."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    return available_host_bytes()


def free_bytes(model: Model) -> tuple[int, int]:
    """(device, host) bytes free for new allocations where the model's caches go (on a CPU model, the host twice)."""
    host = available_bytes(torch.device("cpu"))
    return (available_bytes(model.device) if model.device.type == "cuda" else host, host)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def caches_that_fit(model: Model, opts: CacheOptions, most: int, available: tuple[int, int] | None = None) -> int:
    """How many caches of `opts.capacity` tokens (0..most) fit in BUDGET of the free memory (`available`: (device,
    host) free bytes, default asked of the system), measured at every capacity: a batch's slots chosen by memory."""
    need_dev, need_host = footprint(model, opts).bytes(opts.capacity)
    if available is None:
        available = free_bytes(model)
    n = most
    for need, free in ((need_dev, available[0]), (need_host, available[1])):
        if need > 0:
            n = min(n, int(BUDGET * free // need))
    return max(0, n)


def check_cache_fits(model: Model, opts: CacheOptions, available: tuple[int, int] | None = None,
                     reserve: int = 0) -> None:
    """Raise CacheMemoryError, before anything is allocated at that size, when a cache of `opts.capacity` tokens
    (and `reserve` bytes more on the model's device: the engine's prefix checkpoints) would take more than BUDGET
    of the free memory; the message says the largest capacity that fits. `available`: (device, host) free bytes
    (default: asked of the system). Capacities up to the larger probe are not checked: their caches are as small
    as the probes."""
    if opts.capacity <= _PROBES[1]:
        return
    fp = footprint(model, opts)
    if model.device.type == "cpu":
        fp = replace(fp, host_fixed=fp.host_fixed + reserve)
    else:
        fp = replace(fp, device_fixed=fp.device_fixed + reserve)
    need_dev, need_host = fp.bytes(opts.capacity)
    if available is None:
        available = free_bytes(model)
    budget_dev, budget_host = (BUDGET * a for a in available)
    if need_dev <= budget_dev and need_host <= budget_host:
        return
    fits = []
    for fixed, per, budget in ((fp.device_fixed, fp.device_per_token, budget_dev),
                               (fp.host_fixed, fp.host_per_token, budget_host)):
        if per > 0:
            fits.append(int((budget - fixed) // per))
    largest = max(0, min(fits)) // 4 * 4
    where, need, free = (("GPU", need_dev, available[0]) if need_dev > budget_dev else
                         ("host", need_host, available[1]))
    more = ("; or keep more layers' routed experts in host memory (--host-experts)"
            if where == "GPU" and any(getattr(m, "blocks_only", False) for m in getattr(model, "moe", ())) else "")
    raise CacheMemoryError(f"a context of {opts.capacity:,} tokens needs {_gb(need)} of {where} memory for its "
                           f"caches (KV, indexer keys, recurrent state) and {_gb(free)} is free: the largest context "
                           f"that fits is {largest:,} tokens{more}")
