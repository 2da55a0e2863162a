"""The commands in README.md and docs/*.md: every block is marked, and the fast ones run on a
fresh clone with nothing beside it (tests/docs_commands.py; `make docs-check-all` runs the slow
ones too)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import docs_commands
from tests.docs_commands import FAST, NOT_RUNNABLE, SERVER, SLOW, MarkerError, parse_blocks

SAMPLE = """# Title

<!-- runnable -->
```sh
echo fast
```

<!-- runnable: slow -->

```bash
echo slow
```

<!-- runnable: slow, server -->
```python
print("server")
```

- a list item:

  <!-- not runnable: needs a cluster -->
  ```sh
  kubectl get pods
  ```

```
a diagram, not a command
```

```sh
echo unmarked
```
"""


def test_markers_parse(tmp_path: Path) -> None:
    blocks = parse_blocks(tmp_path / "x.md", SAMPLE)
    assert [(b.line, b.language, b.kind) for b in blocks] == [
        (4, "sh", FAST),
        (10, "bash", SLOW),
        (15, "python", SERVER),
        (22, "sh", NOT_RUNNABLE),
        (30, "sh", None),
    ]
    assert blocks[0].body == "echo fast\n"
    assert blocks[3].body == "kubectl get pods\n" and blocks[3].reason == "needs a cluster"
    order = docs_commands.select(blocks, slow=True)
    assert [b.kind for b in order] == [FAST, SLOW, SERVER]
    assert [b.kind for b in docs_commands.select(blocks, slow=False)] == [FAST]


@pytest.mark.parametrize(
    "marker",
    ["<!-- runnable: fast -->", "<!-- runnable: server -->", "<!-- not runnable -->"],
)
def test_bad_markers_are_errors(tmp_path: Path, marker: str) -> None:
    with pytest.raises(MarkerError):
        parse_blocks(tmp_path / "x.md", f"{marker}\n```sh\ntrue\n```\n")


def test_every_command_block_is_marked() -> None:
    blocks = docs_commands.all_blocks()
    unmarked = [b.where() for b in blocks if b.kind is None]
    assert not unmarked, (
        "mark these blocks (tests/docs_commands.py says how): <!-- runnable -->, "
        f"<!-- runnable: slow -->, <!-- runnable: slow, server --> or <!-- not runnable: why -->: "
        f"{unmarked}"
    )
    assert any(b.kind == FAST for b in blocks)
    # A clone has nothing beside it: no command that runs may need ../shared.
    assert not [b.where() for b in blocks if b.runnable and "../shared" in b.body]


def test_clone_has_nothing_beside_it_and_a_current_venv(tmp_path: Path) -> None:
    clone = docs_commands.make_clone(tmp_path, docs_commands.default_venv())
    assert [p.name for p in tmp_path.iterdir()] == [clone.name]
    assert (clone / ".venv").is_symlink()
    assert (clone / "README.md").read_text() == (docs_commands.ROOT / "README.md").read_text()
    # `make` sees the linked venv as built: nothing would be reinstalled.
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=clone, env=_plain_env())
    assert stamp.returncode == 0


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "MFLAGS"}


def test_server_blocks_never_use_someone_elses_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from benchmarks import servers

    monkeypatch.setattr(servers, "port_in_use", lambda host, port: True)
    with (
        pytest.raises(RuntimeError, match="in use"),
        docs_commands.make_serve(docs_commands.ROOT, {}, tmp_path / "log"),
    ):
        pass


def test_fast_blocks_run_on_a_bare_clone() -> None:
    if not (docs_commands.ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    if os.environ.get(docs_commands.NESTED_ENV):
        pytest.skip("inside a docs check already (a block ran `make test`)")
    outcomes = docs_commands.run_check()
    assert outcomes
    failed = [f"{o.block.where()}:\n{o.output[-3000:]}" for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(failed)
