"""The request state machine and its derived quantities."""

from __future__ import annotations

import itertools

import pytest

from engine.block_hash import compute_block_hashes, hash_root
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

S = RequestStatus
LEGAL = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.RUNNING, S.PREEMPTED),
    (S.RUNNING, S.FINISHED_STOPPED),
    (S.RUNNING, S.FINISHED_LENGTH),
    (S.RUNNING, S.FINISHED_ABORTED),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.FINISHED_ABORTED),
    # A deadline missed before the first token (the scheduler's early rejection).
    (S.WAITING, S.FINISHED_REJECTED),
    (S.PREEMPTED, S.FINISHED_REJECTED),
    # Its last token arrived after an overlapped step's plan preempted it.
    (S.PREEMPTED, S.FINISHED_STOPPED),
    (S.PREEMPTED, S.FINISHED_LENGTH),
    # A planned admission withdrawn before its step ran (its leader left the plan).
    (S.RUNNING, S.WAITING),
}
# A path from WAITING to each state, through legal transitions only.
PATHS = {
    S.WAITING: [],
    S.RUNNING: [S.RUNNING],
    S.PREEMPTED: [S.RUNNING, S.PREEMPTED],
    S.FINISHED_STOPPED: [S.RUNNING, S.FINISHED_STOPPED],
    S.FINISHED_LENGTH: [S.RUNNING, S.FINISHED_LENGTH],
    S.FINISHED_ABORTED: [S.FINISHED_ABORTED],
    S.FINISHED_REJECTED: [S.FINISHED_REJECTED],
}


def make_request(tokens: list[int] | None = None, block_size: int = 4) -> Request:
    return Request(
        "r", tokens or [1, 2, 3], SamplingParams(), block_size=block_size, hash_root=hash_root("s")
    )


def request_in(status: RequestStatus) -> Request:
    request = make_request()
    for step in PATHS[status]:
        request.set_status(step)
    assert request.status == status
    return request


@pytest.mark.parametrize("src, dst", sorted(LEGAL))
def test_legal_transitions(src, dst):
    request = request_in(src)
    request.set_status(dst)
    assert request.status == dst


@pytest.mark.parametrize(
    "src, dst", sorted(set(itertools.product(S, S)) - LEGAL), ids=lambda s: s.name
)
def test_illegal_transitions_raise(src, dst):
    request = request_in(src)
    with pytest.raises(RuntimeError, match=f"{src.name} -> {dst.name}"):
        request.set_status(dst)
    assert request.status == src


def test_finish_reasons():
    assert [s.finish_reason for s in S] == [None, None, None, "stop", "length", "abort", "rejected"]
    assert [s.is_finished for s in S] == [False, False, False, True, True, True, True]
    assert request_in(S.FINISHED_LENGTH).finish_reason == "length"


def test_output_tokens_extend_the_sequence_and_its_block_hashes():
    request = make_request([1, 2, 3], block_size=4)
    assert request.num_tokens == 3 and request.block_hashes == []
    assert request.num_cached_tokens == -1
    request.append_output_token(9)
    assert request.all_token_ids == [1, 2, 3, 9]
    assert request.output_token_ids == [9]
    assert request.prompt_token_ids == [1, 2, 3]
    assert (request.num_prompt_tokens, request.num_output_tokens) == (3, 1)
    assert request.block_hashes == compute_block_hashes([1, 2, 3, 9], 4, hash_root("s"))
    for t in (10, 11, 12, 13):
        request.append_output_token(t)
    assert request.block_hashes == compute_block_hashes(
        [1, 2, 3, 9, 10, 11, 12, 13], 4, hash_root("s")
    )


def test_prompt_list_is_copied():
    tokens = [1, 2, 3]
    request = make_request(tokens)
    request.append_output_token(4)
    assert tokens == [1, 2, 3]
