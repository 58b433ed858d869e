"""PairList: an ordered list of (key, value) pairs where keys may repeat, as in DJL."""

from __future__ import annotations


class PairList:
    """Keys and values in insertion order; `get` returns the first value under a key."""

    def __init__(self, keys: list | None = None, values: list | None = None,
                 pair_list: list | None = None, pair_map: dict | None = None) -> None:
        self.keys: list = []
        self.values: list = []
        if keys is not None or values is not None:
            keys, values = list(keys or []), list(values or [])
            if len(keys) != len(values):
                raise ValueError("key value size mismatch.")
            self.keys, self.values = keys, values
        for key, value in list(pair_list or []) + list((pair_map or {}).items()):
            self.add(key, value)

    def add(self, key=None, value=None, index: int | None = None, pair=None) -> None:
        if pair is not None:
            key, value = pair
        # As in DJL: an empty value is not stored, so an empty body leaves the Input empty.
        if not value and value != 0:
            return
        if index is None:
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys.insert(index, key)
            self.values.insert(index, value)

    def add_all(self, other: PairList | None) -> None:
        if other is not None:
            self.keys.extend(other.get_keys())
            self.values.extend(other.get_values())

    def size(self) -> int:
        return len(self.keys)

    def is_empty(self) -> bool:
        return not self.keys

    def get(self, key):
        try:
            return self.values[self.keys.index(key)]
        except ValueError:
            return None

    def key_at(self, index: int):
        return self.keys[index]

    def value_at(self, index: int):
        return self.values[index]

    def get_keys(self) -> list:
        return self.keys

    def get_values(self) -> list:
        return self.values
