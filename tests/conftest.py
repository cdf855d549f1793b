"""Suite-wide settings: the chunked kernel's compiled tiles are off by default in tests (each
compilation costs seconds); tests/kernels/test_compiled.py switches them on where it checks them."""

import os

os.environ.setdefault("ATTNKIT_COMPILE_TILES", "0")
