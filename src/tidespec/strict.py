"""The strict pydantic base of every params section (SpecForge style): unknown keys are errors,
values are frozen and finite. Its own module so that config.py and the AWS modules it imports
(train/sagemaker.py, deploy/sagemaker.py) share it without an import cycle."""
from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def pairs(v):
    """A YAML mapping as (key, value) pairs, so a frozen model stays hashable; other values unchanged."""
    return tuple(v.items()) if isinstance(v, Mapping) else v
