"""`python -m tidespec.backends.llama_cpp [JOBS]`: `make llama-server` (`build.main`)."""
from .build import main

main()
