"""A library that warns the way third-party libraries do, on import: a Python warning (deprecations,
torch's UserWarnings) and a logging warning (the stdlib logger most libraries write to)."""

import logging
import warnings

warnings.warn("noisy_library.old_api is deprecated: use new_api", FutureWarning, stacklevel=2)
logging.getLogger("noisy_library").warning("noisy_library: no config file found, using defaults")
