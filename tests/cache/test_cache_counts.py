"""The cache's sizes are counts like block management's: a bool, a float or a value past int32
(the kernels take them as int32) raises an InvalidArgumentError naming it."""

import re

import numpy as np
import pytest
import torch

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.checks import INT32_MAX
from pagedkv.errors import InvalidArgumentError

SIZES = dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=4)


@pytest.mark.parametrize("field", sorted(SIZES))
@pytest.mark.parametrize("bad, why", [(INT32_MAX + 1, "<= 2147483647"), (2**40, "<= 2147483647"),
                                      (True, "must be an int"), (4.0, "must be an int")])
def test_spec_refuses_bad_sizes(field, bad, why):
    with pytest.raises(InvalidArgumentError, match=re.escape(f"KVCacheSpec.{field}") + ".*" + why):
        KVCacheSpec(**{**SIZES, field: bad})


def test_spec_takes_numpy_and_tensor_ints_as_python_ints():
    spec = KVCacheSpec(np.int64(2), torch.tensor(2), 8, np.int32(4), torch.float32)
    assert spec == KVCacheSpec(**SIZES, dtype=torch.float32)
    assert all(type(getattr(spec, field)) is int for field in SIZES)
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * 4 * 4


@pytest.mark.parametrize("bad, why", [(INT32_MAX + 1, "<= 2147483647"), (0, ">= 1"),
                                      (-3, ">= 1"), (2.0, "must be an int")])
def test_paged_cache_refuses_bad_block_counts(bad, why):
    with pytest.raises(InvalidArgumentError, match="num_blocks.*" + re.escape(why)):
        PagedKVCache(KVCacheSpec(**SIZES), bad)
