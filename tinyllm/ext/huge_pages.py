"""Step 13 - the weights on huge pages: fewer address translations per byte read.

The CPU translates each virtual address a page at a time, through a small cache of translations
(the TLB) and, on a miss, a walk of the page tables. A page is 4 KB by default, so a decode step
that streams the weights crosses a new page, and misses, every few hundred nanoseconds; with
2 MB pages the same weights span far fewer.

Linux gives 2 MB pages ("transparent huge pages") to memory that asks for them with
`madvise(MADV_HUGEPAGE)`, where /sys/kernel/mm/transparent_hugepage/enabled says "madvise" or
"always"; elsewhere the memory keeps its 4 KB pages and nothing else changes. The request must
come before the memory is first written. So `place` copies every weight of a model into one
block of memory (`block`) that asked first: a fresh private anonymous map, its 2 MB-aligned part
advised, each tensor a view of it with a storage of its own (`torch.frombuffer`), so
`copy.deepcopy` copies each tensor alone. `tinyllm.load` places a CPU model's weights this way.
"""

import copy
import mmap
import sys

import torch
from torch import Tensor, nn

HUGE_PAGE = 2 << 20      # bytes in a huge page (x86's and most ARM systems' size)
ALIGN = 64               # each tensor starts on a cache line


def mode() -> str:
    """The system's setting for transparent huge pages: "always", "madvise", "never", or
    "none" where there is no such setting (not Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none"


def block(nbytes: int) -> tuple[mmap.mmap, int]:
    """Fresh memory for nbytes whose 2 MB-aligned pages asked for huge pages, where the system
    has them -> (an anonymous map one huge page larger, the offset of its first aligned byte:
    the nbytes from there are the block). The map is private: a shared one is shared memory,
    whose huge pages follow another setting (shmem_enabled, usually "never"). Nothing is
    written: each page is chosen when first touched."""
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, **({"flags": private} if private else {}))
    start = -torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE                            # huge pages that fit
    if whole and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return memory, start


def empty(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor (numel,) in a block of its own (block)."""
    memory, start = block(numel * dtype.itemsize)
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=start)


def weights(model: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """Every (module, name, tensor) of the model's parameters and buffers on the CPU that
    place moves: contiguous ones; a tensor that two modules share (a head tied to the
    embeddings) appears once for each."""
    return [(module, name, t) for module in model.modules()
            for name, t in [*module._parameters.items(), *module._buffers.items()]
            if t is not None and t.device.type == "cpu" and t.is_contiguous()]


def place(model: nn.Module) -> int:
    """Move the model's weights (weights()) into one block of memory that asked for huge
    pages (block), in place: each parameter or buffer becomes a copy there, equal bit for bit,
    with a storage of its own over the block; a tensor shared by several modules stays one
    tensor. Returns the bytes moved."""
    found = [(module, name, t) for module, name, t in weights(model) if t.numel()]
    unique = list({id(t): t for _, _, t in found}.values())
    offsets, total = {}, 0
    for t in unique:
        offsets[id(t)] = total
        total += -(-t.nbytes // ALIGN) * ALIGN
    if total == 0:
        return 0
    memory, start = block(total)
    moved: dict[int, Tensor] = {}
    for t in unique:
        new = torch.frombuffer(memory, dtype=t.dtype, count=t.numel(),
                               offset=start + offsets[id(t)]).view(t.shape)
        new.copy_(t)
        moved[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    for module, name, t in found:
        table = module._parameters if name in module._parameters else module._buffers
        table[name] = moved[id(t)]
    return total


def unplaced(model: nn.Module) -> nn.Module:
    """A copy of the model whose weights lie in ordinary memory (4 KB pages, unless the system
    gives huge pages to all memory: "always"), each tensor in an allocation of its own: what a
    model placed (place) is measured against."""
    return copy.deepcopy(model)


def backed(t: Tensor) -> int:
    """The bytes of huge pages behind t's memory, by the kernel's own account
    (/proc/self/smaps: AnonHugePages of the maps t lies in); 0 where there is no such file."""
    lo, hi, total = t.data_ptr(), t.data_ptr() + t.nbytes, 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(a, 16) for a in head.split("-"))
                    inside = start < hi and lo < end
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
