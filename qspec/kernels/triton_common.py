"""What every Triton kernel module shares: whether Triton can be used, and small jit helpers.

Triton is optional: without it (or on the CPU) every dispatch function runs its torch reference.
`QSPEC_TRITON=0` forces the torch references on CUDA too (A/B runs). `TRITON_INTERPRET=1` runs the
kernels on CPU tensors through Triton's interpreter, which is how the CPU tests exercise them.
"""

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: every dispatch falls back to its torch reference
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


_REFERENCES_ONLY = False


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


# A product split over K writes f32 partial sums per share; the last program of each row block to finish adds them in
# share order (`last_arrival`), where a second kernel did before (one launch fewer per split product: in a CUDA graph
# a launch costs a few microseconds however little it does, BENCHMARKS.md §5c). The engine sets it
# (EngineOptions.split_sum_in_kernel); off, the second kernel adds them, with the same numbers.
_SPLIT_SUM_IN_KERNEL = True
SPLIT_COUNTERS = 1 << 20  # int32 arrival counters per device (4 MB): a launch takes one per row block from the ring
_COUNTER_RINGS: dict[torch.device, list] = {}


def split_sum_mode(on: bool) -> contextlib.AbstractContextManager[None]:
    """Inside the block, split products add their partial sums in their own last programs (`on`) or in a second
    kernel."""
    return module_flag(__name__, "_SPLIT_SUM_IN_KERNEL", on)


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """n zeroed int32 arrival counters for one split launch (one per row block), or None: switched off, or a CUDA
    graph is being captured before the ring exists (its memory would belong to the graph's pool).

    Invariant: between launches every counter of the ring is 0 (the program that takes one to S - 1 puts it back).
    Launches take consecutive slots, so two launches share a counter only 2^20 slots apart; the kernels that may run
    at once (the two streams of one step) are a few launches apart."""
    if not _SPLIT_SUM_IN_KERNEL or n > SPLIT_COUNTERS:
        return None
    ring = _COUNTER_RINGS.get(device)
    if ring is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        ring = _COUNTER_RINGS[device] = [torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device), 0]
    start = ring[1] if ring[1] + n <= SPLIT_COUNTERS else 0
    ring[1] = start + n
    return ring[0][start:start + n]


def run_split(y: torch.Tensor, split: int, blocks: int,
              launch: Callable[[torch.Tensor, torch.Tensor, int], None]) -> None:
    """Run a product into y [M, N] (row stride free) whose programs are (row block, K share): launch(p, counters,
    PARTS) launches it with the STORE_SPLIT arguments (`store_split`); with several shares and the in-kernel sum
    off, a second kernel adds the f32 partial sums p [split, M, N] in share order."""
    if split == 1:
        launch(y, y, 0)
        return
    M, N = y.shape
    parts = torch.empty(split, M, N, dtype=torch.float32, device=y.device)
    counters = split_counters(y.device, blocks)
    launch(parts, parts if counters is None else counters, 1 if counters is None else 2)
    if counters is None:
        block = 1024
        _sum_parts_kernel[(triton.cdiv(M * N, block),)](parts, y, split, M * N, N, y.stride(0), BLOCK=block,
                                                         OUT_DT=tl_dtype(y.dtype), num_warps=4, **pdl_launch(y))


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


if HAS_TRITON:

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
    def last_arrival(cnt_ptr, S):
        """Called by each of the S programs that share the counter at cnt_ptr once its partial sums are stored: True
        in the last of them to arrive, which then sees the others' stores (the CTA barrier orders this program's
        stores before its GPU-scope release; the acquire half orders the loads after); that one resets the counter
        to 0 for the next launch (split_counters' invariant). Load the partial sums with cache_modifier=".cg"."""
        tl.debug_barrier()
        last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == S - 1
        tl.store(cnt_ptr, 0, mask=last)
        return last

    @triton.jit
    def store_split(acc, y_ptr, y_off, p_ptr, p_off, cnt_ptr, N, mask, M: tl.constexpr, OUT_DT: tl.constexpr,
                    PARTS: tl.constexpr):
        """The output tile of a program (row block, K share) of a product y [M, N] (run_split): PARTS 0 (one share)
        acc rounded into y at offsets y_off; 1: acc into the share's f32 partial sums p [S, M, N] at offsets p_off
        (a second kernel adds them); 2: the same, and the row block's last share to finish adds the S partial sums
        in share order (as the second kernel would) into y (cnt_ptr: a zeroed counter per row block)."""
        if PARTS == 0:
            tl.store(y_ptr + y_off, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(p_ptr + tl.program_id(1) * M * N + p_off, acc, mask=mask)
            if PARTS == 2:
                S = tl.num_programs(1)
                if last_arrival(cnt_ptr + tl.program_id(0), S):
                    total = tl.zeros_like(acc)
                    for s in range(0, S):
                        total += tl.load(p_ptr + s * M * N + p_off, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(y_ptr + y_off, round_to(total, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_parts_kernel(p_ptr, y_ptr, S, total, N, y_m, BLOCK: tl.constexpr, OUT_DT: tl.constexpr,
                          PDL: tl.constexpr = False):
        """y [M, N] (row stride y_m) = the sum of the S partial sums p [S, M * N], added in split order (the same
        for any row count)."""
        pdl_start(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < total
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, S):
            acc += tl.load(p_ptr + s * total + i, mask=mask, other=0.0)
        tl.store(y_ptr + (i // N) * y_m + i % N, round_to(acc, OUT_DT).to(y_ptr.dtype.element_ty), mask=mask)

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
    def dp4a(a, b, c, ASM: tl.constexpr):
        """c + the dot product of a's four bytes with b's, both signed int8 (callers' unsigned bytes stay below 128).
        ASM: the PTX instruction; otherwise (the interpreter runs no PTX, and A/B runs) the same sum byte by byte."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
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
