"""``python -m karma_fx``: the same as the ``karma-fx`` console script."""
from karma_fx.cli import main

raise SystemExit(main())
