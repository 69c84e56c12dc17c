"""Masked attention in Triton, flash-decoding: grid (T / RP, Hkv, chunks) then grid (T, H, feature slices).

The first kernel's program holds, for RP consecutive rows, the G query heads that share kv head h as an [RP * GP, DP]
tile (each row's heads padded to GP) and walks its chunk of cells BLOCK_N at a time: each row's mask bits, the K and V
rows, loaded once for the RP rows (q8_0 scaled in registers), an online softmax (running max m, sum l, f32
accumulator acc). The second kernel combines a row's chunks for one head, a slice of its features a program:
out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, with M the largest m_s (a chunk without a valid cell has
m_s = -inf and weighs nothing).

For 16-bit q the two products run on tensor cores with the operands in q's dtype, as the model's default path does
them (K and V dequantized to that dtype, the probabilities rounded to it before the product with V), f32
accumulation. The first design multiplied f32 tiles in IEEE f32 on the FMA units: on the H200 it was several times
slower for one row over a 4,608-cell q8_0 bucket than the default path
(benchmarks/results/gpu_kernels_masked_attn_h200_s10_first.txt; its [16, 256] and [32, 256] f32 tiles cannot live in
registers). f32 q keeps IEEE f32 products (tests and the f32 model).
"""

import torch

from qspec.kernels.triton_common import HAS_TRITON, INTERPRET, next_pow2, pdl_launch, tl_dtype

BLOCK_N = 32  # cells per inner step
TARGET_PROGRAMS = 264  # two per H200 SM: split the cells into chunks until the grid reaches this
COMBINE_TILE = 4096  # f32 elements of the accumulators a combine program loads at once (its chunks x its features)
# (rows per program RP, cells per step, warps, pipeline stages, programs wanted), for one-row steps (decode, draft)
# and for a few rows (verify). `python -m qspec.bench.kernels --attention-sweep` times the alternatives
# (BENCHMARKS.md §5, the masked attention row): for six rows, four rows per program (K and V read and dequantized once
# for four rows, the products on Hopper's wgmma) beat one row per program. For one row, since the q8_0 scales and the
# mask are loaded once per block and row, 64-cell steps in up to 264 programs (at 4,608 cells 144 of one step each)
# and 4 warps beat the earlier kernel's (1, 32, 8, 3, 132) on an H100, on a causal row and on a QSA row alike
# (benchmarks/results/masked_attention_h100-8a98c16.txt).
ONE_ROW_CONFIG = (1, 2 * BLOCK_N, 4, 1, TARGET_PROGRAMS)
FEW_ROWS_CONFIG = (4, BLOCK_N, 4, 1, TARGET_PROGRAMS)
# Calls of at least this many rows (prefill chunks) skip the cell steps none of a program's rows attends to: a
# chunk's rows see no cell past their own positions, and past the QSA budget only their chosen blocks. A skipped
# step would leave (m, l, acc) exactly as they were, so the output is the same bits. Decode and verify steps keep
# the loop without the branch they were measured with (BENCHMARKS.md §5).
SKIP_MIN_ROWS = 16

if HAS_TRITON:
    import triton
    import triton.language as tl

    from qspec.kernels.triton_common import dot_acc, pdl_start, table_pointer

    @triton.jit
    def _scaled_q8(x, s_ptr, cell, load_ok, h, s_c, s_h, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
        """q8_0 cells x [BN, DP] (int8) times their blocks' f16 scales, in f32: each cell's D / 32 scales loaded once
        and spread over their 32 elements in registers. (A scale loaded per element, as an [BN, DP] gather, made the
        one-row kernel bound by L1 traffic: 86% of its sectors excess, Nsight Compute on an H100, BENCHMARKS.md §5.)"""
        b = tl.arange(0, DP // 32)
        sc = tl.load(s_ptr + cell[:, None] * s_c + h * s_h + b[None, :], mask=load_ok[:, None] & (b < D // 32)[None, :],
                     other=0.0).to(tl.float32)
        return tl.reshape(tl.reshape(x.to(tl.float32), (BN, DP // 32, 32)) * sc[:, :, None], (BN, DP))

    @triton.jit
    def online_step(q, cell, load_ok, valid, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, h, k_c, k_h, s_c, s_h,
                    scale, GP: tl.constexpr, DP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, Q8: tl.constexpr,
                    DT: tl.constexpr, UPCAST: tl.constexpr):
        """One online-softmax step of the query rows q [GP, DP] over BN cells of kv head h -> the updated (m_i, l_i,
        acc). cell [BN] int64; load_ok [BN]: the cells to read; valid [GP, BN] (or [1, BN] for all rows): the cells
        each query row attends to. Shared with triton_sparse_attention."""
        dd = tl.arange(0, DP)
        lm = load_ok[:, None] & (dd < D)[None, :]
        K = tl.load(k_ptr + cell[:, None] * k_c + h * k_h + dd[None, :], mask=lm, other=0.0)
        V = tl.load(v_ptr + cell[:, None] * k_c + h * k_h + dd[None, :], mask=lm, other=0.0)
        if Q8:  # int8 * f16 scale in f32, rounded once to q's dtype (as dequant_q8_0 does)
            K = _scaled_q8(K, ks_ptr, cell, load_ok, h, s_c, s_h, D, DP, BN).to(DT)
            V = _scaled_q8(V, vs_ptr, cell, load_ok, h, s_c, s_h, D, DP, BN).to(DT)
        else:
            K, V = K.to(DT), V.to(DT)
        zero = tl.zeros([GP, BN], dtype=tl.float32)
        if DT == tl.float32:
            sc = tl.dot(q, tl.trans(K), zero, input_precision="ieee")
        else:
            sc = dot_acc(q, tl.trans(K), zero, UPCAST)
        sc = tl.where(valid, sc * scale, float("-inf"))  # [GP, BN]
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid cell so far
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[:, None])
        if DT == tl.float32:
            pv = tl.dot(p, V, tl.zeros([GP, DP], dtype=tl.float32), input_precision="ieee")
        else:
            pv = dot_acc(p.to(DT), V, tl.zeros([GP, DP], dtype=tl.float32), UPCAST)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv

    @triton.jit
    def query_rows(t0, T, G: tl.constexpr, GP: tl.constexpr, RP: tl.constexpr):
        """The RP * GP query rows of a program whose first row is t0: (row t, head within the group g, in use)."""
        r = tl.arange(0, RP * GP)
        t = t0 + r // GP
        g = r % GP
        return t, g, (g < G) & (t < T)

    @triton.jit
    def start_heads(q_ptr, t0, T, h, q_t, q_h, G: tl.constexpr, GP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
                    DP: tl.constexpr):
        """The G query heads that share kv head h, of rows t0 .. t0 + RP - 1 (those below T), as an [RP * GP, DP]
        tile, and an empty online softmax (m, l, acc)."""
        t, g, used = query_rows(t0, T, G, GP, RP)
        dd = tl.arange(0, DP)
        q = tl.load(q_ptr + t[:, None] * q_t + (h * G + g)[:, None] * q_h + dd[None, :],
                    mask=used[:, None] & (dd < D)[None, :], other=0.0)
        return (q, tl.full([RP * GP], float("-inf"), dtype=tl.float32), tl.zeros([RP * GP], dtype=tl.float32),
                tl.zeros([RP * GP, DP], dtype=tl.float32))

    @triton.jit
    def store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, t0, T, h, s, a_t, a_h, a_s, ml_t, ml_h, G: tl.constexpr,
                       GP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """A program's chunk result for rows t0 .. t0 + RP - 1, kv head h, chunk s, in combine_chunks' layout."""
        t, g, used = query_rows(t0, T, G, GP, RP)
        dd = tl.arange(0, DP)
        heads = h * G + g
        tl.store(acc_ptr + t[:, None] * a_t + heads[:, None] * a_h + s * a_s + dd[None, :], acc,
                 mask=used[:, None] & (dd < D)[None, :])
        tl.store(m_ptr + t * ml_t + heads * ml_h + s, m_i, mask=used)
        tl.store(l_ptr + t * ml_t + heads * ml_h + s, l_i, mask=used)

    @triton.jit(do_not_specialize=["splits"])  # the chunk count follows the KV bucket (with SEQS)
    def _masked_attn_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr, T, N, CHUNK, scale,
                            q_t, q_h, k_c, k_h, s_c, s_h, mk_t, a_t, a_h, a_s, ml_t, ml_h, splits,
                            G: tl.constexpr, GP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            BN: tl.constexpr, STAGES: tl.constexpr, Q8: tl.constexpr, DT: tl.constexpr,
                            UPCAST: tl.constexpr, SKIP: tl.constexpr = False, SEQS: tl.constexpr = False,
                            KDT: tl.constexpr = tl.int8, PDL: tl.constexpr = False):
        pdl_start(PDL)
        t0 = tl.program_id(0) * RP
        h = tl.program_id(1)
        s = tl.program_id(2)
        if SEQS:  # program_id(2) = sequence * splits + chunk; T rows a sequence, its cache through address tables
            seq = s // splits
            s = s % splits
            k_ptr = table_pointer(k_ptr, seq, KDT)
            v_ptr = table_pointer(v_ptr, seq, KDT)
            if Q8:
                ks_ptr = table_pointer(ks_ptr, seq, tl.float16)
                vs_ptr = table_pointer(vs_ptr, seq, tl.float16)
            row0 = (seq * T).to(tl.int64)
            q_ptr += row0 * q_t
            mask_ptr += row0 * mk_t
            acc_ptr += row0 * a_t
            m_ptr += row0 * ml_t
            l_ptr += row0 * ml_t
        q, m_i, l_i, acc = start_heads(q_ptr, t0, T, h, q_t, q_h, G, GP, RP, D, DP)
        tr = t0 + tl.arange(0, RP)  # the program's rows: one mask row each, shared by the row's heads
        for j0 in tl.range(s * CHUNK, s * CHUNK + CHUNK, BN, num_stages=STAGES):
            j = j0 + tl.arange(0, BN)
            bits = tl.load(mask_ptr + tr[:, None] * mk_t + j[None, :], mask=(tr < T)[:, None] & (j < N)[None, :],
                           other=0) != 0  # [RP, BN]
            load_ok = tl.max(bits.to(tl.int32), axis=0) > 0  # a cell some row attends to
            # each row's bits for its GP head rows (padding heads compute on zero q and are not stored)
            valid = bits if RP == 1 else tl.reshape(tl.broadcast_to(bits[:, None, :], (RP, GP, BN)), (RP * GP, BN))
            run = True  # a compile-time True without SKIP: the loop has no branch
            if SKIP:
                run = tl.max(load_ok.to(tl.int32), axis=0) > 0
            if run:
                m_i, l_i, acc = online_step(q, j.to(tl.int64), load_ok, valid, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr,
                                            vs_ptr, h, k_c, k_h, s_c, s_h, scale, RP * GP, DP, D, BN, Q8, DT, UPCAST)
        store_partials(acc, m_i, l_i, acc_ptr, m_ptr, l_ptr, t0, T, h, s, a_t, a_h, a_s, ml_t, ml_h, G, GP, RP, D, DP)

    @triton.jit(do_not_specialize=["S"])  # the chunk count follows the KV bucket: one compiled kernel for all
    def _combine_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, S, a_t, a_h, a_s, ml_t, ml_h, o_t, o_h,
                        D: tl.constexpr, DB: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
        # program (row, head, DB features): every chunk's m, l and accumulator slice loaded at once (one round of
        # loads, where a walk over the chunks waited on each step's)
        pdl_start(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        ss = tl.arange(0, SP)
        sm = ss < S
        m = tl.load(m_ptr + t * ml_t + h * ml_h + ss, mask=sm, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.max(m, axis=0)))
        den = tl.sum(w * tl.load(l_ptr + t * ml_t + h * ml_h + ss, mask=sm, other=0.0), axis=0)
        dd = tl.program_id(2) * DB + tl.arange(0, DB)
        dm = dd < D
        a = tl.load(acc_ptr + t * a_t + h * a_h + ss[:, None] * a_s + dd[None, :], mask=sm[:, None] & dm[None, :],
                    other=0.0)
        out = tl.sum(a * w[:, None], axis=0) / den
        tl.store(o_ptr + t * o_t + h * o_h + dd, out.to(o_ptr.dtype.element_ty), mask=dm)


def plan_chunks(T: int, Hkv: int, n: int, block_n: int = BLOCK_N, target: int = TARGET_PROGRAMS, rp: int = 1
                ) -> tuple[int, int]:
    """(cells per chunk, chunks): enough chunks to fill the GPU (programs of rp rows), each a whole number of
    block_n-cell steps."""
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)
    splits = max(1, min(cdiv(n, block_n), max_chunks(T, Hkv, target, rp)))
    chunk = cdiv(cdiv(n, splits), block_n) * block_n
    return chunk, cdiv(n, chunk)


def max_chunks(T: int, Hkv: int, target: int = TARGET_PROGRAMS, rp: int = 1) -> int:
    """The most chunks plan_chunks gives T rows, whatever the number of cells."""
    return max(1, -(-target // max(1, -(-T // rp) * Hkv)))


def new_partials(T: int, H: int, chunks: int, d: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffers for per-chunk partial results (acc [T, H, S, d], m and l [T, H, S], f32) with room for `chunks`,
    padded to a multiple of 16. Sized by the most chunks a step's rows can have, not by the chunks of this call,
    their strides stay the same in every KV bucket: Triton specializes integer arguments on their divisibility by
    16, so a stride that followed the bucket compiled the kernels again when a request crossed into the next one.
    One chunk (a prefill chunk's rows fill the GPU alone) is not padded: at 4,096 rows of 24 heads of 256 a padded
    acc would take 1.6 GB, for as long as the call runs."""
    S = chunks if chunks == 1 else -(-chunks // 16) * 16
    m = torch.empty(T, H, S, dtype=torch.float32, device=device)
    return torch.empty(T, H, S, d, dtype=torch.float32, device=device), m, torch.empty_like(m)


def masked_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None,
                            v_scale: torch.Tensor | None, mask: torch.Tensor,
                            config: tuple[int, int, int, int, int] | None = None, skip: bool | None = None
                            ) -> torch.Tensor:
    """Launch both kernels; arguments as `masked_attention` (already checked). config: (rows per program (a power of
    two), cells per step, warps, pipeline stages, programs wanted); default ONE_ROW_CONFIG or FEW_ROWS_CONFIG.
    skip: leave out the cell steps no row of a program attends to (default: from SKIP_MIN_ROWS rows on)."""
    T, H, d = q.shape
    rp, block_n, warps, stages, target = config or (ONE_ROW_CONFIG if T == 1 else FEW_ROWS_CONFIG)
    if rp < 1 or rp & (rp - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"masked attention config {config}: rows per program and cells per step must be powers of "
                         "two (cells per step >= 16)")
    n, Hkv = k.shape[0], k.shape[1]
    G = H // Hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()  # a broadcast mask has stride 0
    for name, x in (("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"masked attention: {name} needs a contiguous last dim")
    q8 = k_scale is not None
    if k.stride() != v.stride() or (q8 and (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1)):
        raise ValueError("masked attention: k and v (and their scales) need the same layout")
    chunk, splits = plan_chunks(T, Hkv, n, block_n, target, rp)
    acc, m, lsum = new_partials(T, H, max_chunks(T, Hkv, target, rp), d, q.device)
    ks = k_scale if q8 else k  # unused pointers when not q8_0
    vs = v_scale if q8 else v
    DP = max(16, next_pow2(d))
    _masked_attn_kernel[(-(-T // rp), Hkv, splits)](
        q, k, v, ks, vs, mask.view(torch.uint8), acc, m, lsum, T, n, chunk, d ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), ks.stride(0) if q8 else 0, ks.stride(1) if q8 else 0,
        mask.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), 1,
        G=G, GP=max(16, next_pow2(G)), RP=rp, D=d, DP=DP, BN=block_n, STAGES=stages, Q8=q8, DT=tl_dtype(q.dtype),
        UPCAST=INTERPRET, SKIP=T >= SKIP_MIN_ROWS if skip is None else skip, num_warps=warps, **pdl_launch(q))
    return combine_chunks(acc, m, lsum, splits, q.dtype)


def masked_attention_seqs_triton(q: torch.Tensor, cache: tuple[torch.Tensor, ...], tables: tuple[torch.Tensor, ...],
                                 n: int, mask: torch.Tensor, alone: bool = True) -> torch.Tensor:
    """`masked_attention_triton` for B sequences in one pair of launches: rows b T .. (b + 1) T - 1 of q [B T, H, d]
    and mask [B T, n] attend over the first n cells of sequence b's cache. cache: sequence 0's KVCache.buffers() (k,
    v and for q8_0 their scales; every sequence's share its layout); tables: int64 [B] device tensors of every
    sequence's addresses of those buffers (state/tables.SequenceTables).

    alone: each sequence's cells in the chunks its rows would have alone, so each sequence's output has the bits of
    its own masked_attention_triton (the same sums in the same order; row-exact mode), at B times the programs and
    partial results of one sequence. Otherwise the chunks are planned for all the rows together, as for one call of
    B T rows: about TARGET_PROGRAMS programs whatever B."""
    rows_all, H, d = q.shape
    B = tables[0].shape[0]
    T, rem = divmod(rows_all, B)
    k, v = cache[:2]
    q8 = len(cache) == 4
    if (rem or T < 1 or len(tables) != len(cache) or any(t.shape != (B,) or t.dtype != torch.int64 for t in tables)
            or mask.shape != (rows_all, n) or mask.dtype != torch.bool or not 0 < n <= k.shape[0]
            or k.stride() != v.stride() or k.stride(-1) != 1 or (q8 and cache[2].stride() != cache[3].stride())):
        raise ValueError(f"masked attention of {B} sequences: q {tuple(q.shape)}, mask {tuple(mask.shape)} "
                         f"{mask.dtype} over {n} of {k.shape[0]} cells, {len(cache)} cache buffers and tables")
    rp, block_n, warps, stages, target = ONE_ROW_CONFIG if T == 1 else FEW_ROWS_CONFIG
    Hkv = k.shape[1]
    plan_rows = T if alone else rows_all
    chunk, splits = plan_chunks(plan_rows, Hkv, n, block_n, target, rp)
    acc, m, lsum = new_partials(rows_all, H, max_chunks(plan_rows, Hkv, target, rp), d, q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    ks, vs = (tables[2], tables[3]) if q8 else (tables[0], tables[1])  # unread without q8_0
    _masked_attn_kernel[(-(-T // rp), Hkv, B * splits)](
        q, tables[0], tables[1], ks, vs, mask.view(torch.uint8), acc, m, lsum, T, n, chunk, d ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache[2].stride(0) if q8 else 0,
        cache[2].stride(1) if q8 else 0, mask.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
        m.stride(1), splits, G=H // Hkv, GP=max(16, next_pow2(H // Hkv)), RP=rp, D=d, DP=max(16, next_pow2(d)),
        BN=block_n, STAGES=stages, Q8=q8, DT=tl_dtype(q.dtype), UPCAST=INTERPRET, SKIP=False, num_warps=warps,
        SEQS=True, KDT=tl.int8 if q8 else tl_dtype(k.dtype), **pdl_launch(q))
    return combine_chunks(acc, m, lsum, splits, q.dtype)


def combine_chunks(acc: torch.Tensor, m: torch.Tensor, lsum: torch.Tensor, splits: int, dtype: torch.dtype
                   ) -> torch.Tensor:
    """The flash-decoding combine of the first `splits` per-chunk partial results in acc [T, H, S, d] f32 and m, l
    [T, H, S] (new_partials' layout, written by this module's and triton_sparse_attention's first kernels) ->
    [T, H, d] in dtype, one launch."""
    T, H, S, d = acc.shape
    if not 1 <= splits <= S:
        raise ValueError(f"combine: {splits} chunks do not fit buffers of {S}")
    out = torch.empty(T, H, d, dtype=dtype, device=acc.device)
    sp = max(2, next_pow2(S))
    db = min(max(16, next_pow2(d)), max(16, COMBINE_TILE // sp))
    _combine_kernel[(T, H, -(-d // db))](acc, m, lsum, out, splits, acc.stride(0), acc.stride(1), acc.stride(2),
                                         m.stride(0), m.stride(1), out.stride(0), out.stride(1), D=d, DB=db, SP=sp,
                                         num_warps=4, **pdl_launch(acc))
    return out
