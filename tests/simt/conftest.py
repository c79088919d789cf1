"""Fixtures of the emulator self-tests: the self-test library, and a test run in each fiber
order / seed / worker count."""

import pytest

import selftest_lib

ORDERS = [("forward", 0, 1), ("reverse", 0, 1), ("random", 1, 1), ("random", 2, 2)]


@pytest.fixture(scope="module")
def ops():
    """torch.ops.pagedkv_simt_selftest (built on first use), or a skip saying what is missing."""
    try:
        return selftest_lib.load()
    except selftest_lib.Unavailable as e:
        pytest.skip(f"the simt self-test library cannot be built: {e}")


@pytest.fixture(params=ORDERS, ids=lambda p: f"{p[0]}-seed{p[1]}-workers{p[2]}")
def order(request, ops):
    """Runs the test under one fiber order / seed / worker count, then restores the config."""
    from pagedkv.ops import simt

    saved = simt.config()
    name, seed, workers = request.param
    simt.set_order(name, seed)
    simt.set_workers(workers)
    yield name
    simt.set_order(saved[0], saved[1])
    simt.set_workers(saved[2])
