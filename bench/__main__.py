import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread, like the services

from bench.runner import main  # noqa: E402

raise SystemExit(main())
