"""``python -m liferaft``: the ``liferaft`` command."""

from liferaft.cli import main

raise SystemExit(main())
