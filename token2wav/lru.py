"""The one bounded least-recently-used map, used by every voice cache of the stack."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any


class LRU:
    """A map that keeps at most `max_items` entries (None: no bound), forgetting the least
    recently used first. `get` and `put` count as use; `put` returns what it evicted."""

    def __init__(self, max_items: int | None):
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items: {max_items}, want >= 1")
        self.max_items = max_items
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Hashable]:
        """Keys, least recently used first."""
        return iter(list(self._items))

    def get(self, key: Hashable, default: Any = None) -> Any:
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: Hashable, value: Any = None) -> list[tuple[Hashable, Any]]:
        self._items[key] = value
        self._items.move_to_end(key)
        evicted = []
        while self.max_items is not None and len(self._items) > self.max_items:
            evicted.append(self._items.popitem(last=False))
        return evicted

    def pop(self, key: Hashable, default: Any = None) -> Any:
        return self._items.pop(key, default)
