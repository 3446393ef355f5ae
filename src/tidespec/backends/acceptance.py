"""The acceptance publisher a SageMaker serving image runs beside its engine (`python -m
tidespec.backends.acceptance`, started by infra/containers' entrypoints when `TIDESPEC_ACCEPTANCE=1`):
the engine's spec-decode counters (`backends.sglang.metrics`, `backends.vllm.metrics`) put into
CloudWatch as its live acceptance length (`adapters.sagemaker_deploy.acceptance.Publisher`: the
metric, the window and the alarm it feeds)."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ..adapters.sagemaker_deploy.acceptance import Publisher
from ..engine.spec_counters import SpecDecodeCounters

ENGINES = ("sglang", "vllm")


def engine_scrape(url: str, engine: str, k: int) -> Callable[[], SpecDecodeCounters | None]:
    """`scrape()` of the engine at `url`: its cumulative counters (None: none exported; raises
    SGLangError / VLLMError when it does not answer). `k`: draft tokens per draft (SGLang's counters
    need it). Raises ValueError for an engine not in ENGINES."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "sglang":
        from .sglang.metrics import scrape as sglang_scrape
        return lambda: sglang_scrape(url, k)
    from .vllm.metrics import scrape as vllm_scrape
    return lambda: vllm_scrape(url)


def main() -> None:
    """The container entry: settings from the environment the deploy wrote into the Model
    (`plan.container_env`): TIDESPEC_ENDPOINT_NAME, TIDESPEC_DRAFT_VERSION, TIDESPEC_ENGINE,
    TIDESPEC_NUM_STEPS; TIDESPEC_METRICS_URL (default http://127.0.0.1:8080, where SageMaker
    reaches the engine), TIDESPEC_ACCEPTANCE_EVERY_S (60)."""
    logging.basicConfig(level=logging.INFO)
    env = os.environ
    scrape = engine_scrape(env.get("TIDESPEC_METRICS_URL", "http://127.0.0.1:8080"), env["TIDESPEC_ENGINE"],
                           int(env["TIDESPEC_NUM_STEPS"]))
    pub = Publisher(scrape, env["TIDESPEC_ENDPOINT_NAME"], env.get("TIDESPEC_DRAFT_VERSION") or None)
    pub.run(float(env.get("TIDESPEC_ACCEPTANCE_EVERY_S", "60")), threading.Event())


if __name__ == "__main__":
    main()
