"""Print the service's OpenAPI schema: ``python -m blendmatch.service.openapi > docs/openapi.json``.

The committed ``docs/openapi.json`` is the HTTP contract; ``tests/test_service_openapi.py``
fails when the app's schema drifts from it and prints this command to regenerate it.
The schema does not depend on the configuration or on the machine (the app is built with
the reference engine so that no GPU probe runs).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

__all__ = ["current_schema", "render", "main", "REGENERATE"]

#: The one-line command that rewrites the committed schema.
REGENERATE = "python -m blendmatch.service.openapi > docs/openapi.json"


def current_schema() -> dict[str, Any]:
    """The OpenAPI schema of a default app."""
    from .app import create_app
    from .config import ServiceConfig

    return create_app(ServiceConfig(engine="reference")).openapi()


def render(schema: dict[str, Any]) -> str:
    """Stable text form (sorted keys, 2-space indent, trailing newline) for diffs."""
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None, *, prog: str = "blendmatch openapi") -> int:
    """Print the schema; no options (``--help`` says so; anything else is a usage error)."""
    import argparse

    argparse.ArgumentParser(prog=prog, description="Print the service's OpenAPI schema (JSON) on stdout. "
                                                   f"To regenerate the committed contract: {REGENERATE}"
                            ).parse_args(list(argv or ()))
    sys.stdout.write(render(current_schema()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], prog="python -m blendmatch.service.openapi"))
