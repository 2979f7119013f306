"""Prefix state cache (ai00's): states of prompt prefixes, looked up by the longest prefix.

A trie keyed by token: the node reached by tokens ``t[0..L)`` may hold the state after reading
those ``L`` tokens. A lookup walks the prompt down the trie and returns the deepest node holding
a state, so a request resumes there and only the rest of its prompt is computed. The cache is
bounded by the bytes of the states it holds (the serving says how big each is) and drops the
least recently used first; a node left with no state and no children is pruned. Pure logic, no
I/O: one partition's executor thread owns it.

Each batch key of a serving with ``load_key`` has a trie of its own (``key``; "" for every
request of a serving without one): a prefix state is computed by one key's model, so it is
never served to another key's sequence, and ``drop_key`` lets a key's entries go with its
state (stepping/key_loads.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any


class _Node:
    __slots__ = ("children", "depth", "nbytes", "parent", "state", "token")

    def __init__(self, parent: _Node | None, token: Hashable, depth: int) -> None:
        self.parent = parent
        self.token = token
        self.depth = depth
        self.children: dict[Hashable, _Node] = {}
        self.state: Any = None
        self.nbytes = 0


class PrefixCache:
    """Bounded LRU of prefix states, ``capacity`` bytes in all."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"prefix cache capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.nbytes = 0
        self.version = 0  # changes whenever what a lookup can find changes
        self._root = _Node(None, None, 0)  # key ""'s
        self._roots: dict[str, _Node] = {"": self._root}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id(node) -> node, oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> set[str]:
        """The batch keys with a trie (those that held entries since their last drop)."""
        return set(self._roots) - {""}

    def lookup(self, tokens: Sequence[Hashable], key: str = "") -> tuple[int, Any]:
        """(length, state) of ``key``'s longest cached prefix of ``tokens``; (0, None) if none."""
        node = self._roots.get(key)
        if node is None:
            return 0, None
        best: _Node | None = None
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            node = child
            if node.nbytes:
                best = node
        if best is None:
            return 0, None
        self._lru.move_to_end(id(best))
        return best.depth, best.state

    def put(
        self, tokens: Sequence[Hashable], length: int, state: Any, nbytes: int, key: str = ""
    ) -> bool:
        """Keep ``state`` as ``key``'s state after ``tokens[:length]``; False when it cannot be
        kept (larger than the whole cache). A prefix already cached is only marked as recent."""
        if length <= 0 or length > len(tokens):
            raise ValueError(f"prefix length {length} is outside the {len(tokens)} tokens given")
        if nbytes > self.capacity:
            return False
        nbytes = max(1, nbytes)  # a held state is marked by nbytes > 0
        node = self._roots.get(key)
        if node is None:
            node = self._roots[key] = _Node(None, None, 0)
        for token in tokens[:length]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node, token, node.depth + 1)
            node = child
        if node.nbytes:
            self._lru.move_to_end(id(node))
            return True
        node.state, node.nbytes = state, nbytes
        self.version += 1
        self._lru[id(node)] = node
        self.nbytes += nbytes
        while self.nbytes > self.capacity:
            _, oldest = self._lru.popitem(last=False)
            self._drop(oldest)
        return True

    def _drop(self, node: _Node) -> None:
        self.nbytes -= node.nbytes
        node.state, node.nbytes = None, 0
        # Prune the branch up to the first node that still holds a state or other children.
        while node.parent is not None and not node.children and not node.nbytes:
            del node.parent.children[node.token]
            node = node.parent

    def drop_key(self, key: str) -> int:
        """Drop every entry of ``key`` (its state left the partition); how many there were."""
        root = self._roots.pop(key, None) if key else None
        if root is None:
            return 0
        dropped, stack = 0, [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.nbytes:
                del self._lru[id(node)]
                self.nbytes -= node.nbytes
                dropped += 1
        if dropped:
            self.version += 1
        return dropped
