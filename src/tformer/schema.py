"""Typed, frozen, validated configuration dataclasses (no torch import).

A config class derives from `Config`, declares its fields with type annotations (`int`, `float`,
`bool`, `str`, `Literal[...]`, `X | None`, or a nested `Config`) and may add cross-field checks in
`check()`. Every field is type-checked at construction; errors name the class, the field, the bad
value and what is allowed (a config built from a mapping inside another names the path from the
outermost one: "TrainConfig.model.moe.top_k"). `from_dict` rejects unknown keys and lists the allowed ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import re
import types
import typing
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

C = TypeVar("C", bound="Config")


def require_bool(**flags: object) -> None:
    """TypeError naming the first of `flags` (name=value) that is not True or False: a truthy string such as
    "no" would otherwise switch the option on."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


class ConfigError(ValueError):
    """A configuration value or key is not allowed; the message says which and what is."""


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_FLOAT_LITERAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(owner: str, name: str, value: Any, tp: Any) -> Any:
    """Check `value` against annotation `tp`; return it (ints widened to float, dicts to configs)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        nested = None  # a mapping for a nested config, an inf: that arm's own error says more
        for arg in get_args(tp):
            try:
                return _coerce(owner, name, value, arg)
            except ConfigError as e:
                if isinstance(value, dict) and isinstance(arg, type) and issubclass(arg, Config):
                    nested = e
                if arg is float and isinstance(value, float) and not math.isfinite(value):
                    nested = e  # "must be a finite number" says more than "must be float or null"
        if nested is not None:
            raise nested
        raise ConfigError(f"{owner}.{name} must be {_describe(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, str) and value in choices:  # a str subclass (numpy's str_) as a plain str
            return str(value)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise ConfigError(f"{owner}.{name} must be {_describe(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:  # NumPy integers too (a value from an array), stored as int
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif tp is float:  # no tformer setting means anything at inf or NaN
        if isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
            raise ConfigError(f"{owner}.{name} must be a finite number, got {value!r}")
        if isinstance(value, str) and _FLOAT_LITERAL.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as a string: a float in YAML 1.2 and JSON
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{owner}.{name} must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            try:
                return tp.from_dict(value, _path=f"{owner}.{name}")
            except ConfigError as e:  # "MoEConfig.top_k ..." -> "ModelConfig.moe.top_k ...": the path typed
                raise ConfigError(_relocate(str(e), tp.__name__, f"{owner}.{name}")) from None
    raise ConfigError(f"{owner}.{name} must be {_describe(tp)}, got {value!r}")


def _relocate(message: str, name: str, path: str) -> str:
    """`message` with its mention of config class `name` (as the head of a field path, or the owner of an
    unknown key) replaced by `path`, the field that holds that config in its parent."""
    if re.match(rf"{re.escape(name)}[.:]", message):
        return path + message[len(name) :]
    # "unknown key 'k' in <name>.moe; allowed: ...": the owner's path ends at the ";" (the key typed may
    # itself hold " in <name>." and is left as it is)
    owners = list(re.finditer(rf"(?<= in ){re.escape(name)}(?=(?:\.\w+)*;)", message))
    if not owners:
        return message
    return message[: owners[-1].start()] + path + message[owners[-1].end() :]


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every config: type checks, `check()` hook, dict/JSON/YAML round trip."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(type(self).__name__, f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Cross-field validation; subclasses raise ConfigError naming the fields."""

    def _fail(self, field: str, allowed: str) -> None:
        raise ConfigError(f"{type(self).__name__}.{field} {allowed}, got {getattr(self, field)!r}")

    def _require(self, ok: bool, field: str, allowed: str) -> None:
        if not ok:
            self._fail(field, allowed)

    def _require_seed(self, field: str = "seed") -> None:
        """A seed torch.manual_seed and torch.Generator.manual_seed take (one range for every command)."""
        seed = getattr(self, field)
        self._require(
            -(2**63) <= seed < 2**64, field, "must be in [-2**63, 2**64) (torch.manual_seed's range)"
        )

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, Config) else v
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], _path: str | None = None) -> C:
        if not isinstance(data, dict):
            raise ConfigError(f"{_path or cls.__name__} must be a mapping, got {type(data).__name__}")
        allowed = cls.field_names()
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise ConfigError(
                f"unknown key {unknown[0]!r} in {_path or cls.__name__}; allowed: {', '.join(allowed)}"
            )
        return cls(**data)

    def replace(self: C, **changes: Any) -> C:
        unknown = [k for k in changes if k not in self.field_names()]
        if unknown:
            raise ConfigError(
                f"unknown key {unknown[0]!r} in {type(self).__name__}; "
                f"allowed: {', '.join(self.field_names())}"
            )
        return dataclasses.replace(self, **changes)

    def with_overrides(self: C, overrides: dict[str, Any]) -> C:
        """Apply dotted overrides such as {"rope.theta": 5e5, "d_model": 256}."""
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"overrides must be a dict of dotted keys and values (e.g. {{'d_model': 256}}), got "
                f"{type(overrides).__name__}"
            )
        data = self.to_dict()
        for dotted, value in overrides.items():
            if not isinstance(dotted, str):
                raise TypeError(f"override keys are dotted field names (str), got {dotted!r}")
            node, parts = data, dotted.split(".")
            section: type[Config] | None = type(self)  # the config class `node` holds (None: a setting's)
            for i, part in enumerate(parts[:-1]):
                inner = _section_type(section, part)
                if part in node and node[part] is None and inner is not None:
                    node[part] = {}  # a null section (model.moe) set field by field
                if not isinstance(node.get(part), dict):
                    raise ConfigError(self._bad_section(dotted, parts[: i + 1], node, section))
                node, section = node[part], inner
            node[parts[-1]] = _merged(node.get(parts[-1]), value, _section_type(section, parts[-1]))
        return type(self).from_dict(data)

    def _bad_section(
        self, dotted: str, parts: list[str], node: dict[str, Any], section: type[Config] | None
    ) -> str:
        """Why override `dotted` cannot reach inside `parts[-1]` of `node` (which holds config class
        `section`, the one the parts before it name; None where they name a setting given a mapping): a
        key that is not there (the section's keys listed), or a plain setting (null ones too)."""
        where = ".".join([type(self).__name__, *parts[:-1]])
        if parts[-1] in node:
            return f"{where}.{parts[-1]} is a setting, not a section: override {dotted!r} reaches inside it"
        if section is None:  # inside a mapping an earlier override gave a setting
            return f"{where} is a setting, not a section: override {dotted!r} reaches inside it"
        allowed = ", ".join(section.field_names())
        return f"unknown key {parts[-1]!r} in {where} (override {dotted!r}); allowed: {allowed}"

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls: type[C], text: str) -> C:
        return cls.from_dict(cls._parse(text, "JSON"))

    def to_yaml(self) -> str:
        """The fields as YAML; a string that a YAML reader (`core_loader`'s or PyYAML's own) would read as
        another value ("1e5", "0o17", "true", "~", "2024-12-01") is quoted, so it loads back as written."""
        import yaml

        return yaml.dump(self.to_dict(), Dumper=_quoting_dumper(), sort_keys=False)

    @classmethod
    def from_yaml(cls: type[C], text: str) -> C:
        return cls.from_dict(cls._parse(text, "YAML"))

    @classmethod
    def _parse(cls, text: str, fmt: str, where: str | None = None) -> Any:
        """The mapping a JSON or YAML text holds; a text that is neither is a ConfigError."""
        import yaml

        try:
            data = json.loads(text, object_pairs_hook=_unique_keys) if fmt == "JSON" else _yaml_unique(text)
        except (ValueError, yaml.YAMLError) as e:
            reason = " ".join(str(e).split()).replace(
                'in "<unicode string>", ', ""
            )  # the file is named first
            what = (
                f"{where}: not a readable {cls.__name__} file"
                if where
                else f"not a valid {fmt} text for {cls.__name__}"
            )
            if where and fmt == "JSON" and not where.lower().endswith(".json"):  # a YAML file named otherwise
                what += " (read as JSON: name a YAML file .yaml or .yml)"
            raise ConfigError(f"{what} ({reason})") from None
        if data is None:  # an empty file, or only comments: a mistake, not a request for the defaults
            what = f"{where}: holds no {cls.__name__} fields" if where else f"the {fmt} text holds no fields"
            raise ConfigError(
                f"{what}; write the fields to change (an empty mapping {{}} keeps every default)"
            )
        return data

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = self.to_yaml() if _is_yaml(path) else self.to_json()
        path.write_text(text)

    @classmethod
    def load(cls: type[C], path: str | Path) -> C:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:  # unreadable, not UTF-8
            reason = " ".join(str(e).split())
            raise ConfigError(f"{path}: not a readable {cls.__name__} file ({reason})") from None
        data = cls._parse(text, "YAML" if _is_yaml(path) else "JSON", str(path))
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}: a {cls.__name__} file holds a mapping of its fields, got a {type(data).__name__}"
            )
        try:
            return cls.from_dict(data)
        except ConfigError as e:  # an unknown key, a bad value: which file holds it
            raise ConfigError(f"{path}: {e}") from None


def _merged(current: Any, value: Any, section: type[Config] | None) -> Any:
    """An override's value for a field now holding `current`: a mapping given to a section that is set
    (`model.moe={top_k: 4}` on a preset with MoE) changes the keys it names and keeps the others, inner
    sections likewise (it had replaced the section, every key it did not name falling back to the
    class's default); any other value replaces the field (a null section is built from its defaults)."""
    if section is None or not isinstance(value, Mapping) or not isinstance(current, dict):
        return value
    out = dict(current)
    for key, inner in value.items():
        out[key] = (
            _merged(current.get(key), inner, _section_type(section, key)) if isinstance(key, str) else inner
        )
    return out


def _section_type(section: type[Config] | None, name: str) -> type[Config] | None:
    """The config class field `name` of config class `section` holds (a `Config` or `Config | None`
    annotation); None for a plain setting, an unknown name, or no section."""
    if section is None:
        return None
    hint = typing.get_type_hints(section).get(name)
    return next((a for a in (hint, *get_args(hint)) if isinstance(a, type) and issubclass(a, Config)), None)


def _is_yaml(path: Path) -> bool:
    """Whether a config file is YAML by its name (.yaml / .yml, in any case: OK.YAML too); else JSON."""
    return path.suffix.lower() in (".yaml", ".yml")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: a key written twice (the first value silently lost) is an
    error naming it."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one mapping (which value is meant?)")
        out[key] = value
    return out


@functools.cache
def core_loader() -> type:
    """yaml.SafeLoader reading plain scalars as YAML 1.2's core schema does (as JSON would), not as YAML
    1.1: 010 is ten (not octal eight), 1:30 a string (not 90 in base 60), 1e-3 a float (not a string),
    only true / false are booleans (not yes / no / on / off), 2024-12-01 a string (not a date: no
    setting is one); 0x10 and 0o10 stay hexadecimal and octal, as written, and digits may be grouped
    with underscores as in Python (1_000). Settings typed in 1.1's forms had been read as other values
    without a word."""
    import yaml

    bool_, int_, float_ = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
    # timestamps and `=` (YAML 1.1's "value" tag, which SafeLoader cannot construct) are plain strings
    dropped = {bool_, int_, float_, "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:value"}

    class CoreLoader(yaml.SafeLoader):
        def construct_core_int(self, node) -> int:
            text = self.construct_scalar(node)
            sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
            base = {"0x": 16, "0o": 8}.get(digits[:2].lower(), 10)
            return sign * int(digits[2:] if base != 10 else digits, base)

    CoreLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in dropped]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    CoreLoader.add_implicit_resolver(
        bool_, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    CoreLoader.add_implicit_resolver(
        int_, re.compile(r"^(?:[-+]?[0-9](?:_?[0-9])*|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
    )
    CoreLoader.add_implicit_resolver(
        float_,
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9](?:_?[0-9])*(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+0123456789."),
    )
    CoreLoader.add_constructor(int_, CoreLoader.construct_core_int)
    return CoreLoader


def yaml_value(text: str) -> Any:
    """One YAML value (a --set value), read with `core_loader`; a mapping that names a key twice is an
    error, as in a config file."""
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 (a SafeLoader)


def _yaml_unique(text: str) -> Any:
    """yaml.safe_load (with `core_loader`'s scalars), but a key written twice in one mapping is an error
    (PyYAML keeps the last)."""
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 (a SafeLoader)


@functools.cache
def _unique_key_loader() -> type:
    """`core_loader`, refusing a key written twice in one mapping."""
    import yaml

    class UniqueKeyLoader(core_loader()):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by SafeLoader below
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        "a mapping key must be a plain value (a string or a number)",
                        key_node.start_mark,
                    )
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key!r} appears twice in one mapping (which value is meant?)",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


@functools.cache
def _quoting_dumper() -> type:
    """yaml.SafeDumper that quotes every string a reader would resolve to another type: those that
    `core_loader` (YAML 1.2's core schema, as tformer reads its files) or PyYAML's YAML 1.1 resolvers (a
    user's own script) would read as a number, boolean, null or date. The dumper writes a string plain
    only where its resolvers find no other tag for it, so it is given both sets."""
    import yaml

    class QuotingDumper(yaml.SafeDumper):
        pass

    core, legacy = core_loader().yaml_implicit_resolvers, yaml.SafeDumper.yaml_implicit_resolvers
    QuotingDumper.yaml_implicit_resolvers = {
        first: [*core.get(first, []), *legacy.get(first, [])] for first in {*core, *legacy}
    }
    return QuotingDumper
