"""The strict pydantic base of every params section (SpecForge style): unknown keys are errors,
values are frozen and finite. Bottom layer: config.py and sagemaker_config.py build on it."""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def build(cls, **values):
        """The model from `values`; raises ValueError with one line per problem (the field, then
        pydantic's message, without its "Value error, " prefix or its documentation link)."""
        try:
            return cls(**values)
        except ValidationError as e:
            lines = [(f"{'.'.join(map(str, err['loc']))}: " if err["loc"] else "")
                     + err["msg"].removeprefix("Value error, ") for err in e.errors()]
            raise ValueError("; ".join(lines)) from None

    def changed(self, *names: str) -> list[str]:
        """Those of `names` whose value differs from the field's default: the settings a user asked
        for. A key written out with its default value is not one (the shipped params.yaml states
        every default, so "present in the file" cannot mean "set by the user")."""
        fields = type(self).model_fields
        return [n for n in names if getattr(self, n) != fields[n].get_default(call_default_factory=True)]


def pairs(v):
    """A YAML mapping as (key, value) pairs, so a frozen model stays hashable; other values unchanged."""
    return tuple(v.items()) if isinstance(v, Mapping) else v
