"""The master: consumes ``JOBS``, validates job specs, owns the ``jobs`` KV state machine.

Import :mod:`services.master.service` for the entry point; this package stays light so that
``python -m services.master`` can take stop signals before its heavy imports.
"""
