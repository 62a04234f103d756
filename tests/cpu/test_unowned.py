"""cpu.numerics' unowned arrays: `unowned` gives a view of an array's memory without its owner (the decode kernels'
scratch and launch arrays, so that their reference counts are null tests), and `alive` keeps the owner until the
views' last use -- numba frees an array after its own last use, which may come before its views' (checked in the
compiled code: the owner's release follows the store through the view)."""
from __future__ import annotations

import re

import numpy as np
import pytest
from numba import carray, njit

from fia.cpu.numerics import addr_ptr, alive, unowned

pytestmark = pytest.mark.backend_independent      # Numba only: run once, not per backend (conftest)


@njit(cache=False)
def _write(u, x):
    for i in range(u.shape[0]):
        u[i] = x[i] * 2.0


@njit(cache=False)
def _through_views(x):
    owner = np.zeros(x.shape[0] * 2)                               # [2n]: two arrays carved from one block
    a = carray(addr_ptr(owner.ctypes.data), x.shape[0], np.float64)
    b = unowned(owner[x.shape[0]:])
    _write(a, x)
    _write(b, -x)
    alive((owner,))
    return owner


@njit(cache=False)
def _store_then_release(n):
    owner = np.zeros(n)
    view = carray(addr_ptr(owner.ctypes.data), n, np.float64)
    view[n - 1] = 7.0
    alive((owner,))
    return 0


def test_views_write_the_owners_memory():
    x = np.random.default_rng(3).standard_normal(37)
    got = _through_views(x)
    np.testing.assert_array_equal(got, np.concatenate([2 * x, -2 * x]))


def test_unowned_keeps_shape_strides_and_data():
    @njit(cache=False)
    def meta(a):
        u = unowned(a[:, 1:])
        return u.shape[0], u.shape[1], u.strides[0], u.strides[1], u.ctypes.data - a.ctypes.data, u[2, 3]

    a = np.random.default_rng(4).standard_normal((5, 7)).astype(np.float32)
    assert meta(a) == (5, 6, 28, 4, 4, np.float32(a[2, 4]))


def test_alive_keeps_the_owner_past_the_views_use():
    _store_then_release(8)
    ir = next(iter(_store_then_release.inspect_llvm().values()))
    body = re.search(r"define [^\n]*\n(.*?)\n}\n", ir, re.S).group(1)   # the function itself (not its wrapper)
    lines = body.splitlines()
    stores = [i for i, ln in enumerate(lines) if "store double 7.0" in ln]
    releases = [i for i, ln in enumerate(lines) if "NRT_decref" in ln]
    assert stores and releases, "the compiled function no longer shows the store or the release"
    assert max(stores) < min(releases), "the owner is released before the store through its view"
