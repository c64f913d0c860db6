"""The module check's usual call as one chain of tests (dualgraph/torch/_module_check.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualgraph import DualgraphError  # noqa: E402
from dualgraph.torch._params import ModuleTensors  # noqa: E402


def _block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Dropout(0.1))


def test_records_of_the_same_shape_share_one_compiled_check() -> None:
    # One compile per shape of record, not per block: the blocks of a model check through one
    # code object, each with its own objects bound.
    first, second = ModuleTensors.of(_block()), ModuleTensors.of(_block())
    first.check(grad_enabled=True)
    second.check(grad_enabled=True)
    assert first._passes is not None and second._passes is not None
    assert first._passes is not second._passes
    assert first._passes.__code__ is second._passes.__code__


def test_the_chain_answers_false_for_each_kind_of_change_and_the_check_names_it() -> None:
    module = _block()
    record = ModuleTensors.of(module)
    record.check(grad_enabled=True)
    passes = record._passes
    assert passes is not None and passes()
    module[2].eval()
    assert not passes()
    with pytest.raises(DualgraphError, match=r"Sequential\.2: training was True"):
        record.check(grad_enabled=True)
    module[2].train()
    module[0].weight.data = module[0].weight.data.clone()
    assert not passes()
    with pytest.raises(DualgraphError, match=r"Sequential\.0\.weight"):
        record.check(grad_enabled=True)


def test_a_field_set_after_a_check_makes_the_chain_again() -> None:
    # The chain binds the record's objects when it is made; a field set later (the attributes
    # recorded at the end of capture) makes it again at the next check, so that what the new
    # field records is compared too.
    module = _block()
    record = ModuleTensors.of(module)
    record.check(grad_enabled=True)
    before = record._passes
    record.record_attributes()
    assert record._passes is None
    record.check(grad_enabled=True)
    assert record._passes is not None and record._passes is not before
    module[2].p = 0.5
    with pytest.raises(DualgraphError, match=r"Sequential\.2"):
        record.check(grad_enabled=True)
