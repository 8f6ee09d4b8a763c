"""The inferencer: serves tenants' policies from ``INFER`` with group-batched forwards.

``python -m services.inferencer`` runs the service (:func:`run`, :class:`InferencerConfig`);
requesters use :class:`bus.inference.PolicyClient`.
"""

from services.inferencer.service import InferencerConfig, run

__all__ = ["InferencerConfig", "run"]
