"""Where numba keeps the compiled code of blendmatch's kernels: one rule, applied on import.

Question answered: "which folder holds the compile cache, and is it one this user can
write?" Every ``@numba.njit(cache=True)`` function of the package picks its cache folder
once, when it is decorated (numba's ``caching.UserProvidedCacheLocator`` reads
``numba.config.CACHE_DIR``; without it numba writes next to the source, into the
installed package's ``__pycache__``, which a read-only or root-owned site-packages cannot
take and which an uninstall leaves behind to shadow the next install). So
``blendmatch/__init__.py`` calls :func:`configure` before any of the package's modules
is imported, for the CLI and for library users alike.

The folder (:func:`cache_root`; numba's files go in ``<it>/numba``):

1. ``blendmatch serve --cache-dir DIR`` / ``blendmatch warmup --cache-dir DIR``
   (:func:`configure` with ``cache_dir``; the CLI applies it before anything is compiled);
2. ``$BLENDMATCH_CACHE_DIR``;
3. ``$NUMBA_CACHE_DIR`` as the user set it (numba's files go there directly);
4. ``$XDG_CACHE_HOME/blendmatch``, else ``~/.cache/blendmatch``.

It is set as numba's documented ``NUMBA_CACHE_DIR`` (the environment, so that worker
processes inherit it, and ``numba.config.CACHE_DIR`` when numba is already imported), so
it also holds the cache of other ``cache=True`` functions of the same process.

A folder that cannot be written (a read-only home, a file in the way): one WARNING, and
the process runs uncached, compiling at every start; its cache goes to a private
temporary folder removed at exit, so numba neither fails nor falls back to the package.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

__all__ = ["CACHE_DIR_ENV", "CacheSetting", "cache_root", "configure", "current"]

log = logging.getLogger("blendmatch.compile_cache")

#: The environment variable naming blendmatch's cache folder (numba's files in ``<it>/numba``).
CACHE_DIR_ENV = "BLENDMATCH_CACHE_DIR"
_NUMBA_ENV = "NUMBA_CACHE_DIR"


@dataclass(frozen=True)
class CacheSetting:
    """What :func:`configure` decided. ``folder``: numba's cache folder in use;
    ``chosen``: the folder the rule chose (equal to ``folder`` unless that was not
    writable); ``source``: what chose it; ``problem``: why ``chosen`` is not used ("" when
    it is)."""

    folder: str
    chosen: str
    source: str
    problem: str = ""

    @property
    def persistent(self) -> bool:
        """Whether compiled code outlives the process (False: running uncached)."""
        return not self.problem

    def describe(self) -> str:
        """One phrase for the start-up log."""
        if self.persistent:
            return f"{self.folder} (from {self.source})"
        return f"none: {self.chosen} (from {self.source}) is not writable ({self.problem}); compiling at every start"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """blendmatch's cache folder by the environment: ``$BLENDMATCH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/blendmatch``, else ``~/.cache/blendmatch`` (the XDG base-directory
    rule: a relative ``XDG_CACHE_HOME`` is ignored)."""
    own = environ.get(CACHE_DIR_ENV, "")
    if own:
        return Path(own).expanduser()
    xdg = environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "blendmatch"


def _choose(cache_dir: Optional[str], environ: Mapping[str, str]) -> tuple[str, str]:
    """``(numba's folder, what chose it)`` by the rule in the module docstring."""
    if cache_dir:
        return str(Path(cache_dir).expanduser() / "numba"), "--cache-dir"
    if environ.get(CACHE_DIR_ENV):
        return str(cache_root(environ) / "numba"), f"${CACHE_DIR_ENV}"
    numba_env = environ.get(_NUMBA_ENV, "")
    if numba_env and numba_env != _state.get("set"):  # the user's (or a parent process's) choice
        return numba_env, f"${_NUMBA_ENV}"
    config = sys.modules.get("numba.core.config")
    set_in_numba = getattr(config, "CACHE_DIR", "") if config is not None else ""
    if set_in_numba and set_in_numba != _state.get("set"):  # set in numba.config by the program
        return set_in_numba, "numba.config.CACHE_DIR"
    source = "$XDG_CACHE_HOME" if environ.get("XDG_CACHE_HOME") else "the default ~/.cache"
    return str(cache_root(environ) / "numba"), source


def _unwritable(folder: str) -> str:
    """Why numba could not create and write ``folder`` ("" when it could), without
    creating anything: the folder, or its nearest existing ancestor, must be a writable
    directory."""
    path = Path(os.path.abspath(folder))
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "no existing parent"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return ""


#: ``set``: the folder this module put in NUMBA_CACHE_DIR; ``temp``: its temporary folder.
_state: dict[str, str] = {}
_current: list[CacheSetting] = []
_warned: set[str] = set()


def _temporary_folder() -> str:
    temp = _state.get("temp")
    if temp is None:
        temp = tempfile.mkdtemp(prefix="blendmatch-numba-")
        _state["temp"] = temp
        atexit.register(_remove, temp, os.getpid())
    return temp


def _remove(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked child's exit: the folder is its parent's
        shutil.rmtree(folder, ignore_errors=True)


def configure(cache_dir: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> CacheSetting:
    """Point numba's compile cache at the folder the rule chooses (module docstring) and
    return the decision. Idempotent; a later call changes the folder only for functions
    decorated after it (the CLI calls it with ``--cache-dir`` before importing any kernel)."""
    env = os.environ if environ is None else environ
    try:
        chosen, source = _choose(cache_dir, env)
    except RuntimeError as exc:  # no home folder to be found (Path.home())
        chosen, source = "~/.cache/blendmatch/numba", "the default ~/.cache"
        problem = f"no home folder: {exc}"
    else:
        problem = _unwritable(chosen)
    folder = chosen
    if problem:
        folder = _temporary_folder()
        if chosen not in _warned:
            _warned.add(chosen)
            log.warning("compile cache %s (from %s) is not writable (%s): running uncached, every start compiles "
                        "again (~20 s); set --cache-dir or %s to a writable folder", chosen, source, problem,
                        CACHE_DIR_ENV)
    elif "temp" in _state and folder != _state["temp"]:
        shutil.rmtree(_state.pop("temp"), ignore_errors=True)
    os.environ[_NUMBA_ENV] = folder
    _state["set"] = folder
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba read the environment already: tell it directly too
        config.CACHE_DIR = folder
    setting = CacheSetting(folder, chosen, source, problem)
    _current[:] = [setting]
    return setting


def current() -> CacheSetting:
    """The setting in force (what the last :func:`configure` decided)."""
    return _current[0] if _current else configure()
