"""N-gram prompt lookup (vLLM's `ngram`, TGI's n-gram speculation): the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, for the longest n that occurs. Costs
no model: answers that copy their input (code edits, RAG, summaries) accept most proposals.
Pure Python; an index of where each token occurs keeps a lookup to the few candidate places."""

from __future__ import annotations

from collections import defaultdict


class NgramIndex:
    """Where each token of one sequence occurs, extended as the sequence grows."""

    def __init__(self) -> None:
        self.positions: defaultdict[int, list[int]] = defaultdict(list)
        self.indexed = 0

    def propose(self, tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        """Up to `k` tokens continuing `tokens` as they continued the latest earlier occurrence
        of its last n tokens (n from max_n down to min_n); [] when none occurs. `tokens` must
        extend what earlier calls saw."""
        size = len(tokens)
        for at in range(self.indexed, size - 1):  # the last token is the pattern's end
            self.positions[tokens[at]].append(at)
        self.indexed = max(self.indexed, size - 1)
        if size < 2:
            return []
        ends = self.positions.get(tokens[-1], ())
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            pattern = tokens[size - n:]
            for end in reversed(ends):  # the latest occurrence first
                if end >= n - 1 and tokens[end - n + 1:end + 1] == pattern:
                    return tokens[end + 1:end + 1 + k]
        return []


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """One lookup without a kept index (tests, one-off callers)."""
    return NgramIndex().propose(tokens, min_n, max_n, k)
