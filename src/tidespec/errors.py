"""The base of tidespec's own errors (bottom layer, no imports).

`tidespec` (cli.main) prints any `TidespecError` as one line and exits 2: a service, backend,
registry or cloud API said no, and the message names the fix. Bad input stays ValueError /
FileNotFoundError (also one line, exit 2).
"""


class TidespecError(RuntimeError):
    """A failure the user can act on; the message names the fix."""

    label = "error"


class Unavailable(TidespecError):
    """A backend that cannot run here (no GPU, its environment or package missing)."""

    label = "unavailable"
