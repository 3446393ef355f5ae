"""`tidespec deploy local|sagemaker`: the champion to a running server or a SageMaker endpoint."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from .common import PARAMS, ROOT, console, deploy_app, tracking_uri, ws_of

log = logging.getLogger(__name__)


@deploy_app.command("local")
def deploy_local(root: Path = ROOT, params: Path = PARAMS):
    """The cycle's deploy step by hand: the registry champion → data/drafts/champion (atomic), a running
    server ($TIDESPEC_SERVER_URL) told to hot-swap, then deploy.sagemaker.on_promote profiles. Needs
    MLFLOW_TRACKING_URI."""
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.cycle import step_deploy
    p = load_params(params)
    dep = step_deploy(ws_of(root), tracking_uri(), target_id(p), p)
    console.print_json(json.dumps(dep, default=str))

@deploy_app.command("sagemaker")
def deploy_sagemaker(profile: str = typer.Option(..., help="deploy.sagemaker.profiles name: gpu (SGLang) | trn2 "
                                                          "(vLLM-neuron) or your own"),
                     version: str = typer.Option(None, help="registry version or alias to deploy (needs "
                                                            "MLFLOW_TRACKING_URI); default: data/drafts/champion"),
                     draft: Path = typer.Option(None, help="a draft checkpoint dir instead"),
                     dry_run: bool = typer.Option(False, "--dry-run", help="print the requests; call nothing"),
                     wait: bool = typer.Option(True, help="wait until InService on the new config"),
                     root: Path = ROOT, params: Path = PARAMS):
    """Upload the champion draft to S3 and create or blue/green-update the profile's SageMaker endpoint
    (Model with the engine's EAGLE3 settings, EndpointConfig, auto-rollback alarms); waits."""
    from ..adapters import sagemaker_deploy as smd
    from ..config import load_params
    from ..models.hf_files import target_id
    p = load_params(params)
    if p.deploy.sagemaker is None:
        raise ValueError(f"{params}: deploy.sagemaker is not configured (role_arn, s3_prefix, target_model); "
                         "see infra/README.md")
    tid = target_id(p)
    if p.target.quantization != "none":  # said, never silently dropped: the endpoint's engine has its own kernels
        prof = p.deploy.sagemaker.profiles.get(profile)
        console.print(f"deploy: target.quantization {p.target.quantization} is the embedded engine's; the endpoint's "
                      f"{prof.engine if prof else 'engine'} serves the target as uploaded (unquantized) with this "
                      "draft", markup=False)
    if draft is not None and version is not None:
        raise typer.BadParameter("give one of --version and --draft")
    if version is not None:
        from ..adapters import registry
        try:
            path = registry.download_version(tracking_uri(), tid, version, ws_of(root).work / "sagemaker-draft")
        except LookupError as e:
            raise ValueError(f"{e}; list versions in the MLflow UI or pass --draft DIR") from None
        art = smd.check_draft(path, tid)
    else:
        art = _live_windows(smd.check_draft(draft or ws_of(root).champion, tid), tid)
    if dry_run:
        uri, local = smd.resolve_target(p, p.deploy.sagemaker)
        if local is not None:
            uri = smd.target_prefix(p.deploy.sagemaker.s3_prefix, tid)
        plan = smd.plan(p, p.deploy.sagemaker, profile, art, tid, uri, smd.region_of(p.deploy.sagemaker))
        print(json.dumps(plan.to_json(), indent=2, default=str))
        return
    out = smd.deploy_endpoint(p, profile, art, tid, wait=wait, lock_dir=ws_of(root).work)
    console.print(json.dumps(out, indent=2, default=str), highlight=False)

def _live_windows(art, tid: str):
    """`art` with its registry version's current windows (`registry.tuned_k`: live-tuned where the
    serving engine measured them since the version.json was written), and its replayed τ(k) where
    version.json has none (a champion installed before versions carried it: `registry.version_tau_k`),
    when MLFLOW_TRACKING_URI is set."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or art.version is None:
        return art
    from dataclasses import replace

    from ..adapters import registry
    info = registry.version_info(uri, tid, art.version)
    k = registry.tuned_k(info.tags)
    if k and dict(art.tuned_k) != k:
        console.print(f"windows of v{art.version} from the registry: {k} (version.json had {dict(art.tuned_k)})",
                      markup=False)
    art = replace(art, tuned_k=tuple(sorted(k.items()))) if k else art
    return art if art.tau_k else replace(art, tau_k=tuple(registry.version_tau_k(uri, info.tags, info.run_id)))
