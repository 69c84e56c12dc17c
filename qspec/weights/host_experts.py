"""Routed experts in page-locked host memory, read by the GPU over PCIe: a model larger than its GPU.

The routed experts are most of the model (the whole Q4_K_M model's 128 B parameters are ~80 GiB of blocks, more
than an 80 GB GPU holds), and a decode step reads only the few each token chose. `HostExperts` keeps the routed
experts of the first N trunk layers (llama.cpp's `--n-cpu-moe N`) in page-locked host memory instead of on the
device. With unified virtual addressing a pinned allocation's host address is valid on the device, so the
few-token expert kernels (kernels/qmatmul.qmoe_few) read the chosen experts' blocks straight over PCIe, with no
host work, inside CUDA graphs, as the n-gram table is gathered (weights/pinned.py). A prefill-sized step copies
the layer's experts to the device first (MoE._grouped), a bounded transient.

Placement happens as the loader produces each tensor on the device (the file's bytes pass through it once), so the
device never holds more than a tensor or two of what goes to the host: the tensor is checked for NaN/inf scales
there (weights/finite.py cannot read a layout in planes), put in the layout the device's copy would have had
(`layout`, model.block_layout: the same kernels run), then copied into the arena and its device copy dropped.

Why an arena of 1 GiB pieces rather than a pinned tensor each: torch's page-locked allocator rounds a request up to
a power of two, so a 587 MB expert tensor would take 1 GiB; in shared pieces the loss is the pieces' tails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from qspec.weights.dequant import WeightsError
from qspec.weights.finite import nonfinite_blocks, nonfinite_error
from qspec.weights.pinned import HOST_MARGIN_BYTES, available_host_bytes
from qspec.weights.qweight import QuantWeight

PIECE_BYTES = 1 << 30
ALIGN = 256  # each tensor starts on a 256-byte boundary of its piece (the kernels' widest loads are 16 bytes)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
HOST_EXPERTS_HELP = ("keep the routed experts of the model's first N layers in page-locked host memory, read by the "
                     "GPU over PCIe (llama.cpp's --n-cpu-moe): a GGUF larger than the GPU runs, those layers' steps "
                     "slower (CUDA, GGUF block experts; default 0)")
# Device memory kept free for host experts, in layers' worth of them: a prefill step's copy of one layer's experts,
# and while loading, a tensor on its way to the host beside its copy in planes.
HOST_TRANSIENT_LAYERS = 2


class HostMemoryError(OSError):
    """Too little page-locked host memory for the experts asked to stay there (an OSError: one line from the CLI)."""


def host_expert_names(layers: int, n_layers: int) -> frozenset[str]:
    """The routed-expert tensors of the first `layers` trunk layers (never the MTP block's, blk.{n_layers})."""
    if not 0 <= layers <= n_layers:
        raise WeightsError(f"--host-experts {layers}: the model has {n_layers} layers (0 to {n_layers})")
    return frozenset(f"blk.{i}.{t}.weight" for i in range(layers) for t in EXPERT_TENSORS)


def expert_layer(name: str) -> int | None:
    """The layer of a routed-expert tensor's name (blk.{i}.ffn_*_exps.weight), else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSORS and parts[1].isdigit():
        return int(parts[1])
    return None


def fewest_layers(layer_bytes: Iterable[int], over: int) -> int | None:
    """The fewest first layers whose expert bytes (`layer_bytes`, by layer) add up to at least `over`; None when
    all of them do not."""
    if over <= 0:
        return 0
    total = 0
    for n, b in enumerate(layer_bytes, start=1):
        total += b
        if total >= over:
            return n
    return None


class HostExperts:
    """Placement of the routed experts of the first `layers` trunk layers in page-locked host memory (the module
    docstring). `place(name, w)` returns the weight the model should hold under `name`."""

    def __init__(self, layers: int, layout: Callable[[str, QuantWeight], QuantWeight], *, pin: bool = True) -> None:
        """layout: the layout the device's copy would have (model.block_layout); pin: page-locked pieces (False: plain
        host memory, for the CPU tests of the placement)."""
        self.names: frozenset[str] = frozenset()  # set by `bind`, once the model's layers are known
        self.layers = layers
        self.layout = layout
        self.pin = pin
        self.pieces: list[torch.Tensor] = []
        self.used = 0  # bytes taken in the last piece
        self.nbytes = 0  # bytes of the tensors placed

    def bind(self, n_layers: int) -> None:
        """For a model of `n_layers` trunk layers (WeightsError where it has fewer than asked)."""
        self.names = host_expert_names(self.layers, n_layers)

    def place(self, name: str, w: object, source: object) -> object:
        """w itself unless `name` goes to the host; then a copy of w (on the device, checked, laid out) in pinned
        host memory. `source` names the file in errors."""
        if name not in self.names:
            return w
        if not isinstance(w, QuantWeight):
            raise WeightsError(f"{source}: --host-experts keeps GGUF block experts in host memory; {name!r} is "
                               f"{type(w).__name__}")
        if not w.planes and bool(nonfinite_blocks(w)):
            raise nonfinite_error(source, name, f"{w.qtype.name} block scales")
        w = self.layout(name, w)
        raw = self._alloc(w.raw.numel()).view(w.raw.shape)
        raw.copy_(w.raw)
        self.nbytes += raw.numel()
        return QuantWeight(raw, w.qtype, w.shape, w.planes)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of pinned memory (uint8, flat) from the arena."""
        at = -(-self.used // ALIGN) * ALIGN
        if not self.pieces or at + nbytes > self.pieces[-1].numel():
            size = max(PIECE_BYTES, nbytes)
            if self.pin and size + HOST_MARGIN_BYTES > (free := available_host_bytes()):
                raise HostMemoryError(f"--host-experts {self.layers}: another {size / 1e9:.1f} GB of page-locked host "
                               f"memory is needed beside {HOST_MARGIN_BYTES / 1e9:.0f} GB to spare; "
                               f"{free / 1e9:.1f} GB is available")
            try:
                self.pieces.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            except RuntimeError as e:  # cudaHostAlloc refused (locked-memory limits)
                raise HostMemoryError(f"--host-experts {self.layers}: a page-locked allocation of {size / 1e9:.1f} GB "
                               f"failed: {e}") from e
            at = 0
        self.used = at + nbytes
        return self.pieces[-1][at:at + nbytes]

    def describe(self) -> str:
        """For the weights summary."""
        if not self.layers:
            return ""
        span = "layer 0" if self.layers == 1 else f"layers 0-{self.layers - 1}"
        return (f"; routed experts of {span} in page-locked host memory ({self.nbytes / 2**30:.2f} GiB, "
                f"{len(self.pieces)} pieces), read by the GPU over PCIe")
