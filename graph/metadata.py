"""Typed per-node metadata (MASE's common / software / hardware sections) with a JSON schema.

Every node of a ForgeGraph carries one :class:`NodeMeta` under ``node.meta["fxforge"]``. The common
section is fixed; software and hardware sections hold typed records that passes register by name, so
nothing is reached through untyped string paths and everything round-trips through JSON.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

import torch
import torch.fx as fx

from .json_values import jsonable

META_KEY = "fxforge"
SCHEMA_VERSION = 1

JSONScalar = str | int | float | bool | None


class NodeKind(StrEnum):
    """MASE IR node kinds."""

    MODULE_RELATED_FUNC = "module_related_func"
    MODULE = "module"
    BUILTIN_FUNC = "builtin_func"
    PLACEHOLDER = "placeholder"
    GET_ATTR = "get_attr"
    OUTPUT = "output"


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the stable spelling used in JSON."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; only real torch dtypes are accepted."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return value


def dtype_precision(dtype: torch.dtype) -> tuple[int, ...]:
    """Bit widths of one element: (32,) for float32, (32, 32) for complex64 (real, imaginary)."""
    if dtype == torch.bool:
        return (1,)
    if dtype.is_complex:
        half = dtype.itemsize * 4
        return (half, half)
    return (dtype.itemsize * 8,)


@dataclass(frozen=True)
class ValueMeta:
    """One argument or result of a node: a tensor (shape, dtype, precision) or a plain value."""

    type: str  # "tensor" | "scalar" | "dtype" | "none" | "other"
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    precision: tuple[int, ...] | None = None
    value: JSONScalar = None
    requires_grad: bool = False

    @classmethod
    def of(cls, value: Any) -> ValueMeta:
        """Describe a runtime value (as seen when the graph runs)."""
        if isinstance(value, torch.Tensor):
            return cls(
                type="tensor",
                shape=tuple(int(s) for s in value.shape),
                dtype=dtype_name(value.dtype),
                precision=dtype_precision(value.dtype),
                requires_grad=bool(value.requires_grad),
            )
        if value is None:
            return cls(type="none")
        if isinstance(value, bool | int | str):
            return cls(type="scalar", value=value)
        if isinstance(value, float):
            return cls(type="scalar", value=value if math.isfinite(value) else repr(value))
        if isinstance(value, torch.dtype):
            return cls(type="dtype", value=dtype_name(value))  # its own type: rebuilt as a dtype, not a string
        return cls(type="other", value=type(value).__name__)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("shape", "precision"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "value") -> ValueMeta:
        """Rebuild from JSON, every field type-checked (a checkpoint's metadata is hostile); ValueError
        naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {type(data).__name__}")
        for key, ok, what in (("type", lambda v: isinstance(v, str), "a string"),
                              ("shape", _ints_or_none, "a list of integers or null"),
                              ("dtype", lambda v: v is None or isinstance(v, str), "a string or null"),
                              ("precision", _ints_or_none, "a list of integers or null"),
                              ("value", lambda v: isinstance(v, str | int | float | bool | None), "a JSON scalar"),
                              ("requires_grad", lambda v: isinstance(v, bool), "a bool")):
            if (key in data or key == "type") and not ok(data.get(key)):
                raise ValueError(f"{where}.{key} must be {what}, got {type(data.get(key)).__name__}")
        return cls(
            type=data["type"],
            shape=None if data.get("shape") is None else tuple(data["shape"]),
            dtype=data.get("dtype"),
            precision=None if data.get("precision") is None else tuple(data["precision"]),
            value=data.get("value"),
            requires_grad=bool(data.get("requires_grad", False)),
        )


def _ints_or_none(value: Any) -> bool:
    return value is None or isinstance(value, list) and all(type(v) is int for v in value)


@dataclass
class CommonMeta:
    """What the node is (kind, canonical op) and what flows in and out of it.

    ``args`` are keyed ``data_in_0, data_in_1, ...`` for inputs and by parameter name (``weight``,
    ``bias``) for module parameters; ``results`` are keyed ``data_out_0, ...``.
    """

    kind: NodeKind
    op: str
    module_type: str | None = None
    args: dict[str, ValueMeta] = field(default_factory=dict)
    results: dict[str, ValueMeta] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "op": self.op,
            "module_type": self.module_type,
            "args": {k: v.to_json() for k, v in self.args.items()},
            "results": {k: v.to_json() for k, v in self.results.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CommonMeta:
        """Rebuild from JSON, every field type-checked; ValueError naming the field (``common.op``...)."""
        if not isinstance(data, dict):
            raise ValueError(f"common must be an object, got {type(data).__name__}")
        if not isinstance(data.get("op"), str):
            raise ValueError(f"common.op must be a string, got {type(data.get('op')).__name__}")
        if not isinstance(data.get("module_type"), str | None):
            raise ValueError(f"common.module_type must be a string or null, got {type(data['module_type']).__name__}")
        for key in ("args", "results"):
            if not isinstance(data.get(key, {}), dict):
                raise ValueError(f"common.{key} must be an object, got {type(data[key]).__name__}")
        return cls(
            kind=NodeKind(data["kind"]),
            op=data["op"],
            module_type=data.get("module_type"),
            args={k: ValueMeta.from_json(v, f"common.args.{k}") for k, v in data.get("args", {}).items()},
            results={k: ValueMeta.from_json(v, f"common.results.{k}") for k, v in data.get("results", {}).items()},
        )


class MetaRecord:
    """Base of the typed records that passes attach to the software or hardware section.

    Subclasses are dataclasses decorated with :func:`register_record`; their fields must be JSON
    values (str, int, float, bool, None, lists/tuples and dicts of those).
    """

    record_name: ClassVar[str] = ""
    # set by @dataclass on every subclass (register_record refuses one without it): what dataclasses.fields
    # and asdict read, declared here so that a MetaRecord type-checks as a dataclass instance
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


R = TypeVar("R", bound=MetaRecord)
_RECORDS: dict[str, type[MetaRecord]] = {}


def register_record(name: str):
    """Class decorator: register a MetaRecord dataclass under a stable name used in checkpoints."""

    def wrap(cls: type[R]) -> type[R]:
        if not dataclasses.is_dataclass(cls) or not issubclass(cls, MetaRecord):
            raise TypeError(f"{cls.__name__} must be a dataclass subclassing MetaRecord")
        if name in _RECORDS and _RECORDS[name] is not cls:
            raise ValueError(f"metadata record name {name!r} is already registered by {_RECORDS[name]}")
        cls.record_name = name
        _RECORDS[name] = cls
        return cls

    return wrap


def _record_from_json(cls: type[MetaRecord], data: dict[str, Any]) -> MetaRecord:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            hint = str(f.type)
            kwargs[f.name] = tuple(value) if isinstance(value, list) and hint.startswith("tuple") else value
    return cls(**kwargs)


class MetaSection:
    """A typed bag of records, one per record class (software or hardware metadata)."""

    def __init__(self) -> None:
        self._records: dict[str, MetaRecord] = {}

    def set(self, record: MetaRecord) -> None:
        """Attach (or replace) the record of this type."""
        name = type(record).record_name
        if not name or _RECORDS.get(name) is not type(record):
            raise TypeError(f"{type(record).__name__} is not a registered metadata record")
        self._records[name] = record

    def get(self, cls: type[R]) -> R | None:
        """The record of this type, or None."""
        rec = self._records.get(cls.record_name)
        return rec if isinstance(rec, cls) else None

    def remove(self, cls: type[MetaRecord]) -> None:
        self._records.pop(cls.record_name, None)

    def names(self) -> list[str]:
        return sorted(self._records)

    def to_json(self) -> dict[str, Any]:
        return {
            name: jsonable(dataclasses.asdict(rec), strict=True)
            for name, rec in sorted(self._records.items())
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetaSection:
        section = cls()
        for name, payload in data.items():
            if name not in _RECORDS:
                raise ValueError(f"unknown metadata record {name!r}; registered: {sorted(_RECORDS)}")
            section._records[name] = _record_from_json(_RECORDS[name], payload)
        return section

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetaSection) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"MetaSection({self.names()})"


@dataclass
class NodeMeta:
    """All metadata of one node."""

    common: CommonMeta
    software: MetaSection = field(default_factory=MetaSection)
    hardware: MetaSection = field(default_factory=MetaSection)

    def to_json(self) -> dict[str, Any]:
        return {
            "common": self.common.to_json(),
            "software": self.software.to_json(),
            "hardware": self.hardware.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeMeta:
        return cls(
            common=CommonMeta.from_json(data["common"]),
            software=MetaSection.from_json(data.get("software", {})),
            hardware=MetaSection.from_json(data.get("hardware", {})),
        )


def get_meta(node: fx.Node) -> NodeMeta:
    """The node's metadata; a clear error when init_metadata_analysis_pass has not run."""
    meta = node.meta.get(META_KEY)
    if not isinstance(meta, NodeMeta):
        raise LookupError(
            f"node {node.name!r} has no fxforge metadata: run init_metadata_analysis_pass first"
        )
    return meta


def has_meta(node: fx.Node) -> bool:
    return isinstance(node.meta.get(META_KEY), NodeMeta)


def set_meta(node: fx.Node, meta: NodeMeta) -> None:
    node.meta[META_KEY] = meta
