"""Token sequences in a radix tree, for the prefix cache's lookup (runtime/prefix_cache.py): the longest
prefix a prompt shares with any kept sequence, and which sequences share it, in one walk down the prompt.

A linear scan costs one comparison per kept sequence, and with shared pages an editor's session keeps one
sequence per keystroke (each a few pages of its own beside the shared file): hundreds of 4096-token
comparisons before every request. The walk costs the same whatever their number.

An edge holds the tokens from its parent to its node; every sequence ends exactly at a node (inserting one
that ends inside an edge splits it), and a node lists the sequences that run through its whole edge, so a
node's sequences include its children's. Removing a sequence prunes the nodes it was the last one through;
edges are not merged back (the tree stays exact, only less compressed)."""

from __future__ import annotations


BLOCK = 256   # tokens compared by one list comparison before the per-token search


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists: block by block with list comparisons (C speed:
    4096 tokens in ~35 us on the CPU, against ~190 us converting both to arrays), then token by token inside the
    first block that differs."""
    n = min(len(a), len(b))
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        if a[lo:hi] != b[lo:hi]:
            return next(i for i in range(lo, hi) if a[i] != b[i])
    return n


class _Node:
    __slots__ = ("edge", "children", "keys")

    def __init__(self, edge: list[int], keys: set):
        self.edge = edge                        # the tokens from the parent to this node
        self.children: dict[int, _Node] = {}    # by the first token of their edge
        self.keys = keys                        # the sequences that run through this whole edge


def _agree(edge: list[int], seq: list[int], at: int) -> int:
    """How many of ``edge``'s tokens ``seq`` repeats from position ``at`` (a list comparison first: an
    edge is usually matched whole)."""
    piece = seq[at:at + len(edge)]
    return len(edge) if piece == edge else common_prefix(edge, piece)


class TokenTrie:
    def __init__(self):
        self.root = _Node([], set())

    def insert(self, key, tokens: list[int]) -> None:
        """Add sequence ``key`` (non-empty ``tokens``; keys are unique)."""
        node, at = self.root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                node.children[tokens[at]] = _Node(list(tokens[at:]), {key})
                return
            m = _agree(child.edge, tokens, at)
            if m < len(child.edge):
                child = self._split(node, child, m)
            child.keys.add(key)
            node, at = child, at + m

    def remove(self, key, tokens: list[int]) -> None:
        """Drop sequence ``key``, inserted with these ``tokens``."""
        node, at = self.root, 0
        while at < len(tokens):
            child = node.children[tokens[at]]
            child.keys.discard(key)
            if not child.keys:                  # nobody else below: the whole branch goes
                del node.children[tokens[at]]
                return
            node, at = child, at + len(child.edge)

    def longest(self, prompt: list[int]) -> tuple[int, set]:
        """(n, keys): the most tokens n that ``prompt`` shares with a sequence, and the sequences that
        share exactly n (an empty set when n is 0). Every one of them runs through the node where the
        walk stops, and none runs on with the prompt's next token, or the walk would have gone on."""
        node, at = self.root, 0
        while at < len(prompt):
            child = node.children.get(prompt[at])
            if child is None:
                break
            m = _agree(child.edge, prompt, at)
            node, at = child, at + m
            if m < len(child.edge):
                break
        return at, (node.keys if at else set())

    @staticmethod
    def _split(parent: _Node, child: _Node, m: int) -> _Node:
        """Cut ``child``'s edge after ``m`` tokens: a new node takes the first m (and child's sequences,
        which all run through them), with child below it."""
        head = _Node(child.edge[:m], set(child.keys))
        child.edge = child.edge[m:]
        head.children[child.edge[0]] = child
        parent.children[head.edge[0]] = head
        return head
