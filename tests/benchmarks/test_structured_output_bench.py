"""The structured-output benchmark runs end to end on a tiny model and compares like with like:
both runs produce every token, and the constrained requests follow the schema."""

from __future__ import annotations

from pathlib import Path

from benchmarks import structured_output


def test_benchmark_reports_both_runs(tiny_llama_with_tokenizer: Path) -> None:
    results = structured_output.main(
        [
            "--model",
            str(tiny_llama_with_tokenizer),
            "--dtype",
            "float32",
            "--num-prompts",
            "4",
            "--repeat",
            "1",
            "--threads",
            "1",
        ]
    )
    assert results["none"]["tok_s_best"] > 0 and results["json_schema"]["tok_s_best"] > 0
    assert results["median_ratio"] > 0
    # The constrained run did mask rows (the instrument saw every masked batch).
    assert len(results["mask_ms_per_masked_step"]) == 1 and results["mask_share_of_wall"][0] > 0
