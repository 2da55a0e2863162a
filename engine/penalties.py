"""Logit adjustments that depend on a request's own tokens: bias and repetition penalties.

Applied to float32 logits before stop-token suppression and sampling, in the order
``SamplingParams`` documents (the order of transformers' logits processors): ``logit_bias``,
``repetition_penalty`` over prompt and output tokens, then ``frequency_penalty`` and
``presence_penalty`` over output tokens only (OpenAI's definition). Only the rows of requests
that ask for one are touched; the counts are rebuilt each step from the requests' token lists,
so nothing here has state to keep in step with preemption or aborts.
"""

from __future__ import annotations

import torch

from engine.request import Request


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits [S, V]`` float32, one row per request; returns a new tensor when any row
    changes, else ``logits`` itself."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    chosen = [requests[i] for i in rows]
    params = [r.sampling_params for r in chosen]
    x = logits[rows]

    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            if token < vocab:
                bias_rows.append(row)
                bias_cols.append(token)
                bias_vals.append(float(bias))
    if bias_rows:
        x.index_put_(
            (torch.tensor(bias_rows), torch.tensor(bias_cols)),
            torch.tensor(bias_vals, dtype=x.dtype),
            accumulate=True,
        )

    if any(p.repetition_penalty != 1.0 for p in params):
        seen = token_counts([r.all_token_ids for r in chosen], vocab) > 0
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)

    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = token_counts([r.output_token_ids for r in chosen], vocab)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype)[:, None]
        x = x - freq * counts - pres * (counts > 0).to(x.dtype)

    logits[rows] = x
    return logits


def token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32: how often each token id occurs in each list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab)
    if width == 0:
        return counts
    # Padding adds a weight of 0 to column 0.
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_lists], dtype=torch.int64)
    weights = torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in token_lists])
    return counts.scatter_add_(1, ids, weights)
