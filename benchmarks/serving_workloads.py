"""The workloads of ``benchmarks.compare_serving``, as arguments for vLLM's serving benchmark.

``random`` and ``prefix_repetition`` are vLLM's own datasets. ``multi_turn`` is a chat workload
written here as a JSONL file for vLLM's ``custom`` dataset (``{"prompt", "output_tokens"}`` per
line, sent in file order with ``--disable-shuffle``): each conversation's turn ``k`` sends the
whole conversation so far as one user message, ``turn k-1's prompt + a fixed synthetic answer +
a new question``, so every turn's prompt extends the previous one and a prefix cache can reuse it.
The answer is synthetic, not what the server generated, so the server's KV for its own answer is
not reused (only the previous prompt is). With SmolLM2's tokenizer a first turn is ~130 tokens
and each turn adds ~135 (the sixth is ~800). Turns go out in rounds (turn 0 of every
conversation, then turn 1, ...) and each round in conversation order, so turn k+1 of a
conversation is sent only after ``num_conversations - concurrency`` requests sent after its turn
k have started: its previous turn has usually, not always, finished by then (like a user who
answers quickly); with fewer conversations than the concurrency (smoke runs), turns of one
conversation can overlap.
``--skip-chat-template`` leaves the chat template to the server (the client would otherwise apply
it to the text and the server again).

Everything here is pure and deterministic for its arguments (seeded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.client import synthetic_text
from benchmarks.workloads import DEFAULT_VOCAB_SIZE, safe_id_range

WORKLOAD_NAMES = ("random", "prefix_repetition", "multi_turn")


@dataclass(frozen=True)
class ChatTurn:
    """One request of the multi-turn workload: ``prompt`` is the conversation so far."""

    conversation: int
    turn: int
    prompt: str
    output_tokens: int


def _words(rng: np.random.Generator, n: int) -> str:
    low, high = safe_id_range(DEFAULT_VOCAB_SIZE)
    return synthetic_text(rng.integers(low, high, size=n).tolist())


def multi_turn_requests(
    *,
    num_conversations: int = 16,
    turns: int = 6,
    first_words: int = 48,
    answer_words: int = 32,
    question_words: int = 16,
    output_len_min: int = 32,
    output_len_max: int = 64,
    seed: int = 0,
) -> list[ChatTurn]:
    """``num_conversations`` x ``turns`` requests in send order (by turn, then conversation).

    A conversation's first prompt is ``User: <first_words words>``; turn ``k > 0`` appends
    ``\\nAssistant: <answer_words words>\\nUser: <question_words words>`` to turn ``k-1``'s prompt.
    Words are synthetic (``benchmarks.client.synthetic_text``; a few tokens each). Output lengths
    are uniform in ``[output_len_min, output_len_max]``.
    """
    for name, value in (
        ("num_conversations", num_conversations),
        ("turns", turns),
        ("first_words", first_words),
        ("answer_words", answer_words),
        ("question_words", question_words),
        ("output_len_min", output_len_min),
    ):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if output_len_max < output_len_min:
        raise ValueError("output_len_max must be >= output_len_min")
    rng = np.random.default_rng(seed)
    by_conversation: list[list[ChatTurn]] = []
    for c in range(num_conversations):
        prompt = f"User: {_words(rng, first_words)}"
        conversation = []
        for t in range(turns):
            if t:
                prompt += f"\nAssistant: {_words(rng, answer_words)}"
                prompt += f"\nUser: {_words(rng, question_words)}"
            out = int(rng.integers(output_len_min, output_len_max + 1))
            conversation.append(ChatTurn(c, t, prompt, out))
        by_conversation.append(conversation)
    return [conv[t] for t in range(turns) for conv in by_conversation]


def write_custom_jsonl(requests: list[ChatTurn], path: Path) -> Path:
    """The requests as vLLM's ``custom`` dataset reads them (extra keys are ignored)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record = {
                "prompt": r.prompt,
                "output_tokens": r.output_tokens,
                "conversation": r.conversation,
                "turn": r.turn,
            }
            f.write(json.dumps(record) + "\n")
    return path


def scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def workload_args(name: str, data_dir: Path, scale: float = 1.0) -> list[str]:
    """vLLM ``bench serve`` arguments of one workload; ``scale`` shrinks the number of prompts
    (conversations for ``multi_turn``) for smoke runs, keeping lengths; the concurrency is
    capped at the number of prompts."""
    if name == "random":
        n = scaled(64, scale)
        return [
            *("--backend", "openai", "--endpoint", "/v1/completions"),
            *("--dataset-name", "random", "--random-input-len", "100"),
            *("--random-output-len", "128", "--num-prompts", str(n)),
            *("--max-concurrency", str(min(32, n)), "--ignore-eos"),
        ]
    if name == "prefix_repetition":
        n = scaled(96, scale)
        return [
            *("--backend", "openai", "--endpoint", "/v1/completions"),
            *("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512"),
            *("--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "8"),
            *("--prefix-repetition-output-len", "32", "--num-prompts", str(n)),
            *("--max-concurrency", str(min(8, n)), "--ignore-eos"),
        ]
    if name == "multi_turn":
        requests = multi_turn_requests(num_conversations=scaled(16, scale))
        path = write_custom_jsonl(requests, data_dir / "multi_turn.jsonl")
        return [
            *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
            *("--dataset-name", "custom", "--dataset-path", str(path)),
            *("--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle"),
            *("--num-prompts", str(len(requests)), "--no-oversample"),
            *("--max-concurrency", str(min(8, len(requests))), "--ignore-eos"),
        ]
    raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOAD_NAMES)}")


# Before each server's measured runs, identical for both: a few short requests through each
# endpoint (their prompts share nothing with the workloads').
WARMUPS: dict[str, list[str]] = {
    "warmup_completions": [
        *("--backend", "openai", "--endpoint", "/v1/completions", "--dataset-name", "random"),
        *("--random-input-len", "32", "--random-output-len", "16", "--num-prompts", "4"),
        *("--max-concurrency", "4", "--ignore-eos", "--seed", "12345"),
    ],
    "warmup_chat": [
        *("--backend", "openai-chat", "--endpoint", "/v1/chat/completions"),
        *("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16"),
        *("--num-prompts", "4", "--max-concurrency", "4", "--ignore-eos", "--seed", "54321"),
    ],
}
