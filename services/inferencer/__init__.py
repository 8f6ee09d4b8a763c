"""The inferencer: serves tenants' policies from ``INFER`` with group-batched forwards.

``python -m services.inferencer`` runs the service (:func:`run`, :class:`InferencerConfig`);
requesters use :class:`bus.inference.PolicyClient`.


Import :mod:`services.inferencer.service` for the entry point; this package stays light so that
``python -m services.inferencer`` can take stop signals before its heavy imports.
"""
