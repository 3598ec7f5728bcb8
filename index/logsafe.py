"""One escaping rule for client-supplied strings that reach a log line.

Why: an instance id, a model name or a path comes from the network. Formatted into a log
line as it is, a ``\\n`` in it forges a second log line (an instance id sent as
``a%0A2025-01-01 ERROR ...`` in a URL), and other control characters (ANSI escapes, ``\\r``,
NUL) can rewrite a terminal or confuse a log shipper. Every log call that formats client
data passes it through :func:`log_safe` first; nothing else escapes on its own.

The rule: printable characters stay as they are; a backslash becomes ``\\\\`` (so an escaped
form is never ambiguous with a literal one); every other character that is not printable
(C0/C1 controls, DEL, line and paragraph separators, format characters, unassigned code
points) becomes ``\\xNN`` / ``\\uNNNN`` / ``\\UNNNNNNNN``. Long values are cut to
``limit`` characters with a ``...(+N)`` suffix, so one request cannot write megabytes into a
log. Non-strings are formatted with ``str`` first and escaped the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["log_safe", "LOG_VALUE_LIMIT"]

#: Most characters of one client value written to a log line.
LOG_VALUE_LIMIT = 200


def _escape_char(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def log_safe(value: Any, limit: int = LOG_VALUE_LIMIT) -> str:
    """``value`` as one printable, bounded log token (see the module docstring)."""
    text = value if isinstance(value, str) else str(value)
    extra = len(text) - limit
    if extra > 0:
        text = text[:limit]
    if not (text.isprintable() and "\\" not in text):  # the common case costs one C-level scan
        text = "".join(_escape_char(ch) for ch in text)
    return f"{text}...(+{extra})" if extra > 0 else text
