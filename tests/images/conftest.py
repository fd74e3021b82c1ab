"""The image tier: the OCI archives `make images` writes to build/images/, read and run.

Runs from `make images` (images/images.mk), which sets TPUSYNC_IMAGES; elsewhere this folder
collects nothing (there are no archives to read)."""

from __future__ import annotations

import os

from tests.conftest import not_collected

if not os.environ.get("TPUSYNC_IMAGES"):
    collect_ignore_glob = not_collected("tests/images",
                                        "no image archives (TPUSYNC_IMAGES); `make images` builds and runs it")
