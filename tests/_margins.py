"""The margin rule: how a test compares greedy tokens of two DIFFERENT float computations (DESIGN.md
section 12; docs/architecture.md, "Exact or within a tolerance").

Two computations that do not run the same arithmetic per row (a GPU kernel and the numpy reference,
the decode GEMV and the prefill GEMM, split-KV and unsplit attention, a prefix-reuse tail and a cold
prefill) give logits that differ by some error d per logit. Where the reference's lead of its top-1
token over another token is at most 2 d, the error may swap the two (each logit moved by at most d), so
the greedy tokens may part there, and only there: a bookkeeping bug (wrong pages, positions, prefix)
parts them where the lead is real. After a parting the two runs continue different sequences, so
nothing later is compared. Paths that run the same arithmetic per row are compared bit for bit instead,
never through this rule."""

from __future__ import annotations

import sys

import numpy as np


def parting(got, want) -> int | None:
    """The first step at which two token lists of the same length differ (None: they are equal)."""
    assert len(got) == len(want), f"{len(got)} tokens vs {len(want)}"
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)


def check_tokens(got, want, want_rows, err, what: str = "") -> int | None:
    """Greedy tokens ``got`` of one computation against the reference computation's greedy tokens
    ``want`` and its logits rows ``want_rows`` (one per step, same prompt). ``err(j)`` is the most one
    logit of ``got``'s computation may differ from ``want_rows[j]`` (measured, or what a stated tolerance
    allows). Equal, or equal up to a step j where the reference's lead of ``want[j]`` over ``got[j]`` is
    at most ``2 * err(j)``. Returns j (None: equal) and prints a parting."""
    j = parting(got, want)
    if j is None:
        return None
    row = np.asarray(want_rows[j], np.float64)
    assert int(np.argmax(row)) == want[j], f"{what}: the reference's token {want[j]} is not its row's argmax"
    lead, bound = float(row[want[j]] - row[got[j]]), 2 * float(err(j))
    assert lead <= bound, (f"{what}: token {j} is {got[j]}, the reference's {want[j]} leads it by {lead:.4g} "
                           f"> 2 x error {bound:.4g} (got {list(got)}, reference {list(want)})")
    print(f"{what}: parted at token {j} on a near tie (lead {lead:.3g} <= {bound:.3g})", file=sys.stderr)
    return j


def assert_same_pairs(got, want, what: str = "") -> None:
    """Class (a), the counterpart: two greedy runs of the same arithmetic, ``(token, row)`` per step, give
    the same tokens and the same logits bits."""
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)}"
    for i, ((t, r), (t0, r0)) in enumerate(zip(got, want)):
        assert t == t0 and np.asarray(r).tobytes() == np.asarray(r0).tobytes(), f"{what}: step {i} differs"


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_pairs(got, want, tol: float, what: str = "") -> int | None:
    """Two greedy runs with logits, ``(token, row)`` per step, ``want`` the reference. At every step that
    both computed on the same sequence (up to and including a parting) the rows agree within the relative
    tolerance ``tol`` (||row - ref|| / ||ref||), each token is its own row's argmax, and the tokens part
    only by the margin rule at the error measured there (max |row - ref|). Returns the parting step."""
    toks, rows = [t for t, _ in got], [r for _, r in got]
    want_toks, want_rows = [t for t, _ in want], [r for _, r in want]
    j = parting(toks, want_toks)
    for i in range(len(toks) if j is None else j + 1):
        e = rel(rows[i], want_rows[i])
        assert e <= tol, f"{what}: step {i}: logits rel error {e:.3e} > {tol:.1e}"
        assert int(np.argmax(rows[i])) == toks[i], f"{what}: step {i}: token {toks[i]} is not its row's argmax"
    return check_tokens(toks, want_toks, want_rows,
                        lambda i: np.max(np.abs(np.asarray(rows[i], np.float64) - want_rows[i])), what)
