"""Where the tests find the checkout and the data beside it."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tests/helpers/paths.py -> the checkout

# Real MNIST digits live beside the checkout (../shared/data); GEM_SHARED_DATA can point elsewhere.
SHARED_DATA = Path(os.environ.get("GEM_SHARED_DATA", ROOT.parent / "shared" / "data"))
