"""``python -m s3dcp.cli``: the ``s3dcp`` command."""

from . import main

raise SystemExit(main())
