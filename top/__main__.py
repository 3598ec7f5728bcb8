"""``python -m blendmatch`` is ``blendmatch`` (the CLI)."""

from blendmatch.service.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
