"""The suite's own isolation: files that one xdist worker runs share its session's MLflow server."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SEED = re.compile(r"make_tiny_target\([^)]*seed=(\d+)")


def test_files_that_register_do_not_share_a_tiny_target_seed():
    """A tiny target's seed is its registered model (the target id names it): two files registering
    into the session's MLflow with one seed see each other's champion (a gate expecting a first
    champion then meets one), depending on which files a worker happens to run."""
    owners = {}
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        if "mlflow_server" not in text:
            continue
        for seed in set(SEED.findall(text)):
            owners.setdefault(int(seed), []).append(path.name)
    shared = {seed: files for seed, files in owners.items() if len(files) > 1}
    assert not shared, f"tiny target seeds used by more than one file that registers: {shared}"
    assert owners, "no file registering a seeded tiny target was found: the pattern above is stale"
