"""Products with GGUF-quantized weights read as their blocks: y = x @ W^T for W a `QuantWeight`.

`qmatmul_torch` is the reference (expand the blocks to f32, multiply in f32, return x.dtype). `qmatmul` is what the
model calls: the custom op `qspec::qmatmul` (opaque to torch.compile, as `qspec::gemv` is), which on CUDA runs the
Triton kernels of triton_qmatmul.py for a few rows (16-bit x, up to TC_MAX_ROWS: the tensor-core kernel, or the
CUDA-core mat-vec for one row of a narrow matrix; f32 x, up to MAX_ROWS: the mat-vec; the weights read once for all
rows, f32 accumulation), and for more rows (prefill) expands the weights SCRATCH_ELEMENTS at a time into x.dtype and
multiplies them with torch.matmul, so no 16-bit copy of a whole matrix ever exists. Elsewhere (CPU) it computes the
reference by the same bounded chunks. With INT8_DOT, 16-bit rows on CUDA (1..16) of the types qdot.QDOT_QTYPES
take the int8-activation kernels of triton_qdot.py instead (reference: qdot.qdot_matmul_torch).

The routed experts: `qmoe_few` (the few-token step, `qspec::qmoe_few`: two Triton launches over all (token, slot)
pairs on CUDA, mirroring moe_few.moe_slots; with INT8_DOT, the int8-activation kernels of triton_qdot.py); one expert
over many rows (prefill's loop) is moe_few.expert_ffn, whose products are `qmatmul`s; `qexpert_ffn_torch` is its f32
reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from qspec.kernels.qdot import QDOT_QTYPES
from qspec.kernels.triton_common import module_flag, use_triton
from qspec.kernels.triton_qdot import HEAD_ROWS
from qspec.kernels.triton_qdot import MAX_ROWS as QDOT_MAX_ROWS
from qspec.weights.qweight import PLANES, PLANES_QTYPES, QuantWeight, base_type, weight_of

MAX_ROWS = 8  # the f32 mat-vec takes up to this many rows
TC_MAX_ROWS = 16  # the 16-bit tensor-core kernel up to this many; more rows expand the weights by chunks
MOE_MAX_ROWS = 16  # tokens per qmoe_few call that go to the per-pair kernels (moe_few.MAX_ROWS)
# Weights expanded at once for the many-row products: 64 Mi elements (128 MiB in bf16) bounds the scratch while
# keeping each chunk's matmul large enough to run near the GPU's peak (every step matrix but the LM head is one chunk).
SCRATCH_ELEMENTS = 64 << 20
# 16-bit rows on CUDA (one row, and the few-token experts) go to the int8-activation kernels of triton_qdot.py for
# the types they cover (qdot.QDOT_QTYPES): x rounded to int8 per 32 elements, as llama.cpp's mat-vec does, for dp4a
# products instead of the f32 expansion. False: the f32-expansion kernels above (A/B runs). f32 rows always keep
# those (exact f32 products).
INT8_DOT = True
# Dense products of up to this many rows take the int8 kernel; more rows the f32-expansion / tensor-core kernels.
# dp4a's work grows with the rows while the tensor cores' does not: on the H200 the int8 kernel wins at one row for
# each type timed (Q4_K, Q6_K, Q8_0) and loses at six (BENCHMARKS.md §5b; `python -m qspec.bench.qkernels`). The
# experts' kernels, which read a pair's expert once per token, were ahead at 1 and 6 tokens and take up to
# MOE_MAX_ROWS.
INT8_MAX_ROWS = 1
# Q4_K and Q5_K rows in the file's order, and dense Q6_K matrices in planes (not the LM head), take it up to this
# many. Against the tensor cores' pair expansion, Q4_K/Q5_K were x1.44-1.72 faster in int8 at 2 and 4 rows on every
# GDN/QSA shape timed, within 8% either way at 6 and slower at 8; a GDN-sized Q6_K in planes x1.85 faster at 2 rows
# than the tensor cores on the file's order, x0.89 at 6 (4 lies between; BENCHMARKS.md §5b; in benchmarks/results/
# qkernels_tensor_cores_h200-1a48428.txt and qkernels_q6k_planes_h200-1a48428.txt).
INT8_MAX_ROWS_FEW = 4
_FEW = frozenset({int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q5_K)})
_Q6K_PLANES = PLANES + int(GGMLQuantizationType.Q6_K)
# Other matrices in planes (the Q6_K LM head, Q8_0 / Q5_0 / Q4_0 on CUDA) take the int8 kernel up to the kernel's
# QDOT_MAX_ROWS: with whole runs in each thread it beat the tensor cores at 2-8 rows (BENCHMARKS.md §5b), and a row's
# numbers are those of its one-row product.
_QDOT = frozenset(int(t) for t in QDOT_QTYPES) | {PLANES + int(t) for t in PLANES_QTYPES}
# The many-row products expand the weights with triton_expand.py's run kernel (whole 32-weight runs, wide loads,
# contiguous stores); False: triton_qmatmul's step-tile expansion (`dequant_triton`), for A/B runs. Both give
# dequantize's f32 rounded once (the step tiles up to FMA contraction on the GPU).
FAST_EXPAND = True


def int8_dot_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, INT8_DOT is `on` (EngineOptions.int8_dot; the runner sets it around every step)."""
    return module_flag(__name__, "INT8_DOT", on)


def _int8_for(x: torch.Tensor, *qtypes: int) -> bool:
    """Whether the product of 16-bit rows x on CUDA goes to the int8-activation kernels."""
    return (INT8_DOT and x.is_cuda and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)
            and all(int(q) in _QDOT for q in qtypes))


def _int8_limit(code: int, n: int) -> int:
    """The most rows a product with a block matrix of kernel type `code` and n rows takes to the int8 kernel."""
    if code in _FEW or (code == _Q6K_PLANES and n < HEAD_ROWS):
        return INT8_MAX_ROWS_FEW
    return QDOT_MAX_ROWS if code > PLANES else INT8_MAX_ROWS


def _int8_rows(codes: Sequence[int], ns: Sequence[int]) -> int:
    """The most rows a product of these block matrices (kernel types, row counts) takes to the int8 kernel."""
    return min(_int8_limit(c, n) for c, n in zip(codes, ns, strict=True))


def int8_product(x: torch.Tensor, qtype: int, n: int) -> bool:
    """Whether the product of rows x [M, K] with a block matrix of kernel type `qtype` and n rows runs on the int8
    kernel."""
    return 0 < x.shape[0] <= _int8_limit(qtype, n) and _int8_for(x, qtype)


def _kernel_takes(qtype: int) -> bool:
    from qspec.kernels.triton_qmatmul import KERNEL_QTYPES

    return base_type(qtype) in KERNEL_QTYPES


def qmatmul_torch(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Reference: x [..., K] @ dequantize(w)^T computed in f32, returned in x.dtype."""
    if w.dim() != 2:
        raise ValueError(f"qmatmul takes a matrix, got {w!r}")
    return (x.float() @ w.dequantize(torch.float32).t()).to(x.dtype)


def _expand(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of blocks raw [n, row_bytes] (qtype: the kernels' type number) -> [n, k] in dtype (the Triton expansion
    where it runs)."""
    if use_triton(raw) and _kernel_takes(qtype):
        if FAST_EXPAND:
            from qspec.kernels.triton_expand import expand_triton

            return expand_triton(raw, qtype, k, dtype)
        from qspec.kernels.triton_qmatmul import dequant_triton

        return dequant_triton(raw, qtype, k, dtype)
    return weight_of(raw, qtype, k).dequantize(torch.float32).to(dtype)


def expand(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [*lead, N, K] expanded to dtype (the Triton expansion where it runs): a bounded part of a
    larger weight, such as a group of experts for a prefill step's grouped GEMMs."""
    raw = w.raw.reshape(-1, w.raw.shape[-1])
    return _expand(raw if raw.is_contiguous() else raw.contiguous(), w.code, w.shape[-1], dtype).view(w.shape)


def _chunked(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """x [M, K] @ W^T with W expanded SCRATCH_ELEMENTS at a time: on CUDA into x.dtype (tensor cores), elsewhere
    into f32 (the reference's arithmetic)."""
    dt = x.dtype if x.is_cuda else torch.float32
    xs = x.to(dt)
    # whole multiples of 256 rows: an odd chunk width sends cuBLAS to a slow unaligned kernel
    step = max(256, SCRATCH_ELEMENTS // k // 256 * 256)
    if n <= step:
        return (xs @ _expand(raw, qtype, k, dt).t()).to(x.dtype)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r in range(0, n, step):
        w = _expand(raw[r:r + step], qtype, k, dt)
        y[:, r:r + w.shape[0]] = (xs @ w.t()).to(x.dtype)
    return y


@torch.library.custom_op("qspec::qmatmul", mutates_args=())
def qmatmul_op(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x.dtype, W the blocks raw [N, row_bytes] of type qtype (QuantWeight.code)."""
    M = x.shape[0]
    if int8_product(x, qtype, n):
        from qspec.kernels.triton_qdot import qdot_matmul_triton

        return qdot_matmul_triton(x, raw.contiguous(), qtype, n)
    if use_triton(x) and 0 < M <= TC_MAX_ROWS and _kernel_takes(qtype):
        from qspec.kernels.triton_qmatmul import qmatvec_triton, qmm_triton, tensor_cores_for

        x = x if x.stride(1) == 1 else x.contiguous()
        if tensor_cores_for(x, n):
            return qmm_triton(x, raw.contiguous(), qtype, n)
        if M <= MAX_ROWS:
            return qmatvec_triton(x, raw.contiguous(), qtype, n)
    return _chunked(x, raw, qtype, n, k)


@qmatmul_op.register_fake
def _qmatmul_shape(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def qmatmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w^T in x.dtype."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"qmatmul: x {tuple(x.shape)} @ {w!r}^T")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.qspec.qmatmul(x2, w.raw, w.code, w.shape[0], w.shape[1])
    return y.reshape(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("qspec::qmatmul_stacked", mutates_args=())
def qmatmul_stacked_op(x: torch.Tensor, raws: list[torch.Tensor], qtypes: list[int], ns: list[int],
                       k: int) -> torch.Tensor:
    """x [M, K] @ [W_0; W_1; ...]^T -> [M, sum(ns)]: block matrices of several types that multiply the same x. The
    int8 kernels quantize x once for all of them and write each product into its columns; elsewhere each part is
    qmatmul_op's product."""
    M = x.shape[0]
    if 0 < M <= _int8_rows(qtypes, ns) and _int8_for(x, *qtypes):
        from qspec.kernels.triton_qdot import qdot_stacked_triton

        return qdot_stacked_triton(x, [(r.contiguous(), q) for r, q in zip(raws, qtypes, strict=True)])
    return torch.cat([qmatmul_op(x, r, q, n, k) for r, q, n in zip(raws, qtypes, ns, strict=True)], dim=-1)


@qmatmul_stacked_op.register_fake
def _qmatmul_stacked_shape(x: torch.Tensor, raws: list[torch.Tensor], qtypes: list[int], ns: list[int],
                           k: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], sum(ns))


def qmatmul_stacked(x: torch.Tensor, ws: list[QuantWeight]) -> torch.Tensor:
    """y [..., sum N_i] = x [..., K] @ [w_0; w_1; ...]^T in x.dtype: one x, several block matrices (types may
    differ), the columns in the order of ws."""
    if any(w.dim() != 2 or x.shape[-1] != w.shape[1] for w in ws):
        raise ValueError(f"qmatmul_stacked: x {tuple(x.shape)} @ {ws!r}^T")
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.qspec.qmatmul_stacked(x2, [w.raw for w in ws], [w.code for w in ws],
                                        [w.shape[0] for w in ws], x.shape[-1])
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---- routed experts --------------------------------------------------------------------------------------------

def _check_experts(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: QuantWeight, up: QuantWeight,
                   down: QuantWeight) -> None:
    M, D = h.shape
    E, Fd, D2 = gate.shape
    if gate.dim() != 3 or D2 != D or up.shape != gate.shape or down.shape != (E, D, Fd):
        raise ValueError(f"expert shapes: h {tuple(h.shape)} gate {gate!r} up {up!r} down {down!r}")
    if top_i.dim() != 2 or top_i.shape[0] != M or top_w.shape != top_i.shape or top_i.dtype != torch.int64:
        raise ValueError(f"routing: top_i {tuple(top_i.shape)} {top_i.dtype}, top_w {tuple(top_w.shape)}")


def qexpert_ffn_torch(x: torch.Tensor, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> torch.Tensor:
    """Reference: down(silu(gate x) * up x) with the expanded weights, in f32, returned in x.dtype."""
    xf = x.float()
    act = F.silu(xf @ gate.dequantize().t()) * (xf @ up.dequantize().t())
    return (act @ down.dequantize().t()).to(x.dtype)


def qmoe_few_torch(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: QuantWeight, up: QuantWeight,
                   down: QuantWeight) -> torch.Tensor:
    """Reference: each (token, slot) pair's expert expanded and applied in f32, times its weight -> [T, k, D] in
    h.dtype."""
    _check_experts(h, top_i, top_w, gate, up, down)
    out = torch.empty(*top_i.shape, h.shape[1], dtype=h.dtype, device=h.device)
    for t, experts in enumerate(top_i.tolist()):
        for j, e in enumerate(experts):
            y = qexpert_ffn_torch(h[t:t + 1].float(), gate[e], up[e], down[e])
            out[t, j] = (y[0] * top_w[t, j].float()).to(h.dtype)
    return out


def _gathered(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, g: tuple[torch.Tensor, int],
              u: tuple[torch.Tensor, int], d: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The fallback without host syncs: the chosen experts' blocks gathered and expanded to f32, batched products."""
    T_, k = top_i.shape
    idx = top_i.reshape(-1)

    def expand(raw: torch.Tensor, code: int, k_in: int) -> torch.Tensor:
        sel = raw[idx]
        return weight_of(sel, code, k_in).dequantize()

    D = h.shape[1]
    Fd = g[0].shape[1]
    x = h.float().repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, D]
    act = F.silu(torch.bmm(x, expand(*g, D).transpose(1, 2))) * torch.bmm(x, expand(*u, D).transpose(1, 2))
    y = torch.bmm(act, expand(*d, Fd).transpose(1, 2)).view(T_, k, D)
    return (y * top_w.float().unsqueeze(-1)).to(h.dtype)


def int8_experts(h: torch.Tensor, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> bool:
    """Whether `qmoe_few` runs these rows through the int8-activation kernels (which read h quantized)."""
    return _int8_experts(h, gate.raw, gate.code, up.code, down.code)


def _int8_experts(h: torch.Tensor, g_raw: torch.Tensor, g_qt: int, u_qt: int, d_qt: int) -> bool:
    return h.shape[0] <= MOE_MAX_ROWS and g_raw.shape[1] % 32 == 0 and _int8_for(h, g_qt, u_qt, d_qt)


@torch.library.custom_op("qspec::qmoe_few", mutates_args=())
def qmoe_few_op(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, g_raw: torch.Tensor, g_qt: int,
                u_raw: torch.Tensor, u_qt: int, d_raw: torch.Tensor, d_qt: int, hquant: list[torch.Tensor]
                ) -> torch.Tensor:
    """Weighted slot outputs [T, k, D] of the routed experts whose blocks are g_raw/u_raw [E, F, row_bytes] and
    d_raw [E, D, row_bytes]; hquant: h already quantized for the int8 kernels (route.route_top_k_quantized), or
    empty."""
    if _int8_experts(h, g_raw, g_qt, u_qt, d_qt):
        from qspec.kernels.triton_qdot import qdot_moe_few_triton

        return qdot_moe_few_triton(h, top_i, top_w, (g_raw, g_qt), (u_raw, u_qt), (d_raw, d_qt),
                                   hquant=tuple(hquant) or None)
    if (use_triton(h) and h.shape[0] <= MOE_MAX_ROWS and all(_kernel_takes(q) for q in (g_qt, u_qt, d_qt))):
        from qspec.kernels.triton_qmatmul import qmoe_few_triton

        return qmoe_few_triton(h, top_i, top_w, (g_raw, g_qt), (u_raw, u_qt), (d_raw, d_qt))
    return _gathered(h, top_i, top_w, (g_raw, g_qt), (u_raw, u_qt), (d_raw, d_qt))


@qmoe_few_op.register_fake
def _qmoe_few_shape(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, g_raw: torch.Tensor, g_qt: int,
                    u_raw: torch.Tensor, u_qt: int, d_raw: torch.Tensor, d_qt: int, hquant: list[torch.Tensor]
                    ) -> torch.Tensor:
    return h.new_empty(top_i.shape[0], top_i.shape[1], h.shape[1])


def qmoe_few(h: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate: QuantWeight, up: QuantWeight,
             down: QuantWeight, hquant: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """top_w[t, j] * down_e(silu(gate_e h_t) * up_e h_t), e = top_i[t, j]: the weighted slot outputs [T, k, D] in
    h.dtype, as moe_few.moe_slots returns them for 16-bit weights (sum them with moe_few.sum_slots). h [T, D];
    top_i [T, k] int64; top_w [T, k]; gate/up [E, F, D], down [E, D, F] as QuantWeights. Computed in f32 and rounded
    once (the intermediate silu(g) * u stays f32), so it matches `qmoe_few_torch` up to f32 summation order.
    hquant: h quantized already (where `int8_experts` holds; route.route_top_k_quantized), read instead of
    quantizing h again."""
    _check_experts(h, top_i, top_w, gate, up, down)
    return torch.ops.qspec.qmoe_few(h, top_i, top_w, gate.raw, gate.code, up.raw, up.code, down.raw, down.code,
                                    list(hquant or ()))
