"""Logit adjustments that depend on a request's own tokens: masks, bias and repetition penalties.

Applied to float32 logits before stop-token suppression and sampling, in the order
``SamplingParams`` documents: tokens outside ``allowed_token_ids`` and those that would complete
a bad word masked, then (the order of transformers' logits processors) ``logit_bias``,
``repetition_penalty`` over prompt and output tokens, then ``frequency_penalty`` and
``presence_penalty`` over output tokens only (OpenAI's definition), on the logits' device (the
index and value tensors are built on the CPU and moved there). Only the rows of requests
that ask for one are touched; the counts are rebuilt each step from the requests' token lists,
so nothing here has state to keep in step with preemption or aborts.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.bad_words import banned_tokens
from engine.request import Request


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits [S, V]`` float32, one row per request; returns a new tensor when any row
    changes, else ``logits`` itself (which stays the raw logits, for logprobs).

    Only the (row, token) entries concerned are read and written: one pass over ``[S, V]`` costs
    about a millisecond at 64 rows, more than the adjustments themselves.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits]
    if not rows:
        return logits
    vocab = logits.shape[1]
    out = logits.clone()
    flat = out.view(-1)

    for i in rows:
        allowed = requests[i].sampling_params.allowed_token_array()
        if allowed.size:
            # The allowed entries kept, every other one -inf (ids were checked against the
            # vocabulary when the request was added).
            index = torch.from_numpy(allowed).to(out.device)
            kept = out[i, index]
            out[i].fill_(float("-inf"))
            out[i, index] = kept
        if requests[i].bad_word_tokens:
            words = banned_tokens(requests[i].bad_word_tokens, requests[i].output_token_ids)
            if words:
                # A tokenizer may know ids past the model's vocabulary: never sampled anyway.
                out[i, [t for t in words if t < vocab]] = float("-inf")

    biased = [i for i in rows if requests[i].sampling_params.logit_bias]
    if biased:
        # Each request's bias as arrays built once (a request may bias hundreds of tokens): the
        # per-step cost is per row, not per entry.
        arrays = [requests[i].sampling_params.logit_bias_arrays() for i in biased]
        tokens = np.concatenate([t for t, _ in arrays])
        index = np.concatenate([t + i * vocab for i, (t, _) in zip(biased, arrays, strict=True)])
        values = np.concatenate([v for _, v in arrays])
        keep = tokens < vocab
        bias = torch.from_numpy(values[keep]).to(device=out.device, dtype=out.dtype)
        flat[torch.from_numpy(index[keep]).to(out.device)] += bias

    repeated = [i for i in rows if requests[i].sampling_params.repetition_penalty != 1.0]
    if repeated:
        which, tokens, _ = distinct_tokens([requests[i].all_token_ids for i in repeated], vocab)
        penalty = _per_row(requests, repeated, "repetition_penalty", out.dtype)[which]
        index = (torch.tensor(repeated)[which] * vocab + tokens).to(out.device)
        penalty = penalty.to(out.device)
        seen = flat[index]
        flat[index] = torch.where(seen > 0, seen / penalty, seen * penalty)

    counted = [
        i
        for i in rows
        if requests[i].output_token_ids
        and (
            requests[i].sampling_params.frequency_penalty
            or requests[i].sampling_params.presence_penalty
        )
    ]
    if counted:
        which, tokens, counts = distinct_tokens(
            [requests[i].output_token_ids for i in counted], vocab
        )
        frequency = _per_row(requests, counted, "frequency_penalty", out.dtype)[which]
        presence = _per_row(requests, counted, "presence_penalty", out.dtype)[which]
        index = (torch.tensor(counted)[which] * vocab + tokens).to(out.device)
        flat[index] -= (frequency * counts.to(out.dtype) + presence).to(out.device)
    return out


def distinct_tokens(
    token_lists: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (list, token) pairs of ``token_lists``, sorted: each pair's list index,
    token id and number of occurrences (int64 tensors of equal length).

    Built through numpy: ``torch.tensor`` of a Python list costs several times ``np.fromiter``
    per element (docs/performance.md, "Figures behind the code"), and 64 long requests hold 10^5
    tokens.
    """
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    tokens = np.fromiter(
        itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum())
    )
    keys = np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab, lengths) + tokens
    distinct, counts = torch.unique(torch.from_numpy(keys), return_counts=True)
    return distinct // vocab, distinct % vocab, counts


def _per_row(
    requests: list[Request], rows: list[int], name: str, dtype: torch.dtype
) -> torch.Tensor:
    return torch.tensor([getattr(requests[i].sampling_params, name) for i in rows], dtype=dtype)
