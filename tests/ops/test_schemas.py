"""Each op's argument list exists once, in its registered schema (csrc/schemas.h): the typed
wrappers, the reference and the simt backend take exactly those arguments, in that order."""

import inspect

import pytest

from pagedkv import ops
from pagedkv.ops import reference, simt


@pytest.mark.parametrize("op", ops.OPS)
def test_wrappers_and_reference_take_the_schema_arguments(op):
    names = ops.arg_names(op)
    assert tuple(inspect.signature(getattr(ops, op)).parameters) == names
    extra = tuple(inspect.signature(getattr(reference, op)).parameters)[len(names):]
    assert tuple(inspect.signature(getattr(reference, op)).parameters)[:len(names)] == names
    assert all(inspect.signature(getattr(reference, op)).parameters[p].kind
               == inspect.Parameter.KEYWORD_ONLY for p in extra), extra


@pytest.mark.skipif(not simt.available(), reason="the simt backend was not built")
@pytest.mark.parametrize("op", ops.OPS)
def test_simt_registers_the_same_schemas(op):
    assert ops.arg_names(op, "pagedkv_simt") == ops.arg_names(op)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'attention'"):
        ops.arg_names("attention")
