"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown engine option")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a string
        or a list of token ids."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params: need one per prompt, or a single one")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority: need one per prompt")

        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = str(next(self._ids))
                request = self.engine.add_request(
                    rid, prompt, params, priority=priority[i] if priority else 0
                )
                outputs[rid] = RequestOutput(
                    request_id=rid,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=request.prompt_token_ids,
                    logprobs=[] if params.logprobs is not None else None,
                )
                order.append(rid)
            self._run(outputs, use_tqdm)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        return [outputs[rid] for rid in order]

    def _run(self, outputs: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(outputs), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = outputs.get(delta.request_id)
                if out is None:
                    continue
                out.token_ids.extend(delta.new_token_ids)
                out.text += delta.new_text
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                if delta.logprobs and out.logprobs is not None:
                    out.logprobs.extend(delta.logprobs)
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.stop_reason = delta.stop_reason
                    out.num_cached_tokens = delta.num_cached_tokens
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            list(
                tok.apply_chat_template(
                    c, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, **kwargs)
