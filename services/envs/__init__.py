"""Env workers: simulator sessions (RL rollouts, evaluation) and offline datasets (SFT).

Import :mod:`services.envs.service` for the entry point; this package stays light so that
``python -m services.envs`` can take stop signals before its heavy imports.
"""
