"""Benchmark arms: an engine configuration with a name.

Built-in arms (the seed's comparison):
  nospec    plain decoding with qspec's defaults (incremental pooled keys, Pad8 rows, fused snapshots)
  baseline  MTP3 with the seed's optimizations off and the full-precision draft head (the llama.cpp arm)
  ours      MTP5, pooled-key preservation + incremental update + Pad8 + fused snapshots, Q4 draft head

Custom arms: `name:key=value,...` with keys draft (0-8), preserve, incremental, pad (8|16; 0|none = off),
fused, q4, compile (torch.compile-fused step math, on by default), gemv (the Triton one-row mat-vec and one-row
mixer kernels, on by default), sparse (sparse QSA attention), fattn (masked attention in one Triton pass over the
cache, on by default on CUDA), kvw (the q8_0 KV write in one launch, on by default), gconv (the GDN step conv
kernel, on by default), early (greedy rounds queue the next draft chain before the host reads the round, on by
default), pdl (programmatic dependent launch for the Triton and compiled kernels where the GPU has it, on by
default), dvocab (N: drafts only from the first N token ids, the head reading only their rows; 0 = all, the default),
gmm (prefill's routed experts as grouped GEMMs where torch has CUTLASS kernels for the GPU, on by default),
hcrows (the most rows of a step whose mixers take the Triton kernels, 6 by default), auto (the engine picks each
round's depth in 0..draft, `--draft auto:N`: spec/depth.py)
(booleans as 1/0, true/false, on/off) and `from=ARM` to start from another arm instead of all-off:
`ours-noq4:from=ours,q4=0`. In a list, arms are separated by commas (or `;`); a `key=value` item without a
`name:` continues the custom arm before it: `nospec,baseline,mtp5:draft=5,pad=8,ours`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from qspec.bench.accept import parse_kv
from qspec.engine import EngineOptions
from qspec.spec.accept import AcceptHook

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Arm:
    name: str
    draft: int = 0
    preserve: bool = False  # seed Algorithm 1: keep valid pooled keys across rollback
    incremental: bool = False  # seed Algorithm 2: materialize only new or changed blocks
    pad: int | None = None  # seed Algorithm 3: fixed update-row count (8 in the seed)
    fused: bool = False  # seed Algorithms 4-5: one fused conv-snapshot pass
    q4: bool = False  # Q4_0-rounded draft output head
    compile: bool = True  # torch.compile-fused step math on CUDA (the engine's default; off for A/B runs)
    sparse: bool = False  # QSA reads only the chosen blocks and the tail (--sparse-attention)
    gemv: bool = True  # one-row products through the Triton mat-vec (the engine's default; off: cuBLAS)
    fattn: bool | None = None  # masked attention in one pass over the cache (None: the default, on CUDA)
    kvw: bool = True  # q8_0 KV writes in one launch (the engine's default; off: --no-kv-write-kernel)
    gconv: bool = True  # GDN step conv, silu and q/k norms in one launch (the default; off: --no-gdn-conv-kernel)
    early: bool = True  # the next draft chain queued before the round's read-back (the default; off: late)
    pdl: bool = True  # programmatic dependent launch where the GPU has it (the default; off: --no-pdl)
    dvocab: int = 0  # drafts only from the first dvocab ids (--draft-vocab N; 0: the whole vocabulary)
    gmm: bool = True  # prefill's routed experts as grouped GEMMs (the default; off: --no-grouped-mm)
    hcrows: int = 6  # the most rows of a step whose mixers take the Triton kernels (EngineOptions.mixer_step_rows)
    auto: bool = False  # the depth of every round chosen by the engine in 0..draft (EngineOptions.draft_auto)

    def options(self, *, capacity: int, kv_type: str, accept_hook: AcceptHook | None,
                draft_head: torch.Tensor | None) -> EngineOptions:
        # q4: the engine packs the LM head to Q4_0 once (Q4Weight; a 4-bit Triton mat-vec on CUDA)
        return EngineOptions(draft=self.draft, draft_auto=self.auto and bool(self.draft), capacity=capacity,
                             kv_type=kv_type, exact=False,
                             preserve_pooled=self.preserve, incremental_pooled=self.incremental,
                             pad_target=self.pad, fused_snapshots=self.fused,
                             draft_head="q4" if self.q4 and self.draft else "full",
                             accept_hook=accept_hook if self.draft else None, compile=self.compile,
                             sparse_attention=self.sparse, gemv=self.gemv, fused_attention=self.fattn,
                             kv_write_kernel=self.kvw, gdn_conv_kernel=self.gconv,
                             draft_before_readback=self.early and bool(self.draft), pdl=self.pdl,
                             draft_vocab=range(self.dvocab) if self.dvocab and self.draft else None,
                             grouped_mm=self.gmm, mixer_step_rows=self.hcrows)

    def describe(self) -> str:
        if not self.draft:
            head = "no drafting"
        else:
            head = f"MTP auto (0..{self.draft})" if self.auto else f"MTP{self.draft}"
        opts = [n for n, on in (("preserve", self.preserve), ("incremental", self.incremental),
                                (f"pad{self.pad}", self.pad), ("fused", self.fused)) if on]
        parts = [head, "+".join(opts) if opts else "seed optimizations off"]
        if self.draft:
            parts.append("Q4 draft head" if self.q4 else "full-precision draft head")
        if not self.compile:
            parts.append("unfused step math")
        if self.sparse:
            parts.append("sparse attention")
        if self.fattn is False:
            parts.append("default masked attention read")
        elif self.fattn:
            parts.append("fused masked attention")
        if not self.kvw:
            parts.append("compiled q8_0 KV write")
        if not self.gconv:
            parts.append("compiled GDN conv")
        if not self.gemv:
            parts.append("cuBLAS one-row products")
        if not self.early and self.draft:
            parts.append("draft chain after the read-back")
        if not self.pdl:
            parts.append("no PDL")
        if self.dvocab and self.draft:
            parts.append(f"drafts from the first {self.dvocab} ids")
        if not self.gmm:
            parts.append("prefill experts in a loop")
        if self.hcrows != 6:
            parts.append(f"mixer kernels up to {self.hcrows} rows")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"description": self.describe()}


BUILTIN: dict[str, Arm] = {
    "nospec": Arm("nospec", preserve=True, incremental=True, pad=8, fused=True),
    "baseline": Arm("baseline", draft=3),
    "ours": Arm("ours", draft=5, preserve=True, incremental=True, pad=8, fused=True, q4=True),
}
DEFAULT_ARMS = "nospec,baseline,ours"


def _bool(key: str, v: str, spec: str) -> bool:
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"arm {spec!r}: {key}={v!r} is not a boolean (1/0, true/false, on/off)")


def parse_arm(spec: str, known: dict[str, Arm] | None = None) -> Arm:
    """One arm: a built-in name, or `name:key=value,...` (see the module docstring)."""
    known = BUILTIN if known is None else known
    spec = spec.strip()
    name, sep, body = spec.partition(":")
    name = name.strip()
    if not name or any(c in name for c in "=,; "):
        raise ValueError(f"arm {spec!r}: expected NAME or NAME:key=value,...")
    if not sep:
        if name not in known:
            raise ValueError(f"unknown arm {name!r} (built-in: {', '.join(BUILTIN)}; custom: NAME:draft=5,...)")
        return known[name]
    kv = parse_kv(body, f"arm {spec!r}")
    base = Arm(name)
    if "from" in kv:
        src = kv.pop("from")
        if src not in known:
            raise ValueError(f"arm {spec!r}: from={src!r} is not a known arm")
        base = replace(known[src], name=name)
    fields: dict[str, Any] = {}
    for k, v in kv.items():
        if k == "draft":
            try:
                d = int(v)
            except ValueError as e:
                raise ValueError(f"arm {spec!r}: draft={v!r} is not an integer") from e
            if not 0 <= d <= 8:
                raise ValueError(f"arm {spec!r}: draft must be in [0, 8], got {d}")
            fields["draft"] = d
        elif k == "pad":
            if v.lower() in ("0", "none", "off", "false"):
                fields["pad"] = None
            else:
                if v not in ("8", "16"):  # the seed's (and the engine's) Pad targets
                    raise ValueError(f"arm {spec!r}: pad={v!r}: expected 8, 16, or 0/none (off)")
                fields["pad"] = int(v)
        elif k in ("preserve", "incremental", "fused", "q4", "compile", "sparse", "gemv", "fattn", "kvw",
                   "gconv", "early", "pdl", "gmm", "auto"):
            fields[k] = _bool(k, v, spec)
        elif k == "hcrows":
            if v not in {str(n) for n in range(1, 9)}:
                raise ValueError(f"arm {spec!r}: hcrows={v!r}: expected 1..8")
            fields[k] = int(v)
        elif k == "dvocab":
            if not v.isdigit():
                raise ValueError(f"arm {spec!r}: dvocab={v!r} is not a token count (0 = the whole vocabulary)")
            fields[k] = int(v)
        else:
            raise ValueError(f"arm {spec!r}: unknown key {k!r} "
                             "(draft, preserve, incremental, pad, fused, q4, compile, sparse, gemv, fattn, kvw, gconv, "
                             "early, pdl, dvocab, gmm, hcrows, auto, from)")
    return replace(base, **fields)


def parse_arms(spec: str | list[str] | tuple[str, ...]) -> list[Arm]:
    """A list of arms from `nospec,baseline,ours,mtp5:draft=5,pad=8` (or a list of single-arm specs)."""
    items: list[str] = []
    raw = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    for chunk in raw:
        for part in chunk.replace(";", ",").split(","):
            part = part.strip()
            if not part:
                continue
            if "=" in part and ":" not in part:
                if not items or ":" not in items[-1]:
                    raise ValueError(f"arms {spec!r}: {part!r} does not follow a custom arm (NAME:key=value)")
                items[-1] += "," + part
            else:
                items.append(part)
    if not items:
        raise ValueError("no arms given")
    known = dict(BUILTIN)
    arms: list[Arm] = []
    for it in items:
        arm = parse_arm(it, known)
        if any(a.name == arm.name for a in arms):
            raise ValueError(f"arm {arm.name!r} appears twice")
        arms.append(arm)
        known[arm.name] = arm
    return arms
