"""Cache writes in Triton. The q8_0 KV write: one program per (row, kv head) quantizes that head's K and V rows and
stores values and scales at the row's cell. The row write of several sequences (a batched step's raw indexer keys):
one program per row copies it to its cell of its sequence's buffer.

Bit-identical to kv_write.quantize_q8_0_torch: the scale is amax / 127 and its inverse 1 / scale, both IEEE
divisions; the product is rounded half to even by adding and subtracting 1.5 * 2^23 (|x * inv| <= 127 + a rounding,
far below 2^22), launched without fp fusion so that the multiply and the add round separately, as torch's do.
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, next_pow2, pdl_launch, tl_dtype

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import pdl_start, round_to, table_pointer

    @triton.jit
    def _quantize_row(x):
        """x [NB, 32] f32 -> (int8 values [NB, 32], f16 scales [NB])."""
        amax = tl.max(tl.abs(x), axis=1)
        d = tl.math.div_rn(amax, tl.zeros_like(amax) + 127.0)
        inv = tl.where(d > 0, tl.math.div_rn(tl.zeros_like(d) + 1.0, tl.where(d > 0, d, 1.0)), 0.0)
        y = x * inv[:, None]
        r = (y + 12582912.0) - 12582912.0  # round half to even
        q = tl.minimum(tl.maximum(r, -127.0), 127.0)
        return q.to(tl.int8), d.to(tl.float16)

    @triton.jit
    def _write_q8_0_kernel(kq_ptr, vq_ptr, ks_ptr, vs_ptr, pos_ptr, k_ptr, v_ptr, k_t, k_h, v_t, v_h, c_c, c_h,
                           s_c, s_h, rows, NB: tl.constexpr, NBP: tl.constexpr, SEQS: tl.constexpr = False,
                           PDL: tl.constexpr = False):
        pdl_start(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        if SEQS:  # sequence program_id(2), `rows` rows each; kq_ptr .. vs_ptr are tables of its caches' addresses
            seq = tl.program_id(2)
            kq_ptr = table_pointer(kq_ptr, seq, tl.int8)
            vq_ptr = table_pointer(vq_ptr, seq, tl.int8)
            ks_ptr = table_pointer(ks_ptr, seq, tl.float16)
            vs_ptr = table_pointer(vs_ptr, seq, tl.float16)
            t += seq * rows
        b = tl.arange(0, NBP)
        i = tl.arange(0, 32)
        bm = b < NB
        off = b[:, None] * 32 + i[None, :]
        cell = tl.load(pos_ptr + t).to(tl.int64)
        x = tl.load(k_ptr + t * k_t + h * k_h + off, mask=bm[:, None], other=0.0).to(tl.float32)
        q, d = _quantize_row(x)
        tl.store(kq_ptr + cell * c_c + h * c_h + off, q, mask=bm[:, None])
        tl.store(ks_ptr + cell * s_c + h * s_h + b, d, mask=bm)
        x = tl.load(v_ptr + t * v_t + h * v_h + off, mask=bm[:, None], other=0.0).to(tl.float32)
        q, d = _quantize_row(x)
        tl.store(vq_ptr + cell * c_c + h * c_h + off, q, mask=bm[:, None])
        tl.store(vs_ptr + cell * s_c + h * s_h + b, d, mask=bm)


    @triton.jit
    def _write_rows_seqs_kernel(dst_ptr, pos_ptr, src_ptr, src_t, dst_t, rows, D: tl.constexpr, DP: tl.constexpr,
                                DT: tl.constexpr, PDL: tl.constexpr = False):
        # program (row t, sequence b): row b rows + t of src to its cell of sequence b's buffer, rounded to DT as
        # torch's cast rounds (round_to: the interpreter's own cast truncates)
        pdl_start(PDL)
        seq = tl.program_id(1)
        t = (seq * rows + tl.program_id(0)).to(tl.int64)
        dst = table_pointer(dst_ptr, seq, DT)
        cell = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, DP)
        x = tl.load(src_ptr + t * src_t + i, mask=i < D, other=0.0).to(tl.float32)
        tl.store(dst + cell * dst_t + i, round_to(x, DT).to(DT), mask=i < D)


def write_rows_seqs_triton(like: torch.Tensor, table: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
    """Rows b T .. (b + 1) T - 1 of src [B T, D] (T = rows / B) to cells pos[those rows] of sequence b's buffer
    [cells, D], in one launch. like: sequence 0's buffer (every one shares its dtype and layout, contiguous); table:
    int64 [B] device tensor of every sequence's buffer address (state/tables.SequenceTables)."""
    B = table.shape[0]
    rows, rem = divmod(src.shape[0], B)
    if (rem or rows < 1 or table.shape != (B,) or table.dtype != torch.int64 or not like.is_contiguous()
            or like.dim() != 2 or src.dim() != 2 or src.shape[1] != like.shape[1] or src.stride(1) != 1
            or pos.shape != (src.shape[0],)):
        raise ValueError(f"row write of {B} sequences: src {tuple(src.shape)}, pos {tuple(pos.shape)}, buffers "
                         f"{tuple(like.shape)}, a table of {B} addresses")
    D = like.shape[1]
    _write_rows_seqs_kernel[(rows, B)](table, pos, src, src.stride(0), like.stride(0), rows, D=D, DP=next_pow2(D),
                                       DT=tl_dtype(like.dtype), num_warps=1, **pdl_launch(src))


def write_q8_0_triton(kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, pos: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> None:
    """Arguments as kv_write.write_q8_0 (checked there; the cache tensors contiguous, k and v rows contiguous)."""
    T, Hkv, d = k.shape
    _write_q8_0_kernel[(T, Hkv)](kq, vq, ks, vs, pos, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 kq.stride(0), kq.stride(1), ks.stride(0), ks.stride(1), 0, NB=d // 32,
                                 NBP=max(2, next_pow2(d // 32)), num_warps=2, enable_fp_fusion=False, **pdl_launch(kq))


def write_q8_0_seqs_triton(cache: tuple[torch.Tensor, ...], tables: tuple[torch.Tensor, ...], pos: torch.Tensor,
                           k: torch.Tensor, v: torch.Tensor) -> None:
    """`write_q8_0_triton` for B sequences in one launch: rows b T .. (b + 1) T - 1 of k, v and pos (T = rows / B)
    to sequence b's cache. cache: sequence 0's (kq, vq, ks, vs), whose layout every one shares (contiguous); tables:
    int64 [B] device tensors of every sequence's kq, vq, ks and vs addresses (state/tables.SequenceTables)."""
    B = tables[0].shape[0]
    rows, rem = divmod(k.shape[0], B)
    kq, vq, ks, vs = cache
    if rem or rows < 1 or len(tables) != 4 or any(t.shape != (B,) or t.dtype != torch.int64 for t in tables) or \
            not all(t.is_contiguous() for t in cache) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"q8_0 KV write of {B} sequences: {k.shape[0]} rows, 4 tables of {B} addresses, "
                         "contiguous caches and rows")
    Hkv, d = k.shape[1:]
    _write_q8_0_kernel[(rows, Hkv, B)](*tables, pos, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                       kq.stride(0), kq.stride(1), ks.stride(0), ks.stride(1), rows, NB=d // 32,
                                       NBP=max(2, next_pow2(d // 32)), num_warps=2, enable_fp_fusion=False,
                                       SEQS=True, **pdl_launch(k))
