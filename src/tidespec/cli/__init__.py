"""The `tidespec` command line (typer), the top layer: one small module per command group, each
registering its commands on the app in `common`; the benchmark commands live in `bench/cli.py`.

Each command imports what it runs inside its function: `tidespec serve` must start on a serve-only
install (no Prefect, MLflow, DVC or boto3: `pip install 'tidespec[serve]'`) and `--help` stays fast.
These imports only point down (tests/test_architecture.py checks function-level imports too).
"""
from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import TidespecError
from . import (  # noqa: F401 - each registers its commands
    demo,
    deploy,
    fleet,
    loop,
    rollout,
    serve,
    services,
    snapshots,
    stages,
)
from .common import app

EXTRAS = {"prefect": "mlops", "mlflow": "mlops", "dvc": "mlops", "matplotlib": "mlops", "boto3": "aws",
          "botocore": "aws", "fastapi": "serve", "uvicorn": "serve", "httpx": "serve"}  # package → extra

__all__ = ["app", "main"]


def main() -> None:
    """Console entry point: bad input (ValueError/FileNotFoundError), any `errors.TidespecError` (an
    unavailable backend, a busy capture dir, a failed git/dvc command, a refused registry decision,
    a missing deployment, a service that will not start, a SageMaker rollback) or an AWS error →
    one clear line, exit 2."""
    try:
        app(standalone_mode=False)
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        sys.exit(2)
    except ModuleNotFoundError as e:  # a command of an extra this install lacks
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        Console(stderr=True).print(
            "[red]error:[/red] "
            + escape(f"this command needs {e.name!r}, which this install lacks: pip install 'tidespec[{extra}]'"),
            soft_wrap=True,
        )
        sys.exit(2)
    except TidespecError as e:  # a service, backend, registry or cloud API said no; the message names the fix
        Console(stderr=True).print(f"[red]{e.label}:[/red] {e}")
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        if type(e).__module__.split(".")[0] in ("botocore", "boto3"):  # AWS said no: one line, exit 2 (no boto3 import:
            # a serve-only install has none)
            Console(stderr=True).print(f"[red]aws error:[/red] {e}")
            sys.exit(2)
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # usage errors (typer's click) keep their formatting
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
