"""``python -m kvmosaic.serve --replicas 2 --router cache-aware``."""

from .cli import main

raise SystemExit(main())
