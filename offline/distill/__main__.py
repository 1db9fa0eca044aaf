"""`python -m offline.distill` = `specdec distill`."""

from offline.distill.pipeline import main

raise SystemExit(main())
