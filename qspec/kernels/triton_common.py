"""What every Triton kernel module shares: whether Triton can be used, and small jit helpers.

Triton is optional: without it (or on the CPU) every dispatch function runs its torch reference.
`QSPEC_TRITON=0` forces the torch references on CUDA too (A/B runs). `TRITON_INTERPRET=1` runs the
kernels on CPU tensors through Triton's interpreter, which is how the CPU tests exercise them.
"""

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: every dispatch falls back to its torch reference
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The kernels were measured, and their references' tolerances set, with FMA contraction on unless a launch passes
# enable_fp_fusion=False: Triton's default through 3.9, which 3.10 turns off. A user's own setting wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _pin_cache_dir() -> None:
    """TRITON_CACHE_DIR set to where Triton keeps its kernels now, unless the user set it. torch.compile's first
    kernel sets it to a directory of its own where it is unset, and Triton reads it at every compilation: a process
    wrote the kernels it compiled before that point and after it to two directories, and a later process, whose point
    fell elsewhere, looked for them in the other one (a second process recompiled kernels of cache keys the first had
    compiled: BENCHMARKS.md §9)."""
    if HAS_TRITON and "TRITON_CACHE_DIR" not in os.environ:
        knobs = getattr(triton, "knobs", None)  # Triton 3.4 and later
        if knobs is not None:
            os.environ["TRITON_CACHE_DIR"] = str(knobs.cache.dir)


_pin_cache_dir()


_REFERENCES_ONLY = False
# dp4a's PTX: $0 <- $3 + the dot product of $1's and $2's four signed bytes (tests/test_ptx_text.py checks the text
# against the interpreter's byte-by-byte sum)
DP4A_PTX = "dp4a.s32.s32 $0, $1, $2, $3;"


def triton_enabled() -> bool:
    return HAS_TRITON and not _REFERENCES_ONLY and os.environ.get("QSPEC_TRITON", "1") != "0"


@contextlib.contextmanager
def module_flag(module: str, name: str, value: object) -> Iterator[None]:
    """Module `module`'s global `name` set to `value` inside the block. The kernels' switches are module globals
    rather than arguments: dynamo guards on the globals that compiled code reads, so flipping one recompiles instead
    of misrunning."""
    mod = sys.modules[module]
    old = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, old)


def torch_references() -> contextlib.AbstractContextManager[None]:
    """Every dispatch inside the block runs its torch reference (kernel checks compute their expected values so)."""
    return module_flag(__name__, "_REFERENCES_ONLY", True)


# Programmatic dependent launch (Hopper and later; the engine turns it on with `pdl_mode`, EngineOptions.pdl).
# Inside a CUDA graph a kernel starts only some time after the one before it ends (the idle gaps of BENCHMARKS.md
# §3; §5, the programmatic dependent launch row); with PDL the next kernel is scheduled while the previous one
# still runs and waits in `pdl_start` (griddepcontrol.wait) until that one has finished and its
# writes are visible. Every kernel here waits before it touches memory, so the order of reads and writes is the
# stream's, as without PDL.
_PDL = False


def pdl_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Launch the Triton kernels with programmatic dependent launch inside the block (where the GPU has it)."""
    return module_flag(__name__, "_PDL", on)


def pdl_supported(dev: torch.device) -> bool:
    """Whether kernels launched on `dev` can use PDL: an NVIDIA device of compute capability 9 or more, not the
    interpreter."""
    return not INTERPRET and nvidia_major(dev) >= 9


def nvidia_major(dev: torch.device) -> int:
    """The compute capability's major version of an NVIDIA GPU (9: Hopper, 10: Blackwell); 0 for any other device."""
    return _nvidia_major(dev.index) if dev.type == "cuda" and torch.version.hip is None else 0


@functools.cache
def _nvidia_major(index: int | None) -> int:
    # pdl_on asks at every Triton launch of an eager step: the device's answer does not change
    return torch.cuda.get_device_capability(index)[0]


def pdl_on(t: torch.Tensor) -> bool:
    """Whether a kernel launched for tensors on t's device now uses PDL: switched on, a device that has it, and not
    while dynamo traces (its kernel wrapper takes no launch options)."""
    return _PDL and pdl_supported(t.device) and not torch.compiler.is_compiling()


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel that takes the `PDL` constexpr (and calls `pdl_start(PDL)` first)."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t) else {"PDL": False}


def use_triton(t: torch.Tensor) -> bool:
    """True when the dispatch should launch the Triton kernel for tensors on t's device."""
    return triton_enabled() and (t.is_cuda or INTERPRET)


def tl_dtype(dt: torch.dtype):  # type: ignore[no-untyped-def]
    """The Triton dtype of a torch floating dtype (a constexpr kernel argument)."""
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dt]


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# A block product that splits K (triton_qdot's int8 one, triton_qmatmul's tensor-core one) adds its partial sums in
# its own launch: the program of a row block that finishes last (an atomic arrival count per block) adds the block's
# shares in split order; False: a second launch adds them (A/B runs). The numbers are the same either way. A module
# flag (KernelSwitches: EngineOptions.sums_in_product). The 16-bit products' split sums stay a launch apart: in their
# launch they lost on the few-row 2,560 x 6,144 and 2,560 x 5,120 products (BENCHMARKS.md §5c, tried and removed).
SUM_IN_PRODUCT = True
COUNTER_SLOTS = 1 << 13  # arrival counters per device and stream (row blocks of one split launch, at most)
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def sums_in_product_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, SUM_IN_PRODUCT is `on` (the runner sets it around every step)."""
    return module_flag(__name__, "SUM_IN_PRODUCT", on)


def sums_in_product(blocks: int) -> bool:
    """Whether a launch that splits K over `blocks` row blocks adds its shares itself (`sum_if_last`)."""
    return SUM_IN_PRODUCT and blocks <= COUNTER_SLOTS


def arrival_counters(y: torch.Tensor) -> torch.Tensor:
    """The zeroed int32 arrival counters of a split product launched now on y's device and current stream.

    Invariant: between launches every counter is 0 (each block's last program resets its own), so the launches
    that follow one another on a stream share one buffer; a launch on another stream (the shared expert's side
    stream) may run at the same time, so each stream has its own. Made on a stream's first split product (in a
    CUDA graph's capture, its zeroing is captured too, which a replay repeats harmlessly)."""
    stream = torch.cuda.current_stream(y.device).cuda_stream if y.is_cuda else 0
    key = (y.device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=y.device)
    return _COUNTERS[key]


if HAS_TRITON:
    from gguf import GGMLQuantizationType as _T

    from qspec.weights.qweight import PLANES

    # The block kernels' type numbers (their QT constexpr; qweight.code): GGML's for rows in the file's order,
    # PLANES + GGML's for rows held in planes. Constexprs, so each `QT == QT_Q4_K` is decided when a kernel compiles.
    QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q4_K, QT_Q5_K, QT_Q6_K = (
        tl.constexpr(int(t)) for t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K))
    QT_PLANES = tl.constexpr(PLANES)
    QT_Q4_0_PLANES, QT_Q5_0_PLANES, QT_Q8_0_PLANES, QT_Q6_K_PLANES = (
        tl.constexpr(PLANES + int(t)) for t in (_T.Q4_0, _T.Q5_0, _T.Q8_0, _T.Q6_K))
    _DP4A_PTX = tl.constexpr(DP4A_PTX)

    @triton.jit
    def round_to(x, DT: tl.constexpr):
        """Round f32 `x` to dtype DT and back (torch's per-op rounding for a DT tensor).

        bf16 uses integer round-to-nearest-even instead of a cast: identical to the GPU's cvt.rn for
        finite values, and the interpreter's cast truncates, so this keeps the CPU tests exact too."""
        if DT == tl.bfloat16:
            b = x.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            y = b.to(tl.float32, bitcast=True)
        elif DT == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, wait until the kernel before it has finished (its writes visible),
        then let the next kernel be scheduled. Without PDL, nothing."""
        if PDL:  # (the branch is compiled only when PDL is set, so other backends never meet tl.extra.cuda)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def table_pointer(table_ptr, seq, DT: tl.constexpr, ALIGNED: tl.constexpr = True):
        """Sequence seq's buffer address in an address table (state/tables.SequenceTables), as a pointer to DT.
        ALIGNED: declared 16-byte aligned (the tables check it for every cache buffer). An address loaded from memory
        is otherwise assumed unaligned, and every load through it is compiled one element at a time: an int8 K row
        as 256 byte loads, not 16-byte vectors (the PTX of the attention kernel compiled for sm_90)."""
        p = tl.load(table_ptr + seq).to(tl.pointer_type(DT))
        if ALIGNED:
            p = tl.multiple_of(p, 16)
        return p

    @triton.jit
    def dot_acc(a, b, acc, UPCAST: tl.constexpr):
        """acc + a @ b for 16-bit tiles on tensor cores. UPCAST (set under the CPU interpreter, which multiplies
        bf16 tiles wrongly): the same product from exact f32 copies."""
        if UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc)
        return out

    @triton.jit
    def sum_if_last(part, c_ptr, out, mask, S, p_s, OUT_DT: tl.constexpr):
        """Count this split's arrival at c_ptr[0]; the last of the S adds the partial sums part[s * p_s] in split
        order (as a separate sum launch would) into out and sets the counter back to 0 for the next launch. Every
        thread's partial-sum stores happen before the count (barrier, then a release), and the last program's loads
        after it (acquire; .cg reads L2, where the other SMs' stores are)."""
        tl.debug_barrier()
        if tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu") == S - 1:
            acc = tl.zeros(part.shape, dtype=tl.float32)
            for s in range(0, S):
                acc = acc + tl.load(part + s * p_s, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, round_to(acc, OUT_DT).to(out.dtype.element_ty), mask=mask)
            tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def dp4a(a, b, c, ASM: tl.constexpr):
        """c + the dot product of a's four bytes with b's, both signed int8 (callers' unsigned bytes stay below 128).
        ASM: the PTX instruction; otherwise (the interpreter runs no PTX, and A/B runs) the same sum byte by byte."""
        if ASM:
            return tl.inline_asm_elementwise(_DP4A_PTX, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
        else:
            for k in tl.static_range(4):
                c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
            return c

    @triton.jit
    def round_q8(x):
        """f32 blocks x [B, 32] -> (q = floor(x * (127 / amax) + 0.5) clamped to +-127 as f32, d = amax / 127), with
        IEEE divisions; launched without fp fusion, the torch references' roundings (ggml's q8_1 scheme)."""
        amax = tl.max(tl.abs(x), axis=1)
        inv = tl.where(amax > 0, tl.math.div_rn(tl.zeros_like(amax) + 127.0, tl.where(amax > 0, amax, 1.0)), 0.0)
        q = tl.minimum(tl.maximum(tl.floor(x * inv[:, None] + 0.5), -127.0), 127.0)
        return q, tl.math.div_rn(amax, tl.zeros_like(amax) + 127.0)

    @triton.jit
    def expert_pair(ti_ptr, ti_m, KS, N, BN: tl.constexpr):
        """A routed-expert kernel's program (row block, (token, slot) pair): (pair = t * KS + j, t, j, the pair's
        expert e = top_i[t, j] as int64, this program's BN output rows, which of them exist (< N))."""
        pair = tl.program_id(1)
        t = pair // KS
        j = pair % KS
        e = tl.load(ti_ptr + t * ti_m + j).to(tl.int64)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        return pair, t, j, e, n, n < N

    @triton.jit
    def b32_parts(blk, K, QT: tl.constexpr):
        """Byte offsets inside a row of 32-weight block(s) blk's f16 d, Q5_0's 32-bit qh and qs: in the file's order
        (QT 8, 6, 2: Q8_0's 34-byte blocks d|qs, Q5_0's 22-byte d|qh|qs, Q4_0's 18-byte d|qs) or in planes (QT 108,
        106, 102, qweight.PLANES + the type: every block's qs, then Q5_0's every qh, then every d, each plane
        starting on 16 bytes)."""
        if QT > QT_PLANES:
            nb = K // 32
            qs_size: tl.constexpr = 32 if QT == QT_Q8_0_PLANES else 16
            qs = blk * qs_size
            qh = nb * qs_size + blk * 4
            if QT == QT_Q5_0_PLANES:
                d = nb * qs_size + (nb * 4 + 15) // 16 * 16 + blk * 2
            else:
                d = nb * qs_size + blk * 2
        else:
            size: tl.constexpr = 34 if QT == QT_Q8_0 else (22 if QT == QT_Q5_0 else 18)
            d = blk * size
            qh = d + 2
            qs = d + (6 if QT == QT_Q5_0 else 2)
        return d, qh, qs

    @triton.jit
    def q6_parts(kb, K, QT: tl.constexpr):
        """Byte offsets inside a row of Q6_K super-block kb's ql (128 bytes), qh (64), int8 scales (16) and f16 d:
        in the file's order (QT 14: 210-byte blocks one after another) or in planes (QT 114, qweight.Q6_K_PLANES:
        every block's ql, then every qh, every scale, every d)."""
        if QT == QT_Q6_K_PLANES:
            nb = K // 256
            ql = kb * 128
            qh = nb * 128 + kb * 64
            sc = nb * 192 + kb * 16
            d = nb * 208 + kb * 2
        else:
            ql = kb * 210
            qh = ql + 128
            sc = ql + 192
            d = ql + 208
        return ql, qh, sc, d
