"""Top tables: the k most likely tokens of a position plus the one actually there, in one
total order (value, then lower token id). Reported values are always the raw log-softmax of
the logits in float32, before any penalty, bias, temperature, top-k or top-p, and a token's
value in its table is the very float reported for it elsewhere."""
from __future__ import annotations

import base64

import numpy as np
import torch

from ..protocol import finite_or_none


def top_tables(lp: torch.Tensor, chosen: list[int], k: int) -> list[list[tuple[int, float]]]:
    """For each row of lp (positions x vocab): the k most likely ids plus the chosen one,
    sorted most likely first, ties broken by lower token id. Values are lp's own floats, so
    the chosen token's value here is identical to its value anywhere else it is reported."""
    chosen_vals = lp[torch.arange(lp.shape[0]), torch.tensor(chosen)].tolist()
    return [with_chosen(pairs, c, v) for pairs, c, v in zip(top_lists(lp, k), chosen, chosen_vals)]


def top_lists(lp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k most likely (id, value), most likely first, ties broken by lower id: the
    first k of the row's total order, so the first j < k of them are its top j."""
    rows = lp.shape[0]
    if k == 0:
        return [[] for _ in range(rows)]
    if k == 1:  # max along a row returns its first maximum: the lowest id among ties
        v, i = torch.max(lp, dim=-1)
        return [[(a, b)] for a, b in zip(i.tolist(), v.tolist())]
    # torch.topk does not promise an order among equal values, nor which of several entries
    # tied at the k-th value it keeps. Taking k+1 shows where that can matter: a row whose
    # (k+1)-th value equals its k-th has a tie across the cut and is redone exactly; in any
    # other row the top k are exactly the entries >= the k-th value.
    width = min(k + 1, lp.shape[-1])
    kv, ki = torch.topk(lp, width, dim=-1)
    kth = kv[:, k - 1:k]
    ties = (kv[:, -1] == kv[:, k - 1]).tolist() if width > k else [False] * rows
    kv_l, ki_l = kv[:, :k].tolist(), ki[:, :k].tolist()
    lists = []
    for r in range(rows):
        if ties[r]:
            cand = torch.nonzero(lp[r] >= kth[r, 0]).flatten().tolist()
            vals = lp[r, cand].tolist()
            lists.append(sorted(zip(cand, vals), key=lambda p: (-p[1], p[0]))[:k])
        else:
            lists.append(sorted(zip(ki_l[r], kv_l[r]), key=lambda p: (-p[1], p[0])))
    return lists


def with_chosen(pairs: list[tuple[int, float]], chosen: int, value: float) -> list[tuple[int, float]]:
    """A top list with the chosen id added where it is not already among them."""
    if any(i == chosen for i, _ in pairs):
        return list(pairs)
    return sorted([*pairs, (chosen, value)], key=lambda p: (-p[1], p[0]))


def row_reports(lp: torch.Tensor, distribution: bool, score_ids: tuple[int, ...]) -> list[dict] | None:
    """What each row of lp (positions x vocab) reports beyond its value and table, when the
    request asked: `dist`, the whole row as little-endian float32 in base64, and `scores`, the
    values of `score_ids` in their order (null where a value is not finite, as everywhere). Both
    are lp's own floats, so each equals the same token's value in a table or as the chosen one."""
    if not distribution and not score_ids:
        return None
    out: list[dict] = [{} for _ in range(lp.shape[0])]
    if distribution:
        raw = np.ascontiguousarray(lp.detach().to(torch.float32).numpy(), dtype="<f4")
        for r, e in enumerate(out):
            e["dist"] = base64.b64encode(raw[r].tobytes()).decode("ascii")
    if score_ids:
        vals = lp[:, torch.tensor(score_ids)].tolist()
        for e, row in zip(out, vals):
            e["scores"] = [finite_or_none(v) for v in row]
    return out
