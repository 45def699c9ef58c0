"""The bounded LRU map every voice cache uses."""

import pytest

from token2wav.lru import LRU


def test_put_evicts_the_least_recently_used_and_get_counts_as_use():
    lru = LRU(2)
    assert lru.put("a", 1) == [] and lru.put("b", 2) == []
    assert lru.get("a") == 1  # "b" is now the oldest
    assert lru.put("c", 3) == [("b", 2)]
    assert list(lru) == ["a", "c"] and "b" not in lru and len(lru) == 2
    assert lru.put("a", 4) == [] and lru.get("a") == 4 and list(lru) == ["c", "a"]
    assert lru.pop("c") == 3 and lru.pop("c", "gone") == "gone" and list(lru) == ["a"]
    assert lru.get("missing", "default") == "default"


def test_unbounded_and_bad_bound():
    lru = LRU(None)
    assert all(lru.put(i) == [] for i in range(100)) and len(lru) == 100
    with pytest.raises(ValueError, match="max_items"):
        LRU(0)
