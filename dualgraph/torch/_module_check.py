"""The module check's usual call as straight-line code: one test per recorded object.

:meth:`ModuleTensors.check <dualgraph.torch._params.ModuleTensors.check>` runs on every call of
a graphed module. Its usual answer (nothing changed) was a dozen passes of ``map``, ``all`` and
``tuple`` over the recorded objects, each pass an iterator or two and a tuple made, which costs
more than the tests themselves for a small module (a ``Linear``: 4.5 us in a training step on a
CPU, 1.8 us as one chain of tests). :func:`fast_check` writes that chain once per record: a
``dict[key] is tensor`` per parameter, ``type(module) is cls`` per module, and so on, in the
order the passes made them, each object a closure variable, never pasted into the source (a
:class:`~dualgraph.torch._chains.Chain`: records of one shape, a model's blocks, share one
compiled code).

The chain answers ``True`` only where every comparison of the passes it stands for holds; a
``False`` sends the caller to the record's full check, which decides and words the refusal. Its
``KeyError`` (a recorded key deleted) and ``ValueError`` (a closure cell emptied) are the passes'.

Example::

    passes = fast_check(record)  # once, after the record is complete
    passes()  # per call: True while nothing recorded changed
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ._chains import Chain

if TYPE_CHECKING:
    from ._params import ModuleTensors

__all__ = ["fast_check"]


def fast_check(record: ModuleTensors, absent: object) -> Callable[[], bool]:
    """The chain of tests of ``record``'s usual call (module docstring); ``absent``: what
    stands for a deleted attribute among the recorded values."""
    w = Chain()
    owners, keys = record._indexed
    identical = record._identical
    for owner, key, held in zip(owners, keys, identical, strict=False):
        w.test("{}[{}] is {}", owner, key, held)
    dicts, names = record._got
    for namespace, key, held in zip(dicts, names, identical[len(owners) :], strict=True):
        w.test("_get({}, {}) is {}", namespace, key, held)
    w.test("_type({}) is {}", record.root, record.root_class)
    for module, cls in zip(record.modules, record.classes, strict=True):
        w.test("_type({}) is {}", module, cls)
    for module, training in zip(record.modules, record.training, strict=True):
        w.test("{}.training == {}", module, training)
    for tensor, address in zip(record.tensors, record.data_ptrs, strict=True):
        w.test("_data_ptr({}) == {}", tensor, address)
    for tensor, flag in zip(record.watched, record.watched_requires_grad, strict=True):
        w.test("{}.requires_grad == {}", tensor, flag)
    w.test("{}.same()", record._layouts)
    for hooks in record.unhooked_dicts:
        w.test("not {}", hooks)
    if record.hooked:
        w.test("{}._same_hooks_where_hooked()", record)
    if record.global_hook_dicts:
        anyone = " or ".join(map(w.bind, record.global_hook_dicts))
        w.tests.append(f"(not ({anyone}) or {w.bind(record)}._same_global_hooks())")
    if record.host_tensors:
        w.test("{}._host_unchanged()", record)
    if record.counted_dicts:  # the list is updated in place (a benign change taken)
        lens = w.bind(record.counted_lens)
        for i, namespace in enumerate(record.counted_dicts):
            w.tests.append(f"_len({w.bind(namespace)}) == {lens}[{i}]")
    if record.attribute_keys:
        values, gone = w.bind(record.attribute_values), w.bind(absent)
        for i, (namespace, key) in enumerate(
            zip(record.attribute_dicts, record.attribute_keys, strict=True)
        ):
            w.tests.append(f"_get({w.bind(namespace)}, {w.bind(key)}, {gone}) is {values}[{i}]")
    if record.cells:
        values = w.bind(record.cell_values)
        for i, cell in enumerate(record.cells):
            w.tests.append(f"{w.bind(cell)}.cell_contents is {values}[{i}]")
    if record.class_keys:
        values, gone, read = w.bind(record.class_values), w.bind(absent), w.bind(getattr)
        for i, (cls, key) in enumerate(zip(record.class_owners, record.class_keys, strict=True)):
            w.tests.append(f"{read}({w.bind(cls)}, {w.bind(key)}, {gone}) is {values}[{i}]")
    return w.compiled()
