"""`python -m linformer_kit.cli ...`: the `linformer` command without its console script."""

from . import main

main()
