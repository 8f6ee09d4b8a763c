"""Which creds file a client connects with, and whose it is."""

from __future__ import annotations

from pathlib import Path

from bus.identity import is_joynexus_creds, load_creds
from schemas.ids import validate_id


def tenant_of_creds(creds: Path) -> str | None:
    """The tenant a creds file of ours names (None for another role or a JWT ``.creds``)."""
    if not is_joynexus_creds(creds):
        return None
    identity = load_creds(creds).identity
    return identity.name if identity.role == "tenant" else None


def local_creds(creds_dir: Path, tenant: str | None) -> Path:
    """The creds file a client of a local stack uses: the tenant's, else the operator's."""
    if tenant is not None:
        own = creds_dir / f"{validate_id(tenant, 'tenant')}.creds"
        if own.exists():
            return own
    operator = creds_dir / "operator.creds"
    if not operator.exists():
        raise ConnectionError(f"no creds for tenant {tenant!r} or the operator in {creds_dir}")
    return operator
