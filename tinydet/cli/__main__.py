"""`python -m tinydet.cli`: the command, as when the package was the module cli.py (without
`python -m tinydet`'s early signal handling)."""

from . import main

main()
