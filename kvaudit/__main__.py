"""``python -m kvaudit``: the same as the ``kvaudit`` console script."""

from kvaudit.entry import main

main()
