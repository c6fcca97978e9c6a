"""Rollout workers: the multi-turn agent loop, token-in/token-out trajectories on NATS."""
