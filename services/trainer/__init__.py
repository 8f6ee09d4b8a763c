"""The trainer: holds the resident backbone and tenant slots, consumes the Training Queue.

Import :mod:`services.trainer.service` for the entry point; this package stays light so that
``python -m services.trainer`` can take stop signals before its heavy imports.
"""
