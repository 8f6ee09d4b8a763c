"""The backbone role: the frozen backbone served apart from the heads, answering grouped
encode requests with feature records (``joynexus up --backbone-service``).

Import :mod:`services.backbone.service` for the entry point; this package stays light so that
``python -m services.backbone`` can take stop signals before its heavy imports.
"""
