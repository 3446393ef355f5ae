"""`python -m tidespec.cli`: the `tidespec` command."""
from . import main

main()
