"""Turning a step's logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request
seeds, after the penalties of ``engine.penalties``.

Each row draws exactly from its ``p``, with its request's own generator when the request has a
seed, so that a seeded request's tokens do not depend on what else shares the batch. On CPU a
row takes one uniform and inverts its cumulative distribution (``cdf_draw``); on other devices
the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), whose noise a device draws for
the whole batch at once. Logprobs are those of the model's raw distribution (before penalties,
temperature and filters), as OpenAI and vLLM report them.

Everything runs on the logits' device; the only copies to the host are the sampled ids and the
logprob values asked for. On a non-CPU device seeded requests draw their noise from their own
CPU generator, moved to the device row by row, and the other rows draw theirs from one device
generator seeded with the engine's seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import native
from engine.outputs import TokenLogprobs
from engine.penalties import apply_penalties
from engine.request import Request
from engine.structured_output import apply_token_masks

__all__ = [
    "Sampler",
    "SamplerOutput",
    "TokenLogprobs",
    "cdf_draw",
    "device_noise",
    "token_logprobs",
]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i's log-probability of ``tokens[i]`` and its ``ks[i]`` most likely tokens, from
    ``logits [R, V]`` (raw: no penalty or temperature applied)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    top_ids: list[list[int]] = []
    top_vals: list[list[float]] = []
    if k:
        vals, ids = lp.topk(k, dim=-1)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    return [
        TokenLogprobs(
            tokens[row],
            chosen[row],
            list(zip(top_ids[row][:n], top_vals[row][:n], strict=True)) if n else [],
        )
        for row, n in enumerate(ks)
    ]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        # Per non-CPU device, the generator of unseeded rows' noise (made on first use).
        self.device_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """``logits [S, V]`` (any float dtype), one row per request, in the same order. Rows of
        requests with a grammar are masked to the tokens it allows (in place, unless a request
        wants logprobs, which come from the unmasked distribution); other rows cost nothing."""
        unmasked = logits
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            if any(r.sampling_params.logprobs is not None for r in requests):
                logits = logits.clone()
            apply_token_masks(logits, constrained, [requests[i].grammar for i in constrained])
        if self._plain_greedy(requests):
            # Greedy without logprobs, penalties or banned tokens: the argmax of the model-dtype
            # logits is the argmax of their float32 copy (the conversion is exact): no copy.
            if logits.device.type == "cpu":
                tokens = native.argmax_rows(logits)
            else:
                tokens = logits.argmax(dim=-1)
            return SamplerOutput(tokens.tolist(), [None] * len(requests))
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        raw = logits if unmasked is logits else unmasked.float()
        logits = self._suppress_stops(apply_penalties(logits, requests), requests)

        greedy = [p.greedy for p in params]
        tokens = logits.argmax(dim=-1) if all(greedy) else self._sample(logits, requests, greedy)

        token_list = tokens.tolist()
        out_logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            entries = token_logprobs(
                raw[wanted],
                [token_list[i] for i in wanted],
                [params[i].logprobs or 0 for i in wanted],
            )
            for i, entry in zip(wanted, entries, strict=True):
                out_logprobs[i] = entry
        return SamplerOutput(token_list, out_logprobs)

    @staticmethod
    def _plain_greedy(requests: list[Request]) -> bool:
        for r in requests:
            p = r.sampling_params
            if not p.greedy or p.logprobs is not None or p.adjusts_logits:
                return False
            if r.num_output_tokens < p.min_tokens and (p.stop_token_ids or not p.ignore_eos):
                return False
        return True

    @staticmethod
    def _suppress_stops(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Before ``min_tokens``, EOS and stop tokens cannot be sampled."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned |= r.eos_token_ids
                for t in banned:
                    if t < logits.shape[1]:
                        rows.append(i)
                        cols.append(t)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]
    ) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        greedy_tokens = logits.argmax(dim=-1)
        temps = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device=dev
        )
        x = logits / temps[:, None]

        vocab = x.shape[1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            kmax = max(top_ks)
            kth = x.topk(kmax, dim=-1).values
            idx = torch.tensor(top_ks, device=dev)[:, None] - 1
            threshold = kth.gather(1, idx)
            x = x.masked_fill(x < threshold, float("-inf"))

        if any(p.top_p < 1.0 for p in params):
            top_ps = torch.tensor([p.top_p for p in params], device=dev)
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(dim=-1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop = (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, sorted_x)

        probs = x.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_ps = torch.tensor([p.min_p for p in params], device=dev)
            # The most likely token always stays (its probability is the maximum).
            floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        tokens = self._draw(probs, requests)
        greedy_mask = torch.tensor(greedy, device=dev)
        return torch.where(greedy_mask, greedy_tokens, tokens)

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of ``probs``, drawn with the row's request's own generator where it
        has a seed, the sampler's otherwise. On CPU by inverse transform (one uniform per row,
        ``cdf_draw``); elsewhere as the argmax of ``probs`` over Exp(1) noise, which a device
        draws for the whole batch at once."""
        if probs.device.type == "cpu":
            u = torch.empty(len(requests), 1, dtype=torch.float64)
            for i, r in enumerate(requests):
                u[i].uniform_(generator=r.generator if r.generator is not None else self.generator)
            return cdf_draw(probs, u)
        noise = device_noise(probs, requests, self._device_generator(probs.device))
        return (probs / noise).argmax(dim=-1)

    def _device_generator(self, device: torch.device) -> torch.Generator:
        gen = self.device_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            self.device_generators[device] = gen
        return gen


def cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds ``u[i]`` (in [0, 1), shape
    ``[rows, 1]``) times the row's total, summed in float64. A token of probability 0 is never
    drawn. One uniform per row: noise for every vocabulary entry (an Exp(1) race) made sampling
    a third of a CPU decode step (docs/performance.md, item 30)."""
    cdf = probs.double().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    idx = idx.clamp_(max=probs.shape[1] - 1)
    # Only where u * total rounded up to the total: take the row's last token with mass.
    empty = probs.gather(1, idx) <= 0
    if bool(empty.any()):
        last = probs.shape[1] - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(-1, keepdim=True)
        idx = torch.where(empty, last, idx)
    return idx.squeeze(1)


def device_noise(
    probs: torch.Tensor, requests: list[Request], generator: torch.Generator
) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs`` (on its device): every row from ``generator`` (of
    that device), then each seeded request's row replaced by one drawn from its own CPU
    generator, so that its tokens do not depend on the device's stream or its batch."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, r in enumerate(requests):
        if r.generator is not None:
            row = torch.empty(probs.shape[1], dtype=probs.dtype)
            row.exponential_(generator=r.generator)
            noise[i].copy_(row, non_blocking=True)
    return noise
