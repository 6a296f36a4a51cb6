"""The margin rule of tests/_margins.py (how tests compare greedy tokens of two different float
computations): equal tokens pass, a parting passes only where the reference's lead is within twice the
error, nothing after a parting is compared, and rows beyond the tolerance fail before any token."""

from __future__ import annotations

import numpy as np
import pytest
from _margins import assert_same_pairs, check_pairs, check_tokens, parting


def rows_with_leads(leads):
    """Logits rows over 4 tokens: token 0 leads token 1 by leads[i] at step i, the others far behind."""
    return [np.array([10.0, 10.0 - d, 0.0, -5.0], np.float32) for d in leads]


def test_parting():
    assert parting([1, 2, 3], [1, 2, 3]) is None
    assert parting([1, 5, 3], [1, 2, 9]) == 1
    with pytest.raises(AssertionError, match="3 tokens vs 2"):
        parting([1, 2, 3], [1, 2])


def test_check_tokens_parts_only_at_a_near_tie():
    rows = rows_with_leads([2.0, 0.01, 2.0])
    want = [0, 0, 0]
    assert check_tokens(want, want, rows, lambda j: 0.0) is None
    assert check_tokens([0, 1, 3], want, rows, lambda j: 0.01) == 1    # lead 0.01 <= 2 x 0.01; step 2 not compared
    with pytest.raises(AssertionError, match="token 0 is 1, the reference's 0 leads it by 2"):
        check_tokens([1, 1, 0], want, rows, lambda j: 0.01)            # a real margin: a bug, not rounding
    with pytest.raises(AssertionError, match="leads it by 0.01"):
        check_tokens([0, 1, 0], want, rows, lambda j: 0.004)          # the error cannot swap them
    with pytest.raises(AssertionError, match="not its row's argmax"):
        check_tokens([0, 2, 0], [0, 1, 0], rows, lambda j: 10.0)       # the reference's own token is checked


def test_check_pairs_measures_the_error_and_checks_the_tolerance():
    want_rows = rows_with_leads([2.0, 0.01, 2.0])
    want = [(0, r) for r in want_rows]
    swapped = want_rows[1].copy()
    swapped[[0, 1]] = swapped[[1, 0]]                                 # the near tie falls the other way
    got = [want[0], (1, swapped), (2, np.array([0, 0, 9, 0], np.float32))]   # after the parting: anything
    assert check_pairs(got, want, tol=1e-2) == 1
    assert check_pairs(want, want, tol=0.0) is None
    far = [want[0], (0, want_rows[1] + 1.0), want[2]]
    with pytest.raises(AssertionError, match="step 1: logits rel error"):
        check_pairs(far, want, tol=1e-2)
    with pytest.raises(AssertionError, match="step 0: token 1 is not its row's argmax"):
        check_pairs([(1, want_rows[0])] + want[1:], want, tol=1e-2)


def test_assert_same_pairs_compares_bits():
    rows = rows_with_leads([1.0, 2.0])
    pairs = [(0, r) for r in rows]
    assert_same_pairs(pairs, [(0, r.copy()) for r in rows])
    nudged = rows[1].copy()
    nudged[2] = np.nextafter(nudged[2], np.float32(1))
    with pytest.raises(AssertionError, match="step 1 differs"):
        assert_same_pairs(pairs, [pairs[0], (0, nudged)])
