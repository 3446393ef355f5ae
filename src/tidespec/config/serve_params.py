"""`tidespec serve`'s settings (the `serve:` section of params.yaml), strict as every section."""
from __future__ import annotations

import re
import socket
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .strict import Strict

REPLICA_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class ServeParams(Strict):
    """`tidespec serve` settings, the one serve config (CLI flags override). max_tokens: cap (and
    default) of a request's max_tokens (None: engine.max_new_tokens, see `Params.serve_resolved`);
    request_timeout_s: a request still unfinished after it gets 504; max_queue: requests waiting +
    running before 429 (Retry-After); served_model_name: the `model` id responses carry (None:
    target.source, as vLLM's --served-model-name defaults to the model path); default_temperature:
    the temperature of a request that sends none (0 = greedy, the output speculation must equal;
    OpenAI's own default is 1.0 and vLLM takes the model's generation_config — set 1.0 for OpenAI's);
    watch_champion_s: how often (s) `tidespec serve` checks data/drafts/champion for a version a
    cycle deployed and swaps to it (0: never; POST /admin/draft still swaps); live_stats_s: with
    MLFLOW_TRACKING_URI, how often (s) this replica's cumulative spec-decode counters of each version
    it serves are logged to that version's MLflow run under its replica id (every backend:
    `backends.live.report_replica`), and, behind vLLM and SGLang, the served version's live figures
    (`live/*`) and the live guard's round (0: never; refused before your own SGLang at --sglang-url);
    classify_workload: a request without a `workload` field or a model alias gets its class from the
    request itself (`serve.workload`: response_format / tools, content) — false: class "default";
    workload_by_model: extra model ids this server answers to, each naming the class of its
    requests (e.g. {"smollm2-code": "code"}: a client picks a class by the model it asks for);
    champion_source: where the champion served comes from — `directory` (data/drafts/champion and
    data/drafts/classes/<class>, which the cycle's deploy step writes on this machine) or `registry`
    (a replica on another machine: the MLflow registry's champion aliases of the served target,
    downloaded every watch_champion_s s into the server's own .tidespec/registry/ by
    `adapters.registry.follow.RegistryFollower`; needs MLFLOW_TRACKING_URI, refused at start
    without it by `config.serve_launch.ServeLaunch`); replica_id: this server's name in a fleet (letters,
    digits, `.`, `_`, `-`; at most 63 characters, so it fits a file name, an MLflow key and a Prometheus
    label; None: `<host name>-<port>`, `ServeParams.replica`), on /health; auth_health_metrics: with an API key
    (`tidespec serve --api-key`, $TIDESPEC_API_KEY), /health and /metrics take it too (false: they
    stay open for load balancers and Prometheus; true without a key is refused at start). The key
    itself is never a params value: it is a secret, params.yaml is versioned; canary: this replica is a
    canary of the rollout (`deploy.rollout: canary`): its follower serves the registry's `canary` alias
    while one exists, else the champion (needs champion_source: registry and live_stats_s > 0: the
    rollout decision, `adapters.registry.rollout`, reads the counters every replica logs)."""

    max_queue: int = Field(64, ge=1)
    request_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    served_model_name: str | None = Field(None, min_length=1)
    default_temperature: float = Field(0.0, ge=0, le=2, allow_inf_nan=False)
    watch_champion_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    live_stats_s: float = Field(60.0, ge=0, allow_inf_nan=False)
    classify_workload: bool = True
    workload_by_model: dict[str, str] = {}
    health_check_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    auto_rollback: bool = True
    champion_source: Literal["directory", "registry"] = "directory"
    replica_id: str | None = Field(None, pattern=REPLICA_ID)
    auth_health_metrics: bool = False
    canary: bool = False

    @model_validator(mode="after")
    def _a_canary_follows_the_registry(self):
        if self.canary and self.champion_source != "registry":
            raise ValueError("serve.canary: true serves the registry's `canary` alias, which only a replica following "
                             "the registry sees: set serve.champion_source: registry (and MLFLOW_TRACKING_URI), or "
                             "remove serve.canary")
        if self.canary and self.live_stats_s <= 0:
            raise ValueError("serve.canary: true: the rollout decision compares the live counters each replica logs "
                             "every serve.live_stats_s s, and serve.live_stats_s is 0 (never): set it > 0 (e.g. 60), "
                             "or remove serve.canary")
        return self

    def replica(self, port: int | None = None) -> str:
        """This server's replica id: `replica_id`, else `<host name>-<port>` (the host name's first
        label, characters outside the id's alphabet replaced by `-`); without a `port` (a machine's
        ingest or offline seal, not a server), the host name alone."""
        if self.replica_id:
            return self.replica_id
        host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0]).strip("-._") or "host"
        return f"{host[:56]}-{port}" if port is not None else host[:63]

    @field_validator("workload_by_model")
    @classmethod
    def _aliases(cls, v: dict[str, str]) -> dict[str, str]:
        for alias, workload in v.items():
            if not alias or not workload or len(workload) > 64:
                raise ValueError(f"serve.workload_by_model: {alias!r}: {workload!r} — model ids and classes must be "
                                 "non-empty, classes at most 64 characters")
        return v
