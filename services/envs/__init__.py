"""Env workers: simulator sessions (RL rollouts, evaluation) and offline datasets (SFT)."""
