"""Which objects are leaves, how array leaves are read, and lazy adapter registration."""

from __future__ import annotations

import abc
import collections.abc
import dataclasses
import gc
import numbers
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from trees import ml_dtypes

import dualgraph
from dualgraph import (
    SpecMismatchError,
    UnsupportedLeafError,
    _leaves,
    describe,
    register_array_type,
)
from dualgraph._leaves import (
    _LAZY_REGISTRATIONS,
    CONSTANT_TYPES,
    array_type_of,
    numpy_is_native,
    same_float,
    signature_of,
)

REPO = Path(__file__).resolve().parents[1]


class FakeArray:
    """An array type the core does not know until a test registers it."""

    def __init__(self, *shape: int, dtype: str = "float32", trainable: bool = True) -> None:
        self.shape, self.dtype, self.trainable = shape, dtype, trainable


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registrations made by the test are undone afterwards."""
    monkeypatch.setattr(_leaves, "_REGISTERED", dict(_leaves._REGISTERED))
    _leaves._RESOLVED.clear()
    yield
    _leaves._RESOLVED.clear()


def register_fake_array() -> None:
    register_array_type(
        FakeArray,
        signature=lambda x: (x.shape, x.dtype),
        requires_grad=lambda x: x.trainable,
    )


def test_constants_are_bool_int_float_str() -> None:
    assert set(CONSTANT_TYPES) == {bool, int, float, str}


def test_bool_constant_is_kept_apart_from_int() -> None:
    assert describe(True) != describe(1)
    assert describe(1) != describe(1.0)


def test_numpy_arrays_are_known_without_registration() -> None:
    assert array_type_of(np.ndarray) is not None


def test_numpy_subclasses_are_arrays() -> None:
    spec = describe(np.ma.masked_array(np.zeros((2, 3), np.float32)))
    assert repr(spec) == "TreeSpec(float32[2, 3](grad))"


@pytest.mark.parametrize("cls", [set, object, FakeArray, np.float32], ids=lambda c: c.__name__)
def test_other_types_are_not_arrays(cls: type) -> None:
    assert array_type_of(cls) is None


def test_numpy_scalars_are_unsupported_leaves() -> None:
    with pytest.raises(
        UnsupportedLeafError, match=r"^\[0\]: unsupported leaf of type numpy\.float32"
    ):
        describe((np.float32(1.0),))


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128],
    ids=lambda d: np.dtype(d).name,
)
def test_numpy_floating_and_complex_arrays_carry_a_gradient(dtype: Any) -> None:
    assert describe(np.zeros(2, dtype)).grad_mask == (True,)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_numpy_bfloat16_arrays_carry_a_gradient() -> None:
    spec = describe(np.zeros(2, ml_dtypes.bfloat16))
    assert repr(spec) == "TreeSpec(bfloat16[2](grad))"


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.int8, np.int32, np.int64, np.uint8], ids=lambda d: np.dtype(d).name
)
def test_numpy_integer_and_bool_arrays_carry_no_gradient(dtype: Any) -> None:
    assert describe(np.zeros(2, dtype)).grad_mask == (False,)


def test_registered_array_type_is_described_by_its_signature_and_grad(registry: None) -> None:
    register_fake_array()
    spec = describe((FakeArray(2, 3, dtype="bfloat16"), FakeArray(4, trainable=False)))
    assert repr(spec) == "TreeSpec((bfloat16[2, 3](grad), float32[4]))"


def test_registered_array_type_is_flattened_and_checked(registry: None) -> None:
    register_fake_array()
    x = FakeArray(2)
    spec = describe({"x": x})
    assert spec.flatten({"x": x}, check=True) == [x]
    with pytest.raises(
        SpecMismatchError, match=r"^\['x'\]: expected float32\[2\], got float32\[3\]"
    ):
        spec.check({"x": FakeArray(3)})


def test_subclasses_of_a_registered_array_type_are_arrays(registry: None) -> None:
    class Sub(FakeArray):
        pass

    register_fake_array()
    assert repr(describe(Sub(2))) == "TreeSpec(float32[2](grad))"


def test_registering_forgets_earlier_lookups(registry: None) -> None:
    assert array_type_of(FakeArray) is None
    register_fake_array()
    assert array_type_of(FakeArray) is not None


def test_lazy_registrations_name_the_adapter_modules() -> None:
    assert _LAZY_REGISTRATIONS == {
        "torch": "dualgraph.torch._leaves",
        "jax": "dualgraph.jax._leaves",
        "jaxlib": "dualgraph.jax._leaves",
    }


@pytest.fixture
def fake_framework(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: None
) -> Iterator[Any]:
    """A framework ``fakeframework`` whose adapter module registers its array type on import."""
    (tmp_path / "fakeframework.py").write_text(
        textwrap.dedent(
            """
            class Array:
                def __init__(self, *shape):
                    self.shape = shape

            class Device:
                pass
            """
        )
    )
    (tmp_path / "fake_adapter_leaves.py").write_text(
        textwrap.dedent(
            """
            import fakeframework
            from dualgraph import register_array_type

            register_array_type(
                fakeframework.Array,
                signature=lambda x: (x.shape, "float32"),
                requires_grad=lambda x: True,
            )
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_LAZY_REGISTRATIONS, "fakeframework", "fake_adapter_leaves")
    import fakeframework

    yield fakeframework
    for name in ("fakeframework", "fake_adapter_leaves"):
        sys.modules.pop(name, None)


def test_first_array_of_a_framework_imports_its_adapter(fake_framework: Any) -> None:
    assert "fake_adapter_leaves" not in sys.modules
    spec = describe((fake_framework.Array(2, 3), None))
    assert "fake_adapter_leaves" in sys.modules
    assert repr(spec) == "TreeSpec((float32[2, 3](grad), None))"


def test_framework_object_that_is_not_an_array_is_unsupported(fake_framework: Any) -> None:
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: unsupported leaf .*fakeframework"):
        describe((fake_framework.Device(),))


def test_describing_numpy_trees_imports_no_framework() -> None:
    script = textwrap.dedent(
        """
        import sys
        import dualgraph
        from trees import TREES

        for build in TREES.values():
            dualgraph.describe(build())
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib")))
        """
    )
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]"


def test_an_object_whose_class_only_names_a_framework_imports_none() -> None:
    # Before: a class whose __module__ merely said "torch.nn" or "jax" (a stand-in, a mock, a
    # class made with type()) made describe, check and their messages import the adapter, and
    # with it torch or JAX, into a program that never imported either
    script = textwrap.dedent(
        """
        import sys
        import dualgraph

        spec = dualgraph.describe([None])
        for module in ("torch", "torch.nn", "jax", "jax.numpy", "jaxlib"):
            Claims = type("Claims", (), {"__module__": module})
            try:
                dualgraph.describe([Claims()])
            except dualgraph.UnsupportedLeafError as error:
                assert error.path == "[0]", error
            try:
                spec.check([Claims()])
            except dualgraph.SpecMismatchError as error:
                assert "an object of type " + module + ".Claims" in str(error), error
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib")))
        """
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]"


def test_an_object_whose_class_names_an_unimported_framework_leaves_its_adapter_alone(
    fake_framework: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "fakeframework")
    Claims = type("Array", (), {"__module__": "fakeframework"})
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: unsupported leaf .*fakeframework"):
        describe((Claims(),))
    assert "fake_adapter_leaves" not in sys.modules


def test_register_array_type_is_exported() -> None:
    assert dualgraph.register_array_type is register_array_type


# -- reading array leaves on the hot path ----------------------------------------------------------


def test_signature_of_a_numpy_array_is_shape_and_dtype_name() -> None:
    assert signature_of(np.zeros((2, 3), np.int64)) == ((2, 3), "int64")


def test_signature_of_a_numpy_subclass_uses_the_numpy_description() -> None:
    assert signature_of(np.ma.masked_array(np.zeros(2, np.float16))) == ((2,), "float16")


@pytest.mark.parametrize("leaf", [None, 1.0, "x", [np.zeros(2)]], ids=repr)
def test_signature_of_a_non_array_is_none(leaf: Any) -> None:
    assert signature_of(leaf) is None


@pytest.mark.parametrize(
    ("found", "expected", "same"),
    [
        (1.5, 1.5, True),
        (float("nan"), float("nan"), True),
        (float("inf"), float("inf"), True),
        (1.5, 2.5, False),
        (float("nan"), 1.5, False),
        (-0.0, 0.0, False),
        (1, 1.0, False),
        (True, 1.0, False),
        (np.float64(1.5), 1.5, False),
    ],
    ids=["equal", "nan", "inf", "different", "nan-vs-number", "signed-zero", "int", "bool", "np"],
)
def test_same_float_needs_a_python_float_equal_or_both_nan(
    found: Any, expected: float, same: bool
) -> None:
    assert same_float(found, expected) is same


def test_numpy_is_read_natively_until_its_registration_changes(registry: None) -> None:
    assert numpy_is_native()
    register_array_type(
        np.ndarray, signature=lambda x: (x.shape, x.dtype.name), requires_grad=lambda x: False
    )
    assert not numpy_is_native()
    assert describe(np.zeros(2, np.float32)).grad_mask == (False,)


def test_a_numpy_registration_reading_other_signatures_is_refused_naming_the_path(
    registry: None,
) -> None:
    # check and the generated code read a numpy array's own shape and dtype; describe read the
    # registered signature, so a tree failed the check of its own spec ("expected float32[2],
    # got float64[2]")
    register_array_type(
        np.ndarray, signature=lambda x: (x.shape, "float32"), requires_grad=lambda x: True
    )
    with pytest.raises(dualgraph.DualgraphError, match=r"^\['x'\]: the signature .*numpy"):
        describe({"x": np.zeros(2, np.float64)})


def test_an_array_type_equal_to_a_registered_one_is_not_taken_for_it(registry: None) -> None:
    # A metaclass may make classes compare equal: the registry tells them apart by identity
    class AllEqual(type):
        def __eq__(cls, other: object) -> bool:
            return isinstance(other, AllEqual)

        def __hash__(cls) -> int:
            return 0

    class Odd(metaclass=AllEqual):
        pass

    class Unregistered(metaclass=AllEqual):
        pass

    register_array_type(Odd, signature=lambda x: ((), "float32"), requires_grad=bool)
    assert describe(Odd()).arrays[0].dtype == "float32"
    with pytest.raises(UnsupportedLeafError, match=r"Unregistered"):
        describe(Unregistered())


def test_a_numpy_registration_agreeing_with_numpy_describes_trees_that_check(
    registry: None,
) -> None:
    register_array_type(
        np.ndarray,
        signature=lambda x: (tuple(map(np.int64, x.shape)), x.dtype.name),
        requires_grad=lambda x: False,
    )
    tree = {"x": np.zeros((2, 3), np.float64)}
    describe(tree).check(tree)


def test_an_array_type_with_a_bad_signature_is_refused_naming_the_path(registry: None) -> None:
    register_array_type(
        FakeArray, signature=lambda x: (x.shape, x.dtype), requires_grad=lambda x: True
    )
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: bad shape \(-1,\)"):
        describe((FakeArray(-1),))
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: dtype 'object' is not one"):
        describe((FakeArray(2, dtype="object"),))


@pytest.mark.parametrize("shape", [list, np.array], ids=["list", "numpy"])
def test_a_signature_whose_shape_is_no_tuple_is_refused_naming_the_path(
    registry: None, shape: Any
) -> None:
    # describe read [2] as (2,), but check compared [2] with (2,) and never matched:
    # "expected float32[2], got float32[2]"
    register_array_type(
        FakeArray, signature=lambda x: (shape(x.shape), x.dtype), requires_grad=lambda x: True
    )
    with pytest.raises(dualgraph.DualgraphError, match=r"^\['x'\]: the signature .* tuple"):
        describe({"x": FakeArray(2)})


def test_an_array_type_whose_code_fails_is_a_dualgraph_error(registry: None) -> None:
    register_array_type(FakeArray, signature=lambda x: 1 / 0, requires_grad=lambda x: True)
    with pytest.raises(dualgraph.DualgraphError, match=r"^\['x'\]: reading .* ZeroDivisionError"):
        describe({"x": FakeArray(2)})


@pytest.mark.parametrize(
    "answer", ["no", "False", 1, 0, None, np.array([True, False]), np.int64(1)], ids=repr
)
def test_a_requires_grad_that_is_not_a_bool_is_refused_naming_the_path(
    registry: None, answer: Any
) -> None:
    # bool("no") is True: describe must not coerce what requires_grad answers
    register_array_type(
        FakeArray, signature=lambda x: (x.shape, x.dtype), requires_grad=lambda x: answer
    )
    with pytest.raises(dualgraph.DualgraphError, match=r"^\['x'\]: .*requires_grad.* a bool"):
        describe({"x": FakeArray(2)})


@pytest.mark.parametrize("answer", [True, False, np.bool_(True), np.array(False)], ids=repr)
def test_requires_grad_may_answer_a_bool_or_a_zero_dimensional_boolean_array(
    registry: None, answer: Any
) -> None:
    register_array_type(
        FakeArray, signature=lambda x: (x.shape, x.dtype), requires_grad=lambda x: answer
    )
    assert describe((FakeArray(2),)).grad_mask == (bool(answer),)


class Point(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass
class Wrapped:
    shape: Any
    dtype: Any


def test_a_class_is_an_array_type_or_a_container_never_both(registry: None) -> None:
    # Registered both ways, describe took it for a container and check for an array: a
    # Point at an array's place flattened as that array, silently.
    for container in (Point, dualgraph.register_dataclass(Wrapped)):
        with pytest.raises(dualgraph.DualgraphError, match=r"is a .* container in a spec"):
            register_array_type(
                container, signature=lambda x: ((2,), "float32"), requires_grad=lambda x: True
            )
        with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float32\[2\]"):
            describe((np.zeros(2, np.float32),)).check((container(2, "float32"),))
    register_fake_array()

    @dataclasses.dataclass
    class FakeRecord(FakeArray):  # an array type by its base
        pass

    with pytest.raises(dualgraph.DualgraphError, match=r"FakeRecord: it is an array type"):
        dualgraph.register_dataclass(FakeRecord)


def test_an_array_type_of_which_a_registered_container_is_a_subclass_is_refused(
    registry: None,
) -> None:
    class Base:
        pass

    @dualgraph.register_dataclass
    @dataclasses.dataclass
    class Record(Base):
        x: Any = None

    with pytest.raises(dualgraph.DualgraphError, match=r"Record.* is a dataclass.* container"):
        register_array_type(
            Base, signature=lambda x: ((2,), "float32"), requires_grad=lambda x: True
        )
    # a Record at an array's place is no array
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected float32\[2\]"):
        describe((np.zeros(2, np.float32),)).check((Record(),))


def test_a_namedtuple_class_that_is_an_array_type_is_refused(registry: None) -> None:
    class Mixin:
        pass

    register_array_type(Mixin, signature=lambda x: ((2,), "float32"), requires_grad=lambda x: True)

    class Both(NamedTuple("Pair", [("a", Any), ("b", Any)]), Mixin):  # type: ignore[misc]
        pass

    with pytest.raises(dualgraph.DualgraphError, match=r"Both: it is an array type"):
        dualgraph.register_namedtuple(Both)
    with pytest.raises(UnsupportedLeafError, match=r"^\[0\]: .*Both.* is an array type"):
        describe((Both(1, 2),))
    # not learnt as a container by the refusal
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected a tuple"):
        describe(((np.zeros(1), np.zeros(1)),)).check((Both(np.zeros(1), np.zeros(1)),))


def test_a_subclass_of_a_framework_array_imports_its_adapter(fake_framework: Any) -> None:
    class Subclass(fake_framework.Array):  # defined here, not in the framework's module
        pass

    assert repr(describe((Subclass(2),))) == "TreeSpec((float32[2](grad),))"


@pytest.mark.parametrize(
    ("cls", "signature", "requires_grad", "what"),
    [
        (5, _leaves._numpy_signature, _leaves._numpy_grad, "a class"),
        ("numpy:ndarray", _leaves._numpy_signature, _leaves._numpy_grad, "a class"),
        (FakeArray, None, _leaves._numpy_grad, "signature"),
        (FakeArray, _leaves._numpy_signature, "yes", "requires_grad"),
        (int, _leaves._numpy_signature, _leaves._numpy_grad, "constant"),
        (tuple, _leaves._numpy_signature, _leaves._numpy_grad, "container"),
        (type(None), _leaves._numpy_signature, _leaves._numpy_grad, "None"),
    ],
    ids=repr,
)
def test_register_array_type_refuses_what_would_break_the_registry(
    registry: None, cls: Any, signature: Any, requires_grad: Any, what: str
) -> None:
    registered = dict(_leaves._REGISTERED)
    with pytest.raises(dualgraph.DualgraphError, match=what):
        register_array_type(cls, signature=signature, requires_grad=requires_grad)
    assert registered == _leaves._REGISTERED
    # nothing was registered: other objects are still described as before
    with pytest.raises(UnsupportedLeafError, match=r"unsupported leaf of type builtins\.object"):
        describe(object())


# -- registrations made while a lookup runs (another thread's, or the lookup's own) --------------


def test_a_registration_made_while_a_lookup_runs_is_not_hidden_by_its_cached_miss(
    registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the lookup cached the miss it found before the registration cleared the cache,
    # so the registered type stayed unknown to every later describe and check
    class LateArray(FakeArray):
        pass

    lazy = _leaves._lazy_registrations

    def registered_meanwhile(cls: type) -> list[str]:  # as if another thread registered now
        if cls is LateArray and id(LateArray) not in _leaves._REGISTERED:
            register_array_type(
                LateArray, signature=lambda x: (x.shape, x.dtype), requires_grad=lambda x: True
            )
        return lazy(cls)

    monkeypatch.setattr(_leaves, "_lazy_registrations", registered_meanwhile)
    assert array_type_of(LateArray) is not None
    assert array_type_of(LateArray) is not None
    assert repr(describe(LateArray(2))) == "TreeSpec(float32[2](grad))"


def test_a_registration_made_by_a_subclass_check_does_not_break_the_lookup(
    registry: None,
) -> None:
    # Before: the lookup iterated the registry while the check registered a type: its
    # RuntimeError ('dictionary changed size during iteration') failed the describe
    class Registering(type):
        def __subclasscheck__(cls, subclass: type) -> bool:
            register_array_type(
                type("Other", (), {}), signature=lambda x: ((), "int8"), requires_grad=bool
            )
            return type.__subclasscheck__(cls, subclass)

    class Abstract(metaclass=Registering):
        pass

    register_array_type(Abstract, signature=lambda x: ((), "int8"), requires_grad=bool)

    class Unrelated:
        pass

    with pytest.raises(UnsupportedLeafError, match=r"unsupported leaf of type .*Unrelated"):
        describe(Unrelated())


def test_a_container_described_by_a_subclass_check_does_not_break_a_registration(
    registry: None,
) -> None:
    # Before: register_array_type iterated the known containers while the check described a
    # new namedtuple: its RuntimeError ('dictionary changed size during iteration') leaked
    class Describing(type):
        def __subclasscheck__(cls, subclass: type) -> bool:
            describe(NamedTuple("Fresh", [("x", int)])(1))
            return type.__subclasscheck__(cls, subclass)

    class Base(metaclass=Describing):
        pass

    @dualgraph.register_dataclass
    @dataclasses.dataclass
    class Known:
        x: Any = None

    register_array_type(Base, signature=lambda x: ((), "int8"), requires_grad=bool)
    assert array_type_of(Base) is not None


def test_a_class_looked_up_is_not_kept_alive_by_the_lookup_cache() -> None:
    # Before: every class ever looked up (a class made per call, an object named in a
    # message) stayed alive for good, held beside the cache
    def looked_up() -> weakref.ref[type]:
        ephemeral = type("Ephemeral", (), {})
        assert array_type_of(ephemeral) is None
        assert signature_of(ephemeral()) is None
        assert array_type_of(ephemeral) is None  # answered from the cache
        return weakref.ref(ephemeral)

    ref = looked_up()
    gc.collect()
    assert ref() is None
    # every id the cache answers for is a live class's
    assert all(ident in _leaves._WATCHED for ident in _leaves._RESOLVED)


# -- a base of the builtin kinds is never an array type -------------------------------------------


@pytest.mark.parametrize(
    ("base", "builtin"),
    [
        (numbers.Number, "bool, which is a constant"),
        (collections.abc.Sequence, "str, which is a constant"),
        (collections.abc.Mapping, "dict, which is a container"),
        (object, "bool, which is a constant"),
    ],
    ids=repr,
)
def test_a_base_of_a_builtin_constant_or_container_is_refused_as_an_array_type(
    registry: None, base: type, builtin: str
) -> None:
    # Before: numbers.Number registered, describe still read 3 as a constant but check took it
    # at an array's place (and collections.abc.Sequence a tuple or list there)
    with pytest.raises(dualgraph.DualgraphError, match=f"is the base of {builtin} in a spec"):
        register_array_type(base, signature=lambda x: ((), "int64"), requires_grad=lambda x: False)
    spec = describe({"x": np.zeros((), np.int64)})
    for found in (3, (3,), {"a": 3}):
        with pytest.raises(SpecMismatchError, match=r"^\['x'\]: expected int64\[\]"):
            spec.check({"x": found})


def test_a_builtin_made_a_virtual_subclass_of_an_array_type_is_still_no_array(
    registry: None,
) -> None:
    # Before: an ABC registered as an array type, then given int as a virtual subclass, made
    # check take an int at an array's place (describe reads it as a constant)
    class Scalar(abc.ABC):  # noqa: B024 - an ABC for its register()
        pass

    register_array_type(Scalar, signature=lambda x: ((), "int64"), requires_grad=lambda x: False)
    Scalar.register(int)
    with pytest.raises(SpecMismatchError, match=r"^\[0\]: expected int64\[\], got int 3"):
        describe((np.zeros((), np.int64),)).check((3,))


def test_an_array_type_whose_subclass_check_raises_is_refused_naming_the_error(
    registry: None,
) -> None:
    # Before: its metaclass's RuntimeError leaked from register_array_type
    class Failing(type):
        def __subclasscheck__(cls, subclass: type) -> bool:
            raise RuntimeError("no subclass check")

    class Hostile(metaclass=Failing):
        pass

    with pytest.raises(
        dualgraph.DualgraphError, match=r"Hostile is a base of raised RuntimeError: no subclass"
    ):
        register_array_type(Hostile, signature=lambda x: ((), "int8"), requires_grad=bool)
    assert id(Hostile) not in _leaves._REGISTERED
