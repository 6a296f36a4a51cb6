"""The prefix cache's radix tree (runtime/token_trie.py) against a brute-force scan: after any stream of inserts
and removals of sequences over a small alphabet (so that they share prefixes, end inside each other's edges and
repeat one another), a prompt's longest shared prefix and the set of sequences sharing exactly that much are the
scan's, and no node outlives the last sequence through it. Its common_prefix against a token-by-token loop, on
either side of a block boundary."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from nanoqwen.runtime.token_trie import BLOCK, TokenTrie, common_prefix

seqs = st.lists(st.integers(0, 2), min_size=1, max_size=10)
ops = st.lists(st.tuples(st.booleans(), seqs, st.integers(0, 30)), min_size=1, max_size=40)


def naive_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def scan(kept: dict, prompt: list[int]) -> tuple[int, set]:
    n = max((naive_prefix(t, prompt) for t in kept.values()), default=0)
    return n, ({k for k, t in kept.items() if naive_prefix(t, prompt) == n} if n else set())


LONG = 3 * BLOCK + 3


@given(st.integers(0, LONG), st.integers(0, LONG), st.integers(0, LONG), st.booleans())
@example(LONG, LONG, BLOCK - 1, True)
@example(LONG, LONG, BLOCK, True)
@example(LONG, LONG, 2 * BLOCK + 1, True)
@example(2 * BLOCK, LONG, 0, False)
def test_common_prefix_is_the_first_difference(length, other, at, change):
    """Block by block, then token by token: the first position where the lists differ or one ends, on either side
    of a block boundary."""
    a = [i % 5 for i in range(length)]
    b = a[:other] + [9] * max(0, other - length)   # a's first tokens, or a and then others
    if change and at < len(b):
        b[at] = 7
    assert common_prefix(a, b) == common_prefix(b, a) == naive_prefix(a, b)


def nodes(node):
    yield node
    for child in node.children.values():
        yield from nodes(child)


@given(ops, st.lists(seqs, min_size=1, max_size=8))
def test_longest_is_the_scans(stream, prompts):
    trie, kept = TokenTrie(), {}
    for key, (add, tokens, pick) in enumerate(stream):
        if add or not kept:
            trie.insert(key, tokens)
            kept[key] = tokens
        else:
            gone = sorted(kept)[pick % len(kept)]
            trie.remove(gone, kept.pop(gone))
        for prompt in prompts + list(kept.values()):
            n, keys = trie.longest(prompt)
            assert (n, set(keys)) == scan(kept, prompt), prompt
        below = list(nodes(trie.root))[1:]
        assert all(node.keys and node.edge for node in below)          # pruned, no empty edges
        assert set().union(*(node.keys for node in below)) == set(kept)


def test_an_editor_session_walks_once_whatever_the_kept_count():
    """Keystroke re-requests: 500 sequences sharing a 4000-token file and parting near the end. The walk
    visits a handful of nodes, and the longest match is the last keystroke's."""
    trie, file = TokenTrie(), list(range(4000))
    for key in range(500):
        trie.insert(key, file + [key, 7, 7, 7])
    n, keys = trie.longest(file + [499, 7, 7, 8])
    assert n == 4003 and keys == {499}
    (shared,) = trie.root.children.values()
    assert len(shared.edge) == 4000 and len(shared.children) == 500 and len(list(nodes(trie.root))) == 502
