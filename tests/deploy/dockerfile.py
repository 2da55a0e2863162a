"""Reading the root Dockerfile without Docker: instructions, build arguments, base images."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, ARG, ENV, RUN, ...
    value: str  # continuation lines joined, embedded comment lines dropped
    line: int  # 1-based line of the keyword


def parse(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, as Docker's parser splits them."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        # Comment lines are dropped, also inside a continued instruction.
        if not stripped or stripped.startswith("#"):
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, value = " ".join(parts).partition(" ")
            out.append(Instruction(keyword.upper(), value.strip(), start))
            parts = []
    return out


def _pairs(value: str) -> dict[str, str | None]:
    """``ARG A=1`` / ``ENV A=1 B="x y"`` as a mapping (an ARG without default maps to None)."""
    out: dict[str, str | None] = {}
    for token in shlex.split(value):
        name, sep, default = token.partition("=")
        out[name] = default if sep else None
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"build argument {name} has no value")
        return values[name]

    return _VAR.sub(repl, text)


def global_args(instructions: list[Instruction]) -> dict[str, str | None]:
    """ARGs declared before the first FROM (the ones FROM may use), with their defaults."""
    out: dict[str, str | None] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            out.update(_pairs(ins.value))
    return out


def stage_args(instructions: list[Instruction]) -> dict[str, str | None]:
    """ARGs of the first stage with their defaults (an ARG redeclared without a default takes
    the global one)."""
    glob = global_args(instructions)
    out: dict[str, str | None] = {}
    in_stage = False
    for ins in instructions:
        if ins.keyword == "FROM":
            if in_stage:
                break
            in_stage = True
        elif in_stage and ins.keyword == "ARG":
            for name, default in _pairs(ins.value).items():
                out[name] = default if default is not None else glob.get(name)
    return out


def env(instructions: list[Instruction]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            out.update(_pairs(ins.value))
    return out


def base_image(instructions: list[Instruction], build_args: dict[str, str] | None = None) -> str:
    """The first FROM's image with the build arguments (over the defaults) substituted."""
    values = {k: v for k, v in global_args(instructions).items() if v is not None}
    values.update(build_args or {})
    first = next(ins for ins in instructions if ins.keyword == "FROM")
    return substitute(first.value.split()[0], values)


def user_at(instructions: list[Instruction], line: int, default: str | None = None) -> str | None:
    """The user a RUN at ``line`` runs as: the last USER before it (``default``: the base
    image's)."""
    user = default
    for ins in instructions:
        if ins.line >= line:
            break
        if ins.keyword == "USER":
            user = ins.value.split(":")[0]
    return user


def shell_form_python(ins: Instruction) -> str:
    """The code of a ``RUN python -c "..."`` instruction."""
    words = shlex.split(ins.value)
    if words[:2] != ["python", "-c"] or len(words) != 3:
        raise ValueError(f'line {ins.line}: not a RUN python -c "...": {ins.value}')
    return words[2]
