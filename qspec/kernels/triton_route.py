"""MoE routing in Triton: one program per token, grid (T,); with the token rows h to quantize for the routed experts'
int8 kernels, grid (T, 1 + chunks): programs (t, 1..) quantize row t of h (triton_qdot.quant_x_blocks) beside the
routing, in the same launch (the quantizer's own launch would wait for the routing in the step's stream).

The routing program loads the token's E logits (E padded to a power of two with -inf), takes the f32
softmax, then k times picks the largest probability (the lowest expert id among equals), records it
and masks it out. The k picked probabilities are renormalised by their f32 sum and stored in the
logits' dtype, with the ids as int64: `route_top_k_torch`'s outputs, best expert first, up to f32
rounding of exp and of the sums.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch, tl_dtype

# warps of a program up to 1,024 experts (twice that above): one warp's picks would be shuffles alone, but four were
# faster than one or two at 512 experts, top 10, with the quantization beside them (BENCHMARKS.md §5c)
ROUTE_WARPS = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, round_to
    from qspec.kernels.triton_qdot import quant_x_blocks

    @triton.jit
    def _route_row(x_ptr, w_ptr, i_ptr, E, t, x_t, w_t, i_t, K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                   DT: tl.constexpr, SHARED: tl.constexpr):
        """Token t's softmax over its E logits, top K, renormalised (the module docstring); SHARED: slot K holds
        expert id E with weight sigmoid(logit E), the shared expert's gate."""
        e = tl.arange(0, BE)
        x = tl.load(x_ptr + t * x_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)  # padding lanes hold exactly 0
        p = tl.where(e < E, p, -1.0)  # never picked, even when real probabilities underflow to 0
        # one int64 key per expert, its probability's bits above BE - 1 - id: non-negative f32 order as their bits
        # do, so one max picks the largest probability and the lowest id among equals (a reduction a pick, not
        # a max and then a min)
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BE - 1 - e)
        slot = tl.arange(0, BK)
        top_w = tl.zeros([BK], dtype=tl.float32)
        top_i = tl.zeros([BK], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            idx = BE - 1 - best.to(tl.int32)  # the low 32 bits
            top_w = tl.where(slot == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
            top_i = tl.where(slot == j, idx, top_i)
            key = tl.where(e == idx, -(1 << 62), key)
        top_w = top_w / tl.sum(top_w, axis=0)  # unused slots hold 0
        kmask = slot < K
        if SHARED:
            gate = tl.load(x_ptr + t * x_t + E + slot * 0).to(tl.float32)
            top_w = tl.where(slot == K, 1.0 / (1.0 + tl.exp(-gate)), top_w)
            top_i = tl.where(slot == K, E, top_i)
            kmask = slot <= K
        tl.store(w_ptr + t * w_t + slot, round_to(top_w, DT).to(w_ptr.dtype.element_ty), mask=kmask)
        tl.store(i_ptr + t * i_t + slot, top_i.to(tl.int64), mask=kmask)

    @triton.jit
    def _route_kernel(x_ptr, w_ptr, i_ptr, E, x_t, w_t, i_t, h_ptr, q_ptr, d_ptr, s_ptr, g_ptr, h_t, KB,
                      K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, BB: tl.constexpr = 32,
                      SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (token t, 0): its routing; (t, c > 0): chunk c - 1 of h's row t quantized."""
        pdl_start(PDL)
        t = tl.program_id(0)
        if tl.program_id(1) > 0:
            quant_x_blocks(h_ptr, q_ptr, d_ptr, s_ptr, g_ptr, t, tl.program_id(1) - 1, h_t, KB, BB)
        else:
            _route_row(x_ptr, w_ptr, i_ptr, E, t, x_t, w_t, i_t, K, BE, BK, DT, SHARED)


def route_top_k_triton(logits: torch.Tensor, k: int, h: torch.Tensor | None = None, shared: bool = False,
                       warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """logits [T, E] with a contiguous last dim (checked by `route_top_k`) -> (weights [T, k], ids [T, k], h [T, D]
    quantized as triton_qdot.quantize_x_triton returns it, or None without h); h: 16-bit rows, D a multiple of 32,
    contiguous rows. shared: logits [T, E + 1], the last column the shared expert's gate logit, and k + 1 slots out
    (route.route_top_k_shared_torch). warps: per program (the bench's variants; by default ROUTE_WARPS)."""
    from qspec.kernels.triton_qdot import quant_chunk, quantized_x_buffers

    T, E = logits.shape
    E -= shared
    top_w = torch.empty(T, k + shared, dtype=logits.dtype, device=logits.device)
    top_i = torch.empty(T, k + shared, dtype=torch.int64, device=logits.device)
    if h is not None and (h.shape[0] != T or h.shape[1] % 32 or h.stride(1) != 1):
        raise ValueError(f"route and quantize: logits {tuple(logits.shape)}, h {tuple(h.shape)} stride {h.stride()}")
    D = 0 if h is None else h.shape[1]
    q, d, s, g = quantized_x_buffers(T, D, logits.device) if h is not None else (top_w,) * 4
    bb = quant_chunk(D)
    if T:
        BE = next_pow2(E)
        _route_kernel[(T, 1 + triton.cdiv(D // 32, bb))](
            logits, top_w, top_i, E, logits.stride(0), top_w.stride(0), top_i.stride(0),
            logits if h is None else h, q, d, s, g, D if h is None else h.stride(0), D // 32,
            K=k, BE=BE, BK=next_pow2(k + shared), DT=tl_dtype(logits.dtype), BB=bb, SHARED=shared,
            num_warps=warps or (ROUTE_WARPS if BE <= 1024 else 2 * ROUTE_WARPS),
            enable_fp_fusion=h is None, **pdl_launch(logits))
    return top_w, top_i, None if h is None else (q.view(torch.int32), d, s, g)
