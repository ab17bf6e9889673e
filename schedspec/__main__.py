"""``python -m schedspec``: the same as the ``schedspec`` console script."""

from schedspec.cli import main

main()
