"""Mixture of experts: softmax over all experts, top-k renormalised, plus a sigmoid-gated shared expert."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from qspec.kernels.moe_few import ExpertWeight, expert_ffn, moe_few_torch, moe_slots, sum_slots
from qspec.kernels.qmatmul import expand, int8_experts, qmoe_few
from qspec.kernels.route import route_top_k, route_top_k_quantized
from qspec.kernels.triton_common import module_flag, nvidia_major
from qspec.model.fuse import fused
from qspec.model.ops import EXACT_MAX_ROWS, StackedWeight, linear, row_exact, sigmoid, silu, stack_rows
from qspec.weights.qweight import QuantWeight

# Decode/verify steps on the GPU route a few tokens without a host round trip (CUDA-graph safe).
FEW_TOKENS = 16

# Few-token steps of a file whose shared-expert projections are blocks and whose router is kept in a float type run the
# shared expert on a second CUDA stream beside the router product, the routing and the routed experts (one chain of
# small launches beside another, neither of which fills the GPU; vLLM and SGLang overlap shared experts so too). The
# same kernels and roundings as one stream: only their order on the GPU changes (on the CPU the same functions run in
# order, so the CPU tests run this path). A module flag (KernelSwitches).
_SHARED_STREAM = True
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


# Few-token steps of a file whose shared expert has the routed experts' block types and shapes (every layer of
# llama.cpp's mixes) run it as one more routed pair: its blocks are held as expert E of the routed experts' tensors
# (the loader's tensors become views of them, so nothing is held twice), the routing adds it to each token's slots with
# weight sigmoid(its gate logit), and the experts' launches compute it beside the routed ones: no side stream, no
# launches of its own. Its numbers round as a routed expert's do (weighted in the down launch, summed with the slots).
# A module flag (KernelSwitches); off: the side stream above.
_SHARED_PAIR = True
# Devices on which MoE merges such a shared expert into the routed experts' tensors (a copy of each: on the host the
# loader's tensors are views of the mapped file, which a copy would read whole).
MERGE_DEVICES = ("cuda",)


def shared_pair_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, few-token steps run a merged shared expert as one more routed pair (on) or apart (off)."""
    return module_flag(__name__, "_SHARED_PAIR", on)


def shared_stream_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, few-token steps of block experts run the shared expert on a side stream (`on`) or not."""
    return module_flag(__name__, "_SHARED_STREAM", on)


@contextlib.contextmanager
def _on_side_stream(dev: torch.device) -> Iterator[None]:
    """Work inside the block runs on `dev`'s side stream, after everything queued so far on the current one; the
    caller joins it back (`_join_side_stream`) before reading its outputs. On the CPU: in place, in order."""
    if dev.type != "cuda":
        yield
        return
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        yield


def _join_side_stream(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).wait_stream(_SIDE_STREAMS[dev])

# Prefill's routed experts through torch's grouped GEMM (torch._grouped_mm: CUTLASS kernels on Hopper for bf16, a loop
# over the groups elsewhere): three launches per layer and no host sync, instead of five launches per expert. The
# engine's default on a GPU that has the CUTLASS kernels (prefill many times faster, decode unchanged: BENCHMARKS.md §4,
# the grouped GEMMs row). A module flag, as kernels/gemv.py's.
_GROUPED_MM = False


def grouped_mm_supported(dev: torch.device) -> bool:
    """Whether torch has CUTLASS grouped GEMMs for `dev`: compute capability 9.x or 10.x (torch builds them for sm_90
    and sm_100; other GPUs get a slower fallback, if any). Measured on the H200 only."""
    return hasattr(torch, "_grouped_mm") and nvidia_major(dev) in (9, 10)


def grouped_mm_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, bf16 prefill steps run their routed experts as three grouped GEMMs (where torch has them)."""
    return module_flag(__name__, "_GROUPED_MM", on and hasattr(torch, "_grouped_mm"))


def grouped_experts(x: torch.Tensor, ends: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
                    ) -> torch.Tensor:
    """x [n, D]: rows sorted by expert, expert e's rows ending at ends[e] (int32, cumulative) -> each row through its
    expert, down(silu(gate x) * up x) [n, D]; the weights are [E, out, in] as stored."""
    g = torch._grouped_mm(x, gate.transpose(-2, -1), offs=ends)
    u = torch._grouped_mm(x, up.transpose(-2, -1), offs=ends)
    return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=ends)


# Prefill with block experts: the experts are expanded a group at a time into a 16-bit scratch of at most this many
# bytes, and each group's rows go through the grouped GEMMs, so a step reads every chosen expert's blocks once and
# never holds a 16-bit copy of a layer's experts (BENCHMARKS.md §5b, prefill).
EXPERT_SCRATCH_BYTES = 1 << 30


def grouped_block_experts(x: torch.Tensor, counts: list[int], gate: QuantWeight, up: QuantWeight,
                          down: QuantWeight, scratch_bytes: int = EXPERT_SCRATCH_BYTES) -> torch.Tensor:
    """grouped_experts for block experts: x [n, D] sorted by expert, counts[e] rows of expert e (host ints)."""
    E, Fd, D = gate.shape
    step = max(1, scratch_bytes // ((2 * Fd * D + D * Fd) * x.element_size()))
    ends = [0]
    for n in counts:
        ends.append(ends[-1] + n)
    ys = []
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        r0, r1 = ends[e0], ends[e1]
        if r1 == r0:
            continue
        offs = torch.tensor([c - r0 for c in ends[e0 + 1:e1 + 1]], dtype=torch.int32).to(x.device, non_blocking=True)
        ys.append(grouped_experts(x[r0:r1], offs, *(expand(w.experts(e0, e1), x.dtype) for w in (gate, up, down))))
    return torch.cat(ys)


# ---- routed experts kept as GGUF blocks --------------------------------------------------------------------------
# moe_few.expert_ffn multiplies blocks through kernels/qmatmul.qmatmul, so every chosen expert's blocks are read once
# for all the rows that chose it and never expanded in memory. A few-token step whose three expert matrices are all
# blocks runs kernels/qmatmul.qmoe_few instead (one launch per projection, no host sync); q_moe_slots is left for a
# file that keeps some of them in a 16-bit type.
def q_moe_slots(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: ExpertWeight, up: ExpertWeight,
                down: ExpertWeight) -> torch.Tensor:
    """moe_slots for block experts: the weighted slot outputs [T, k, D], each distinct chosen expert run once over
    the rows that chose it (a host sync for the expert list: such steps are not captured in CUDA graphs)."""
    T, k = top_i.shape
    out = h.new_zeros(T, k, h.shape[-1])
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)
        out[tok, slot] = expert_ffn(h[tok], gate[e], up[e], down[e]) * top_w[tok, slot, None]
    return out


def route(h: torch.Tensor, router: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return route_top_k(linear(h, router), k)


@fused
def moe_in(h: torch.Tensor, w_in: torch.Tensor, n_experts: int, ff: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w_in = [shared gate ; shared up ; router ; shared gate_inp] -> (router logits [T, E], shared activation
    silu(gate h) * up h [T, ff], shared-expert gate logit gate_inp . h [T, 1]). Routing itself stays
    outside the fused function: on CUDA it is one Triton kernel (kernels/route.py). The gate logit stays raw:
    add_shared_expert applies its sigmoid, so no kernel of this function computes it."""
    y = linear(h, w_in)
    g, u = y[:, :ff], y[:, ff:2 * ff]
    return y[:, 2 * ff:2 * ff + n_experts], silu(g) * u, y[:, 2 * ff + n_experts:2 * ff + n_experts + 1]


def _plus_shared(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """routed is [T, D], or [T, k, D] weighted slot outputs still to be summed (the few-token path); the shared
    expert's output `shared` [T, D] is weighted by sigmoid(gate_logit) [T, 1]."""
    if routed.dim() == 3:
        routed = sum_slots(routed)
    return routed + shared * sigmoid(gate_logit)


@fused
def add_shared_expert(routed: torch.Tensor, act: torch.Tensor, gate_logit: torch.Tensor, down: torch.Tensor
                      ) -> torch.Tensor:
    """_plus_shared with the shared expert's down product of its activation `act`."""
    return _plus_shared(routed, linear(act, down), gate_logit)


@fused
def add_shared_output(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """_plus_shared where the shared expert's output is computed already (MoE.forward_side_stream)."""
    return _plus_shared(routed, shared, gate_logit)


add_slots = fused(sum_slots)  # the k + 1 weighted slots of forward_shared_pair, summed and rounded once


@fused
def shared_expert(h: torch.Tensor, w_gate_up: torch.Tensor, ff: int, down: torch.Tensor) -> torch.Tensor:
    """The shared expert's output down(silu(gate h) * up h) [T, D] (unweighted), w_gate_up = [gate ; up]: the ops
    of moe_in and add_shared_expert that compute it."""
    y = linear(h, w_gate_up)
    return linear(silu(y[:, :ff]) * y[:, ff:2 * ff], down)


def _router_split(w_in: object, shared_rows: int) -> tuple[object, torch.Tensor] | None:
    """A stacked [shared gate ; shared up ; router ; gate_inp] whose shared rows are block parts and whose last part
    is exactly the float [router ; gate_inp] -> (the shared rows' weight, the float part); else None."""
    if not isinstance(w_in, StackedWeight) or not isinstance(w_in.parts[-1], torch.Tensor):
        return None
    blocks = w_in.parts[:-1]
    if not all(isinstance(p, QuantWeight) for p in blocks) or sum(p.shape[0] for p in blocks) != shared_rows:
        return None
    return (blocks[0] if len(blocks) == 1 else StackedWeight(blocks)), w_in.parts[-1]


_PAIRS = (("ffn_gate_exps", "ffn_gate_shexp"), ("ffn_up_exps", "ffn_up_shexp"), ("ffn_down_exps", "ffn_down_shexp"))


def merge_shared_expert(w: dict[str, torch.Tensor], b: str) -> tuple[QuantWeight, ...] | None:
    """Layer b's routed gate/up/down [E, ...] with the shared expert's as expert E [E + 1, ...] (copies), w's entries
    replaced by views of them (the originals freed where w held the only reference), when all six are blocks of
    matching types and shapes on one of MERGE_DEVICES; else None, w unchanged."""
    if not all(_mergeable(w[f"{b}.{r}.weight"], w[f"{b}.{sh}.weight"]) for r, sh in _PAIRS):
        return None
    merged = []
    for r_name, sh_name in _PAIRS:  # one at a time: one routed tensor's copy is the only extra memory at any moment
        r, sh = w[f"{b}.{r_name}.weight"], w[f"{b}.{sh_name}.weight"]
        E = r.shape[0]
        m = QuantWeight(torch.cat([r.raw, sh.raw[None]]), r.qtype, (E + 1, *r.shape[1:]), r.planes)
        del r, sh
        w[f"{b}.{r_name}.weight"], w[f"{b}.{sh_name}.weight"] = m.experts(0, E), m[E]  # type: ignore[assignment]
        merged.append(m)
    return tuple(merged)


def _mergeable(routed: object, shared: object) -> bool:
    return (isinstance(routed, QuantWeight) and isinstance(shared, QuantWeight) and routed.dim() == 3
            and routed.code == shared.code and tuple(routed.shape[1:]) == tuple(shared.shape)
            and routed.device == shared.device and routed.device.type in MERGE_DEVICES)


class MoE(torch.nn.Module):
    def __init__(self, w: dict[str, torch.Tensor], b: str, n_used: int) -> None:
        super().__init__()
        self.n_used = n_used
        # the shared expert as expert E of the routed experts' tensors, where it can be (merge_shared_expert)
        self.merged = merge_shared_expert(w, b)
        # the router and the shared expert's gate, up and gate_inp all read h: one product. The two kept in a float
        # type in a GGUF (the router, gate_inp) sit side by side, so that with block-typed gate and up they make one
        # 16-bit part beside one block part (ops.StackedWeight), not three parts.
        self.w_in, (self.sh_gate, self.sh_up, self.router, sh_gate_inp) = stack_rows(
            w[f"{b}.ffn_gate_shexp.weight"], w[f"{b}.ffn_up_shexp.weight"], w[f"{b}.ffn_gate_inp.weight"],
            w[f"{b}.ffn_gate_inp_shexp.weight"][None, :])
        self.sh_gate_inp = sh_gate_inp[0]  # [D]
        self.gate = w[f"{b}.ffn_gate_exps.weight"]  # [E, F, D]
        self.up = w[f"{b}.ffn_up_exps.weight"]  # [E, F, D]
        self.down = w[f"{b}.ffn_down_exps.weight"]  # [E, D, F]
        self.sh_down = w[f"{b}.ffn_down_shexp.weight"]
        # any of the three as blocks (a file may keep one of them in a 16-bit type): the block paths below
        self.quantized = any(isinstance(m, QuantWeight) for m in (self.gate, self.up, self.down))
        # all three as blocks: the few-token step is one kernel per projection with no host sync (kernels/qmatmul.py
        # qmoe_few), so it can be captured in a CUDA graph; a mixed set takes q_moe_slots, which cannot
        self.blocks_only = all(isinstance(m, QuantWeight) for m in (self.gate, self.up, self.down))
        # block shared gate/up beside a float router: the two products can run apart (the side-stream path)
        self.split = _router_split(self.w_in, 2 * self.sh_gate.shape[0])

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.router, self.n_used)

    def shared_pair(self) -> bool:
        """Whether few-token block steps run the shared expert as one more routed pair (forward_shared_pair)."""
        return _SHARED_PAIR and self.merged is not None and self.split is not None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.shared_pair() and self._block_few(h):
            return self.forward_shared_pair(h)
        if _SHARED_STREAM and self.split is not None and h.shape[0] <= FEW_TOKENS and not row_exact():
            return self.forward_side_stream(h)
        logits, act, gate_logit = moe_in(h, self.w_in, self.router.shape[0], self.sh_gate.shape[0])
        return add_shared_expert(self._routed(h, *self._top_k(logits, h)), act, gate_logit, self.sh_down)

    def forward_side_stream(self, h: torch.Tensor) -> torch.Tensor:
        """forward, the shared expert on a side stream (on CUDA) while the router product, the routing and the
        routed experts run on the current one; the same products and roundings (a file with `self.split`)."""
        w_shared, w_router = self.split  # type: ignore[misc]
        E = self.router.shape[0]
        with _on_side_stream(h.device):
            shared = shared_expert(h, w_shared, self.sh_gate.shape[0], self.sh_down)
        r = linear(h, w_router)
        routed = self._routed(h, *self._top_k(r[:, :E], h))
        _join_side_stream(h.device)
        return add_shared_output(routed, shared, r[:, E:E + 1])

    def forward_shared_pair(self, h: torch.Tensor) -> torch.Tensor:
        """forward with the shared expert as one more routed pair (a file with `self.merged` and `self.split`): the
        router's product gives its gate logit beside the routers', the routing adds slot k (expert E, weight
        sigmoid(gate logit)), and the routed experts' launches compute all k + 1 pairs."""
        _, w_router = self.split  # type: ignore[misc]
        gate, up, down = self.merged  # type: ignore[misc]
        E = self.router.shape[0]
        r = linear(h, w_router)[:, :E + 1]  # the router's logits, then the shared expert's gate logit
        top_w, top_i, hq = self._top_k(r, h, shared=True)
        return add_slots(qmoe_few(h, top_i, top_w, gate, up, down, hq))

    def _block_few(self, h: torch.Tensor) -> bool:
        """Whether `_routed` sends these rows to qmoe_few (the few-token kernels of block experts)."""
        return (self.blocks_only and h.is_cuda and h.shape[0] <= FEW_TOKENS
                and not (row_exact() and h.shape[0] <= EXACT_MAX_ROWS))

    def _top_k(self, logits: torch.Tensor, h: torch.Tensor, shared: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The routing (weights, ids; shared: with the shared expert's slot, route.route_top_k_shared_torch), and h
        quantized in the routing's launch when the routed experts will read it so (qmatmul.int8_experts): the
        quantizer's own launch would wait for the routing."""
        quantize = self._block_few(h) and int8_experts(h, self.gate, self.up, self.down)  # type: ignore[arg-type]
        return route_top_k_quantized(logits, self.n_used, h if quantize else None, shared)

    def _routed(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                hquant: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The routed experts' part of the output: [T, D], or [T, k, D] weighted slot outputs (few-token paths);
        hquant: h quantized for qmoe_few's int8 kernels, or None."""
        T = h.shape[0]
        if row_exact() and T <= EXACT_MAX_ROWS:
            return self._per_token(h, top_w, top_i)
        if self._block_few(h):
            return qmoe_few(h, top_i, top_w, self.gate, self.up, self.down, hquant)  # type: ignore[arg-type]
        if self.quantized and h.is_cuda and T <= FEW_TOKENS:
            return q_moe_slots(h, top_i, top_w, self.gate, self.up, self.down)
        if h.is_cuda and T <= FEW_TOKENS:
            return moe_slots(h, top_i, top_w, self.gate, self.up, self.down)
        return self._grouped(h, top_w, top_i)

    def _experts_on(self, dev: torch.device) -> tuple[ExpertWeight, ExpertWeight, ExpertWeight]:
        """The routed experts (gate, up, down) on `dev`: as held, or where they are kept in page-locked host memory
        (weights/host_experts.py), copied to it for this step: a prefill-sized step reads every expert anyway, and
        its kernels read the device's memory (the few-token kernels read the host's: `_routed`)."""
        ws = (self.gate, self.up, self.down)
        if dev.type != "cuda" or all(w.device == dev for w in ws):
            return ws
        return tuple(w.to(dev) for w in ws)  # type: ignore[return-value]

    def _per_token(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair as its own M=1 product: a row never depends on its neighbours."""
        return moe_few_torch(h, top_i, top_w, self.gate, self.up, self.down)

    def _grouped(self, h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Prefill-sized steps: each chosen expert once, over all the tokens that chose it. The (token, slot) pairs
        are sorted by expert on the device, so the step waits for the host once (the per-expert counts), not once
        per expert; each token's expert outputs are then added in ascending expert order, the products and the
        rounding after each addition those of `grouped_moe_reference`. With `grouped_mm_mode` (bf16) the experts'
        products are three grouped GEMMs instead, with no host sync (the same rows, other kernels)."""
        T, k = top_i.shape
        flat = top_i.flatten()
        order = torch.argsort(flat, stable=True)  # by expert, tokens ascending within one (as torch.where gives them)
        counts = torch.bincount(flat, minlength=self.gate.shape[0])
        x = h[order // k]
        gate, up, down = self._experts_on(h.device)
        if _GROUPED_MM and x.dtype == torch.bfloat16 and not self.quantized:
            y = grouped_experts(x, counts.cumsum(0).to(torch.int32), gate, up, down)
        elif _GROUPED_MM and self.blocks_only and x.dtype == torch.bfloat16:
            y = grouped_block_experts(x, counts.tolist(), gate, up, down)  # type: ignore[arg-type]
        else:
            ys, o = [], 0
            for e, n in enumerate(counts.tolist()):  # the one host sync
                if n:
                    xe = x[o:o + n]
                    ys.append(expert_ffn(xe, gate[e], up[e], down[e]))
                    o += n
            y = torch.cat(ys)
        y = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)  # back to (token, slot)
        weighted = y * top_w[..., None]
        by_expert = top_i.argsort(dim=1)  # each token's slots in ascending expert order
        weighted = weighted.gather(1, by_expert[..., None].expand_as(weighted))
        out = weighted[:, 0].to(h.dtype)
        for j in range(1, k):
            out = (out + weighted[:, j]).to(h.dtype)
        return out


def grouped_moe_reference(h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate: torch.Tensor,
                          up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """MoE._grouped's definition, one expert at a time with a host round trip each (the tests' reference)."""
    out = torch.zeros_like(h)
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)
        x = h[tok]
        y = expert_ffn(x, gate[e], up[e], down[e])
        out[tok] += y * top_w[tok, slot, None]  # a token picks an expert at most once
    return out

