"""The strict pydantic base of every params section (SpecForge style): unknown keys are errors,
values are frozen and finite. Bottom layer: config.py and sagemaker_config.py build on it."""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def pairs(v):
    """A YAML mapping as (key, value) pairs, so a frozen model stays hashable; other values unchanged."""
    return tuple(v.items()) if isinstance(v, Mapping) else v
