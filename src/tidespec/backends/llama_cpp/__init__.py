"""The llama.cpp adapter: llama.cpp's `llama-server` and draft converter built from pinned sources
(`build`, `make llama-server`)."""

from .build import ENV_HOME, LLAMA_CPP_COMMIT, SDIST, build_llama_server, server_binary, server_home

__all__ = ["ENV_HOME", "LLAMA_CPP_COMMIT", "SDIST", "build_llama_server", "server_binary", "server_home"]
