"""Tensors laid out as others: the static inputs and outputs, and owned copies of them, as
eager's are.

A non-dense view (a complex tensor's ``.real``, ``h[:, ::2]``) keeps its strides, an expanded
one its stride 0, and a conjugate or negative view its bit, where ``empty_like`` and
``clone`` would make them dense or resolve them; and each lies as far past its allocator's
alignment as the tensor it is laid out like (a slice ``big[1:]``), since kernels vectorize by
it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "Layout",
    "clone_placed_like",
    "copier_of",
    "copy_laid_out",
    "empty_from_layout",
    "empty_laid_out_like",
    "expanded_dims",
    "layout_of",
]

#: The alignment each device's caching allocator gives every allocation, in bytes: an address
#: within it is as far past such a boundary as the allocator lets a tensor of its own lie.
_ALLOCATOR_ALIGNMENT = {"cpu": 64, "cuda": 512}

#: What :func:`empty_from_layout` needs to allocate a tensor laid out as another: a tensor on
#: the meta device laid out so (no memory), and the device to allocate on.
Layout = tuple[torch.Tensor, torch.device]


def empty_laid_out_like(
    tensor: torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """An uninitialised tensor laid out as ``tensor``: its strides, where no two of its elements
    share memory (a non-dense view such as a complex tensor's ``.real`` or ``h[:, ::2]``
    included, which ``empty_like`` makes contiguous), and its conjugate and negative bits; an
    expanded tensor's too (stride 0 over the memory of one slice: written with
    :func:`copy_laid_out`), any other whose elements overlap (``unfold``) contiguous. As a CUDA
    graph's own outputs are laid out. On ``device`` where given (else ``tensor``'s), as far past the
    allocator's alignment as ``tensor`` (:func:`clone_placed_like`; on the meta device, its
    storage offset holds how far, in elements).

    >>> empty_laid_out_like(torch.zeros(3, 4, dtype=torch.complex64).real).stride()
    (8, 2)
    >>> empty_laid_out_like(torch.zeros(2, dtype=torch.complex64).conj()).is_conj()
    True
    >>> empty_laid_out_like(torch.zeros(1, 4).expand(3, 4)).stride()
    (0, 1)
    >>> empty_laid_out_like(torch.zeros(5).unfold(0, 2, 1)).stride()
    (2, 1)
    >>> empty_laid_out_like(torch.zeros(9)[1:]).data_ptr() % 64  # 4 bytes off, as the slice
    4
    """
    tensor = tensor.detach()
    where = tensor.device if device is None else device
    if _elements_apart(tensor):
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=where)
    elif dims := expanded_dims(tensor):
        one = _narrowed(tensor, dims)
        memory = torch.empty_strided(one.shape, one.stride(), dtype=tensor.dtype, device=where)
        made = torch.empty(0, dtype=tensor.dtype, device=where)
        made.set_(memory.untyped_storage(), 0, tensor.shape, tensor.stride())
    else:
        made = torch.empty_like(tensor, memory_format=torch.contiguous_format, device=where)
    made = _placed(made, _shift_of(tensor))
    if tensor.is_conj():
        made = made.conj()
    if tensor.is_neg():
        made = torch._neg_view(made)
    return made


def layout_of(tensor: torch.Tensor) -> Layout:
    """``tensor``'s layout, kept without its memory (to allocate buffers like it later).

    >>> like, device = layout_of(torch.zeros(3, 4, dtype=torch.complex64).real)
    >>> like.device.type, like.stride(), device.type
    ('meta', (8, 2), 'cpu')
    """
    return empty_laid_out_like(tensor, device="meta"), tensor.device


def empty_from_layout(layout: Layout) -> torch.Tensor:
    """An uninitialised tensor laid out as :func:`layout_of` found, on its device.

    >>> empty_from_layout(layout_of(torch.zeros(4, 6)[:, ::2])).stride()
    (6, 2)
    >>> empty_from_layout(layout_of(torch.zeros(9)[1:])).data_ptr() % 64  # placed as the slice
    4
    """
    like, device = layout
    return empty_laid_out_like(like, device=device)


def _elements_apart(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` share memory: taken smallest stride first, each
    dim's stride steps over all that the dims before it span."""
    shape, strides = tensor.shape, tensor.stride()
    dims = sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return False
        span += stride * (size - 1)
    return True


def expanded_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dims ``tensor`` repeats (stride 0 over more than one element) where it is an
    expanded tensor of its own otherwise (one slice of them shares no memory); else none.

    >>> expanded_dims(torch.zeros(4, 1, 3).expand(4, 2, 3)), expanded_dims(torch.zeros(4, 3))
    ((1,), ())
    """
    dims = tuple(
        d
        for d, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True))
        if size > 1 and stride == 0
    )
    return dims if dims and _elements_apart(_narrowed(tensor, dims)) else ()


def _narrowed(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``tensor``'s first slice along each of ``dims``."""
    for d in dims:
        tensor = tensor.narrow(d, 0, 1)
    return tensor


def copy_laid_out(target: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``target.copy_(tensor)``, also where ``target`` is expanded (:func:`expanded_dims`):
    through one slice of the dims it repeats, where ``tensor`` repeats them too (else
    ``copy_`` raises, as writing into an expanded tensor does).

    >>> target = empty_laid_out_like(torch.zeros(1, 3).expand(2, 3))
    >>> copy_laid_out(target, torch.arange(3.0).expand(2, 3)).tolist()
    [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    """
    dims = expanded_dims(target)
    if dims and all(tensor.stride(d) == 0 for d in dims):
        _narrowed(target, dims).copy_(_narrowed(tensor, dims))
        return target
    return target.copy_(tensor)


def _copy_laid_out(tensor: torch.Tensor) -> torch.Tensor:
    return copy_laid_out(empty_laid_out_like(tensor), tensor)


def copier_of(tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """What copies a tensor laid out as ``tensor`` into one of its own, laid out so too:
    ``Tensor.clone`` where that keeps the layout (a dense tensor at the allocator's
    alignment), else a strided copy placed as ``tensor`` is.

    >>> real = torch.ones(2, 3, dtype=torch.complex64).real
    >>> copier_of(real)(real).stride(), copier_of(real.contiguous()) is torch.Tensor.clone
    ((6, 2), True)
    """
    if tensor.is_conj() or tensor.is_neg() or _shift_of(tensor):
        return _copy_laid_out
    # asked of a tensor on the meta device: the answer is its strides, no memory is needed
    if torch.empty_like(tensor, device="meta").stride() != tensor.stride():
        return _copy_laid_out
    return torch.Tensor.clone


def clone_placed_like(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.detach().clone()`` (its layout: dense strides kept, others made contiguous) at
    an address as far past the device allocator's alignment as ``tensor``'s: a slice past the
    start of its storage (``big[1:]``, one of several chunks) lies where no allocation starts,
    and kernels vectorize by alignment, so an op over it can round otherwise than over an
    aligned copy. Not a view (its ``_base`` is ``None``); a conjugate or negative view, or an
    address no element of its dtype can start at, gets the plain clone.

    >>> big = torch.arange(9.0)
    >>> placed = clone_placed_like(big[1:])
    >>> (placed.data_ptr() - big.data_ptr()) % 64, placed._base is None, placed.tolist()[:3]
    (4, True, [1.0, 2.0, 3.0])
    """
    made = tensor.detach().clone()
    if made.is_conj() or made.is_neg():
        return made
    placed = _placed(made, _shift_of(tensor))
    return made if placed is made else placed.copy_(made)


def _alignment(device: torch.device) -> int:
    return _ALLOCATOR_ALIGNMENT.get(device.type, 0)


def _shift_of(tensor: torch.Tensor) -> int:
    """How many bytes past its device allocator's alignment ``tensor`` starts (0 where the
    device has none known); on the meta device, as :func:`layout_of` noted it."""
    if tensor.device.type == "meta":
        return int(tensor.storage_offset()) * tensor.element_size()
    unit = _alignment(tensor.device)
    return tensor.data_ptr() % unit if unit and tensor.numel() else 0


def _placed(made: torch.Tensor, shift: int) -> torch.Tensor:
    """``made`` (new, at its storage's start), or a tensor laid out as it in memory of its own
    starting ``shift`` bytes past the allocator's alignment (on the meta device: at a storage
    offset of that many bytes), where an element of its dtype can start there."""
    size = made.element_size()
    device = made.device
    unit = max(_ALLOCATOR_ALIGNMENT.values()) if device.type == "meta" else _alignment(device)
    shift %= unit or 1
    if not shift or shift % size or not made.numel() or _shift_of(made) == shift:
        return made
    span = made.untyped_storage().nbytes()
    room = torch.empty(span + unit, dtype=torch.uint8, device=device)
    start = shift if device.type == "meta" else (shift - room.data_ptr()) % unit
    if start % size:
        return made
    placed = torch.empty(0, dtype=made.dtype, device=device)
    return placed.set_(room.untyped_storage(), start // size, made.shape, made.stride())
