"""Errors a client gets back from the service."""

from __future__ import annotations


class RequestError(RuntimeError):
    """The master refused or could not answer a request: ``code`` as in
    :class:`schemas.tenantctl.CtlError` (``no_master`` when nobody answered), ``retryable``
    whether asking again may help."""

    def __init__(self, message: str, *, code: str, retryable: bool) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
