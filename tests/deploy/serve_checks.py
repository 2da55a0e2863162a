"""Strict checks of a Ray Serve config (``serve_config.yaml`` or a RayService's serveConfigV2).

Ray's ``ServeDeploySchema`` ignores keys it does not know, at every level, so a misspelt
``max_replica`` or ``num_gpu`` would be dropped without a word. ``serve_config_errors`` validates
with it and then walks the config beside the schema's models, reporting every key that no model
field names. Application ``args`` are free-form for Ray; they are validated by
``deployments.config.AppArgs``, which forbids unknown keys itself.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

import pydantic
from pydantic import BaseModel
from ray.serve.schema import ServeDeploySchema

from deployments.config import AppArgs


def serve_config_errors(config: Any) -> list[str]:
    """Every problem with ``config``, one line each; empty when Ray and AppArgs accept it."""
    if not isinstance(config, Mapping):
        return [f"serve config: expected a mapping, got {type(config).__name__}"]
    try:
        ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as e:
        return [f"serve config: {e}"]
    errors = [f"{path}: unknown key" for path in unknown_keys(ServeDeploySchema, config)]
    for index, app in enumerate(config.get("applications", [])):
        try:
            AppArgs.model_validate(app.get("args") or {})
        except pydantic.ValidationError as e:
            errors.append(f"applications.{index}.args: {e}")
    return errors


def unknown_keys(model: type[BaseModel], raw: Mapping[str, Any], path: str = "") -> list[str]:
    """Dotted paths of keys in ``raw`` (and nested mappings) that ``model`` does not define."""
    fields = {}
    for name, field in model.model_fields.items():
        fields[name] = field
        if field.alias:
            fields[field.alias] = field
    found: list[str] = []
    for key, value in raw.items():
        where = f"{path}.{key}" if path else str(key)
        field = fields.get(key)
        if field is None:
            found.append(where)
        else:
            found += _unknown_in_value(field.annotation, value, where)
    return found


def _unknown_in_value(annotation: Any, value: Any, where: str) -> list[str]:
    models, item_models, free_form = _models_in(annotation)
    if isinstance(value, Mapping) and models:
        if free_form:
            # Union[Dict, Model] keeps a mapping as a plain dict: Ray validates it against the
            # model later, when it builds the deployment. Do it now.
            try:
                models[0].model_validate(value)
            except pydantic.ValidationError as e:
                return [f"{where}: {e}"]
        return unknown_keys(models[0], value, where)
    if isinstance(value, list) and item_models:
        found: list[str] = []
        for index, item in enumerate(value):
            found += _unknown_in_value(item_models[0], item, f"{where}.{index}")
        return found
    return []


def _models_in(annotation: Any) -> tuple[list[type[BaseModel]], list[Any], bool]:
    """The models a value of ``annotation`` may be, the annotations of its list items, and
    whether a plain dict is also allowed."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        args = typing.get_args(annotation)
        if origin is typing.Annotated:
            args = args[:1]
        models: list[type[BaseModel]] = []
        items: list[Any] = []
        free_form = False
        for arg in args:
            m, i, f = _models_in(arg)
            models += m
            items += i
            free_form = free_form or f
        return models, items, free_form
    if origin in (list, typing.List):  # noqa: UP006 (Ray's annotations use typing.List)
        return [], list(typing.get_args(annotation)[:1]), False
    if annotation in (dict, typing.Dict) or origin in (dict, typing.Dict):  # noqa: UP006
        return [], [], True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], [], False
    return [], [], False


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one ``{"a.b.c": leaf}`` mapping; lists are leaves."""
    if not isinstance(value, Mapping) or not value:
        return {prefix: value} if prefix else {}
    flat: dict[str, Any] = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> set[str]:
    """Dotted keys whose leaf values differ between ``a`` and ``b`` (missing counts as differing)."""
    fa, fb = flatten(a), flatten(b)
    return {key for key in fa.keys() | fb.keys() if fa.get(key, _MISSING) != fb.get(key, _MISSING)}


_MISSING = object()
