"""Identifier validation.

Tenant, job and backbone ids become NATS subject tokens, so they are restricted to
``[a-z0-9][a-z0-9-]{0,63}``: no ``.``, ``*``, ``>`` or whitespace can reach a subject.
"""

from __future__ import annotations

import re

#: The longest id.
MAX_ID_CHARS = 64
ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,63}$"
_ID_RE = re.compile(ID_PATTERN)


class InvalidIdError(ValueError):
    """An id that would not be a safe single subject token."""


def validate_id(value: str, kind: str = "id") -> str:
    """Return ``value`` if it is a valid id, else raise :class:`InvalidIdError` naming ``kind``."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise InvalidIdError(
            f"invalid {kind} {value!r}: must match {ID_PATTERN} "
            "(lowercase letters, digits and '-', 1-64 chars, not starting with '-')"
        )
    return value
