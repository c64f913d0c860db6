"""Where two trees differ in more than array shapes: containers, keys, kinds, constants, dtypes."""

from __future__ import annotations

from .._nodes import ArrayLeaf, ConstLeaf, Node, NoneLeaf, show_constant
from .._spec import TreeSpec, structure_difference

__all__ = ["difference_but_shapes"]


def difference_but_shapes(
    expected: TreeSpec, found: TreeSpec, *, dtypes: bool = True
) -> tuple[str, str, str] | None:
    """Where two specs first differ in more than array shapes, as ``(path, expected, found)``
    with each side shown; None where they differ in shapes only. They compare as the core's
    specs do (container types and keys, ``None``, constants with their type, a float by its
    exact text), tensors by their dtype unless ``dtypes`` is false.

    >>> import torch
    >>> from dualgraph import describe
    >>> difference_but_shapes(describe((1, None)), describe((1, 2.0)))
    ('[1]', 'None', 'float 2.0')
    >>> difference_but_shapes(describe([torch.ones(2)]), describe((torch.ones(3),)))
    ('', 'a list of length 1', 'a tuple of length 1')
    """
    difference = structure_difference(expected, found, dtypes=dtypes)
    if difference is None:
        return None
    path, want, got = difference
    return path, _show_node(want), _show_node(got)


def _show_node(node: Node | None) -> str:
    if node is None:
        return "nothing"
    if isinstance(node, ArrayLeaf):
        return f"a {node.dtype} tensor"
    if isinstance(node, ConstLeaf):
        return f"{type(node.value).__name__} {show_constant(node.value)}"
    if isinstance(node, NoneLeaf):
        return "None"
    return node.brief()  # a container: 'a tuple of length 2', 'a dict with keys [...]'
