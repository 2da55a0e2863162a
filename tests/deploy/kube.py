"""Offline validation of Kubernetes objects against a CustomResourceDefinition.

The API server validates a custom resource against the CRD's structural OpenAPI v3 schema. This
module turns that schema into a JSON Schema that ``jsonschema`` enforces the same way:

* unknown fields are errors (the server prunes them, and ``kubectl apply`` with its default
  strict field validation rejects them): every object schema with ``properties`` and neither
  ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields`` gets
  ``additionalProperties: false``;
* ``x-kubernetes-int-or-string`` accepts an integer or a string (a quantity's ``pattern`` then
  applies to strings only, as in JSON Schema);
* ``nullable`` adds ``null`` to the type;
* ``x-kubernetes-list-type: set`` items are unique, and ``map`` lists have unique keys
  (``x-kubernetes-list-map-keys``, a missing key taking its schema default);
* CEL rules (``x-kubernetes-validations``) of the form ``self in [...]`` become an ``enum``;
  transition rules (``oldSelf``) only apply to updates and are dropped; other rules are not
  evaluated.

The root ``metadata`` is ObjectMeta, which the server validates itself; a compact ObjectMeta schema
stands in for it.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema import ValidationError

# libyaml when present: the CRD is ~18k lines, which pure-Python YAML takes seconds on.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# ObjectMeta fields a client may set; names are DNS labels or subdomains, checked elsewhere.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
    },
    "additionalProperties": False,
}

_CEL_IN_LIST = re.compile(r"^\s*self\s+in\s+(\[.*\])\s*$")


def structural_to_jsonschema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON Schema (draft 4 keywords) enforcing ``schema`` the way the API server does."""
    out = _convert(copy.deepcopy(dict(schema)))
    out.setdefault("properties", {})["metadata"] = OBJECT_META_SCHEMA
    return out


def _convert(node: Any) -> Any:
    if isinstance(node, list):
        return [_convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: (value if key == "default" else _convert(value)) for key, value in node.items()}
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        node["type"] = ["integer", "string"]
    if node.get("x-kubernetes-list-type") == "set":
        node["uniqueItems"] = True
    rules = node.pop("x-kubernetes-validations", [])
    for rule in rules:
        match = _CEL_IN_LIST.match(rule["rule"])
        if match:
            node["enum"] = ast.literal_eval(match.group(1))
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in node and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False
    return node


def _list_map_keys(
    validator: Any, keys: list[str], instance: Any, schema: Mapping[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    item_props = schema.get("items", {}).get("properties", {})
    seen: dict[tuple[Any, ...], int] = {}
    for index, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
        if key in seen:
            yield ValidationError(
                f"items {seen[key]} and {index} have the same {'/'.join(keys)} {key!r}"
            )
        else:
            seen[key] = index


_Validator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _list_map_keys}
)


class CustomResourceValidator:
    """Validates one kind of custom resource (every served version of its CRD)."""

    def __init__(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        self.group: str = spec["group"]
        self.kind: str = spec["names"]["kind"]
        self._validators = {
            f"{self.group}/{version['name']}": _Validator(
                structural_to_jsonschema(version["schema"]["openAPIV3Schema"])
            )
            for version in spec["versions"]
            if version.get("served", False)
        }

    @classmethod
    def from_file(cls, path: Path) -> CustomResourceValidator:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=YAML_LOADER) if d]
        crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
        if len(crds) != 1:
            raise ValueError(f"{path}: expected one CustomResourceDefinition, found {len(crds)}")
        return cls(crds[0])

    def errors(self, obj: Mapping[str, Any]) -> list[str]:
        """Every schema violation of ``obj``, as ``path: message``; empty when it is valid."""
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if kind != self.kind:
            return [f"kind: expected {self.kind}, got {kind!r}"]
        validator = self._validators.get(str(api_version))
        if validator is None:
            served = ", ".join(sorted(self._validators))
            return [f"apiVersion: {api_version!r} is not served (served: {served})"]
        return [
            f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
            for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
        ]


_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)$")
_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}


def parse_quantity(quantity: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("500m", "8Gi", 4) as a plain number (cores, bytes)."""
    match = _QUANTITY.match(str(quantity).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    return Decimal(match.group(1)) * _SUFFIXES[match.group(2)]


_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def is_dns1035_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1035_LABEL.match(name))
