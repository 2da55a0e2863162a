"""prefixserve's in-process continuous-batching engine."""

from engine.block_hash import compute_block_hashes, hash_block_tokens
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputs

__all__ = [
    "LLM",
    "EngineConfig",
    "LLMEngine",
    "Request",
    "RequestDelta",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutputs",
    "compute_block_hashes",
    "hash_block_tokens",
]
