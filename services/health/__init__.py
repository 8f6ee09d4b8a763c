"""The health manager: tracks the liveness of every role instance from heartbeats.

Import :mod:`services.health.service` for the entry point; this package stays light so that
``python -m services.health`` can take stop signals before its heavy imports.
"""
