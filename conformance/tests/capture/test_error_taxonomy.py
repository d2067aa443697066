"""The error taxonomy itself: one root, documented classes, real clause ids, picklable fields."""

from __future__ import annotations

import inspect
import pickle

import pytest

import spec
from spec import errors

pytestmark = pytest.mark.strict  # exact error classes: the reference's promise (ERR-1)

CLASSES = [
    obj
    for _, obj in inspect.getmembers(errors, inspect.isclass)
    if obj.__module__ == errors.__name__
]


@pytest.mark.clause("ERR-1")
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_documented_and_cites_a_clause(cls: type) -> None:
    assert issubclass(cls, spec.GraphError) and issubclass(cls, RuntimeError)
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring"
    assert cls.clause in spec.CLAUSES, f"{cls.__name__}.clause {cls.clause!r} is not a clause"
    assert cls.__name__ in errors.__all__ and cls.__name__ in spec.__all__


@pytest.mark.clause("ERR-1")
def test_families() -> None:
    for leaf in (
        spec.SyncDuringCapture,
        spec.DefaultStreamCapture,
        spec.NestedCapture,
        spec.UnjoinedStream,
        spec.CaptureInvalidated,
        spec.UnsupportedInCapture,
    ):
        assert issubclass(leaf, spec.CaptureError)
    for leaf in (spec.FreedMemoryAccess, spec.PoolClobber, spec.GraphNotReady):
        assert issubclass(leaf, spec.ReplayError)


@pytest.mark.clause("ERR-1")
def test_fields_survive_pickling() -> None:
    err = spec.PoolClobber("block 3", op="aten.add", expected="g1#2", found="g3#0", detail="x")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is spec.PoolClobber and str(back) == str(err)
    assert (back.block, back.op, back.expected, back.found) == (
        "block 3",
        "aten.add",
        "g1#2",
        "g3#0",
    )
    unjoined = pickle.loads(pickle.dumps(spec.UnjoinedStream(("s1", "s2"))))
    assert unjoined.streams == ("s1", "s2")
    assert pickle.loads(pickle.dumps(spec.UnsupportedInCapture("aten.rand"))).op == "aten.rand"
