"""Safety settings that need no cluster: checkpoint code never runs, the server binds loopback
by default, the API key's sources, and the limits' validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.config import AppArgs, LimitsArgs
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_hf_config, load_tokenizer
from tests.helpers import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "router", "deployments", "benchmarks")

# Module code a malicious checkpoint ships: importing it leaves a marker file behind (at an
# absolute path: transformers imports such code from a copy in its modules cache).
PAYLOAD = """
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaConfig, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil-llama"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_no_source_enables_trust_remote_code() -> None:
    """Every ``trust_remote_code`` in the packages, as a keyword or a dict key, is a literal
    False."""
    setting = re.compile(r"""(trust_remote_code\s*=|["']trust_remote_code["']\s*:)\s*(\w+)""")
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for m in setting.finditer(path.read_text())
        if m.group(2) != "False"
    ]
    assert offenders == []
    assert setting.search("AutoConfig.from_pretrained(p, trust_remote_code=True)")
    assert setting.search("kwargs = {'trust_remote_code': flag}").group(2) == "flag"


def remote_code_checkpoint(tmp: Path, source: Path, model_type: str) -> Path:
    """A copy of a tiny checkpoint whose config and tokenizer ask for code shipped with it."""
    path = tmp / f"remote-{model_type}"
    path.mkdir()
    for f in source.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    (path / "evil.py").write_text(PAYLOAD.format(marker=str(path / "EXECUTED")))
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
    }
    (path / "config.json").write_text(json.dumps(config))
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    tok_config["tokenizer_class"] = "EvilTokenizer"
    tok_config_path.write_text(json.dumps(tok_config))
    return path


@pytest.fixture(scope="module")
def tokenized_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny"), vocab_size=49152, tokenizer_from=smollm2_dir
    )


def test_checkpoint_code_of_a_known_architecture_is_ignored(
    tmp_path: Path, tokenized_checkpoint: Path
) -> None:
    path = remote_code_checkpoint(tmp_path, tokenized_checkpoint, "llama")
    hf_config, _ = load_hf_config(path)
    assert type(hf_config).__name__ == "LlamaConfig"
    with pytest.raises(Exception):  # noqa: B017 - refused in whatever way transformers chooses
        load_tokenizer(path)
    assert not (path / "EXECUTED").exists()
    engine = LLMEngine(EngineConfig(model=str(path), tokenizer=str(tokenized_checkpoint)))
    assert engine.model_info()["model_dir"] == str(path)
    assert not (path / "EXECUTED").exists()


def test_checkpoint_that_needs_its_own_code_is_refused(
    tmp_path: Path, tokenized_checkpoint: Path
) -> None:
    path = remote_code_checkpoint(tmp_path, tokenized_checkpoint, "evil-llama")
    with pytest.raises(ValueError):
        load_hf_config(path)
    with pytest.raises(Exception):  # noqa: B017
        LLMEngine(EngineConfig(model=str(path)))
    assert not (path / "EXECUTED").exists()


def test_serve_config_binds_loopback() -> None:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    (app,) = config["applications"]
    args = AppArgs.model_validate(app["args"])
    # Shipped without a key in the file: it comes from the environment when wanted.
    assert args.api_key is None


def test_api_key_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFIXSERVE_API_KEY", raising=False)
    assert AppArgs().resolved_api_key() is None
    monkeypatch.setenv("PREFIXSERVE_API_KEY", "from-env")
    assert AppArgs().resolved_api_key() == "from-env"
    assert AppArgs(api_key="from-config").resolved_api_key() == "from-config"
    monkeypatch.setenv("PREFIXSERVE_API_KEY", "")
    assert AppArgs().resolved_api_key() is None


@pytest.mark.parametrize(
    "limits",
    [
        {"max_body_bytes": 0},
        {"max_prompt_tokens": 0},
        {"max_tokens": -1},
        {"max_waiting_per_replica": -1},
        {"max_ongoing_per_ingress": 0},
        {"max_queued_for_engine": 0},
        {"max_queued_at_proxy": 0},
        {"request_timeout_s": 0},
        {"max_waiting": 3},
    ],
)
def test_limits_are_validated(limits: dict) -> None:
    with pytest.raises(ValidationError):
        LimitsArgs.model_validate(limits)
