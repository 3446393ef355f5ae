"""The strict pydantic base of every params section (SpecForge style): unknown keys are errors,
values are frozen and finite. Bottom layer: config.py and sagemaker_config.py build on it."""
from __future__ import annotations

from collections.abc import Mapping
from difflib import get_close_matches
from typing import ClassVar, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError


def one_line(e: ValidationError, labels: Mapping[str, str] | None = None, model: type[BaseModel] | None = None) -> str:
    """pydantic's errors as one line: per problem the field's dotted path (or its label, e.g. the CLI
    flag it came from), then the message without "Value error, " or the documentation link. With
    `model` (the class validated), an unknown key names the closest field of its section
    ("did you mean ...?", difflib's ratio ≥ 0.6)."""
    labels = labels or {}
    out = []
    for err in e.errors():
        loc = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and model is not None and err["loc"]:
            msg += _hint(str(err["loc"][-1]), _fields_at(model, err["loc"][:-1]))
        out.append((f"{labels.get(loc, loc)}: " if loc else "") + msg)
    return "; ".join(out)


def _hint(key: str, fields: list[str]) -> str:
    """What an unknown `key` among `fields` most likely meant: a dotted key whose head is a field is
    a section written flat (YAML does not split it), else the closest field, or ""."""
    head = key.split(".")[0]
    if "." in key and head in fields:
        return f" (YAML does not split dotted keys: write {head}: with the rest nested under it)"
    near = get_close_matches(key, fields, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the section of `model` at `loc` (a pydantic error location; a mapping of
    sections, e.g. deploy.sagemaker.profiles, is entered by its key), [] where `loc` does not lead
    to a model (a list's items, a plain value)."""
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return []
        keyed = get_origin(field.annotation) in (dict, Mapping)
        sub = [a for a in (field.annotation, *get_args(field.annotation))
               if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sub or (keyed and not parts):
            return []
        model = sub[0]
        if keyed:
            parts.pop(0)  # the mapping's key, e.g. a profile's name
    return list(model.model_fields)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    labels: ClassVar[Mapping[str, str]] = {}  # field → the name its user typed (a flag), in `build`'s errors

    @classmethod
    def build(cls, **values):
        """The model from `values`; raises ValueError in one line (`one_line`, fields named by
        `labels`)."""
        try:
            return cls(**values)
        except ValidationError as e:
            raise ValueError(one_line(e, cls.labels, cls)) from None

    def changed(self, *names: str) -> list[str]:
        """Those of `names` whose value differs from the field's default: the settings a user asked
        for. A key written out with its default value is not one (the shipped params.yaml states
        every default, so "present in the file" cannot mean "set by the user")."""
        fields = type(self).model_fields
        return [n for n in names if getattr(self, n) != fields[n].get_default(call_default_factory=True)]


def pairs(v):
    """A YAML mapping as (key, value) pairs, so a frozen model stays hashable; other values unchanged."""
    return tuple(v.items()) if isinstance(v, Mapping) else v


def renamed(key: str, renames: Mapping[str, str]) -> BeforeValidator:
    """A field's validator (`Annotated[type, renamed(...)]`) refusing the old spellings of its values:
    `renames` maps each old value to its new one, and an old one raises ValueError naming `key` (as the
    user writes it, e.g. "train.precision") and the new spelling; any other value passes on unchanged."""
    def check(v):
        if isinstance(v, str) and v in renames:
            raise ValueError(f"{v!r} is spelled {renames[v]!r} now: write {key}: {renames[v]}")
        return v
    return BeforeValidator(check)
