"""blendmatch: which cached KV chunks does a token sequence contain, and where?

The distribution installs three rooms as subpackages (docs/architecture.md, "The rooms"):
``blendmatch.index`` (the host truth), ``blendmatch.gpu`` (the probe engines) and
``blendmatch.service`` (HTTP, batching, CLI, client).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
