"""blendmatch: which cached KV chunks does a token sequence contain, and where?

The distribution installs three rooms as subpackages (docs/architecture.md, "The rooms"):
``blendmatch.index`` (the host truth), ``blendmatch.gpu`` (the probe engines) and
``blendmatch.service`` (HTTP, batching, CLI, client).

Importing the package points numba's compile cache at a per-user folder
(``compile_cache.py``) before any kernel is decorated: nothing is ever written into the
installed package.
"""

from . import compile_cache as _compile_cache

_compile_cache.configure()

__version__ = "0.1.0"
__all__ = ["__version__"]
