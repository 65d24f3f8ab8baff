"""Prompt lookup (n-gram) drafts: where the sequence's last n tokens occurred before in its own
context (prompt and output), propose the tokens that followed that occurrence.

Output that copies its input (summaries quoting the source, code edits, "repeat this passage")
gets long runs accepted for free: no draft model, no extra device work. Per sequence an index
from each n-gram (n in ``[min_n, max_n]``) to the end of its latest occurrence is kept and
extended with the tokens added since the last call, so a lookup costs O(new tokens), not a scan
of the context. The longest n that matches wins (a longer match predicts better).

Options (``--speculator-option KEY=VALUE``): ``min_n`` (default 1), ``max_n`` (default 4).
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.plugin_api import DraftRequest, Proposer, ProposerContext


class _Index:
    """n-gram -> end (exclusive) of its latest occurrence, for ends indexed so far."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed_to = 0  # every end e < indexed_to is in the index

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index every n-gram ending at e, indexed_to <= e < upto."""
        for e in range(max(self.indexed_to, 1), upto):
            for n in self.sizes:
                if e >= n:
                    self.latest[n][tuple(tokens[e - n : e])] = e
        self.indexed_to = max(self.indexed_to, upto)


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n, self.max_n = self._sizes_of(context.options)
        self._sizes = range(self.max_n, self.min_n - 1, -1)  # longest first
        self._index: dict[int, _Index] = {}

    @classmethod
    def check_options(cls, options: dict[str, str]) -> None:
        cls._sizes_of(options)

    @staticmethod
    def _sizes_of(options: dict[str, str]) -> tuple[int, int]:
        unknown = set(options) - {"min_n", "max_n"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; ngram takes min_n and max_n")
        try:
            min_n, max_n = int(options.get("min_n", 1)), int(options.get("max_n", 4))
        except ValueError:
            raise ValueError(f"min_n and max_n must be integers, got {options}") from None
        if not 1 <= min_n <= max_n <= 64:
            raise ValueError(f"need 1 <= min_n <= max_n <= 64, got min_n={min_n} max_n={max_n}")
        return min_n, max_n

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._one(r) for r in requests]

    def _one(self, request: DraftRequest) -> list[int]:
        tokens = request.token_ids
        length = len(tokens)
        if request.max_drafts <= 0 or length < self.min_n + 1:
            return []
        index = self._index.get(request.seq_id)
        if index is None:
            index = self._index[request.seq_id] = _Index(self._sizes)
        # Occurrences must end before the current suffix's end: index ends up to length - 1.
        index.extend(tokens, length)
        for n in self._sizes:
            if length <= n:
                continue
            end = index.latest[n].get(tuple(tokens[length - n :]))
            if end is not None and end < length:
                return list(tokens[end : end + request.max_drafts])
        return []

    def release(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
