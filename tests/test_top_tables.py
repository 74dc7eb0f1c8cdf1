"""Top tables against their definition: the k most likely ids, most likely first, ties broken by
the lower id, plus the chosen id if it is not among them. Checked on rows built to tie across
the cut, inside the top k, and at the chosen token, against a brute-force sort of every entry."""
from __future__ import annotations

import random

import torch

from probity.engine.tables import top_tables


def brute(row: torch.Tensor, chosen: int, k: int) -> list[tuple[int, float]]:
    vals = row.tolist()
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]
    if chosen not in order:
        order.append(chosen)
        order.sort(key=lambda i: (-vals[i], i))
    return [(i, vals[i]) for i in order]


def test_top_tables_match_a_full_sort_with_ties_anywhere():
    rng = random.Random(7)
    rows, chosen, ks = [], [], []
    for _ in range(300):
        v = rng.choice([5, 40, 300])
        row = torch.randn(v, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        k = rng.choice([1, 2, 3, 5, 32])
        top = torch.sort(row, descending=True).values
        kind = rng.random()
        if kind < 0.3 and v > k + 2:     # ties across the cut: the k-th value repeated outside
            cut = top[min(k - 1, v - 1)]
            for i in rng.sample(range(v), 3):
                row[i] = cut
        elif kind < 0.5:                 # many exact ties, quantized values
            row = torch.round(row * 2) / 2
        elif kind < 0.6:                 # all equal
            row = torch.zeros(v)
        rows.append(row)
        chosen.append(rng.randrange(v))
        ks.append(k)
    for row, c, k in zip(rows, chosen, ks):
        got = top_tables(row.unsqueeze(0), [c], k)[0]
        assert got == brute(row, c, k), (k, row.tolist(), c)


def test_top_tables_of_vocabulary_wide_rows_tied_at_the_top():
    """Rows as wide as a real vocabulary, whose maximum is repeated at random places: a top-1
    table names the lowest of the tied ids (the vectorized path over long rows), top-2 both."""
    rng = random.Random(11)
    rows = torch.round(torch.randn(12, 49152, generator=torch.Generator().manual_seed(3)) * 4) / 4
    for r in range(rows.shape[0]):
        for i in rng.sample(range(49152), 3):
            rows[r, i] = 9.0
    chosen = [rng.randrange(49152) for _ in range(rows.shape[0])]
    for k in (1, 2):
        got = top_tables(rows, chosen, k)
        assert got == [brute(row, c, k) for row, c in zip(rows, chosen)]
