"""Token-mask cost of the grammar libraries on a model's vocabulary (docs/structured_output.md).

    python -m benchmarks.grammar_libraries                 # llguidance (a dependency)
    python -m benchmarks.grammar_libraries --xgrammar-path DIR   # also xgrammar, from DIR

Walks one compact JSON document through a four-field schema token by token, timing the mask
of each step. xgrammar is not a dependency (it pulls triton); install it aside with
``pip install --no-deps --target DIR xgrammar apache-tvm-ffi`` to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "ok": True}


def summary(name: str, index_s: float, compile_s: float, steps: list[float]) -> dict[str, Any]:
    out = {
        "library": name,
        "index_vocab_ms": round(index_s * 1e3, 1),
        "compile_ms": round(compile_s * 1e3, 2),
        "mask_us_mean": round(statistics.mean(steps) * 1e6, 1),
        "mask_us_median": round(statistics.median(steps) * 1e6, 1),
        "mask_us_max": round(max(steps) * 1e6, 1),
        "steps": len(steps),
    }
    print(json.dumps(out), flush=True)
    return out


def run_llguidance(tokenizer: Any, vocab: int, ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf

    from engine.structured_output import JSON_OPTIONS

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    t2 = time.perf_counter()
    mask = np.empty((vocab + 31) // 32, dtype=np.int32)
    steps = []
    for t in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        steps.append(time.perf_counter() - start)
        if not matcher.consume_token(t):
            raise RuntimeError(matcher.get_error())
    return summary(f"llguidance {llguidance.__version__}", t1 - t0, t2 - t1, steps)


def run_xgrammar(tokenizer: Any, vocab: int, ids: list[int]) -> dict[str, Any]:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    t1 = time.perf_counter()
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    t2 = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    steps = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        steps.append(time.perf_counter() - start)
        if not matcher.accept_token(t):
            raise RuntimeError(f"xgrammar rejected token {t}")
    return summary("xgrammar", t1 - t0, t2 - t1, steps)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--xgrammar-path", default=None, help="a directory holding xgrammar")
    args = ap.parse_args(argv)

    from engine.model.config import model_config_from_hf
    from engine.model.loader import load_hf_config, load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    vocab = model_config_from_hf(*load_hf_config(model_dir)).vocab_size
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    results = [run_llguidance(tokenizer, vocab, ids)]
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
        results.append(run_xgrammar(tokenizer, vocab, ids))
    return results


if __name__ == "__main__":
    main()
