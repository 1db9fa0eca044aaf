import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread, like the services

import sys  # noqa: E402

if "--serving" in sys.argv[1:]:  # the serving benchmark, with options of its own
    from bench.serving import main  # noqa: E402
else:
    from bench.runner import main  # noqa: E402

raise SystemExit(main())
