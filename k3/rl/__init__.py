"""Reinforcement learning after SFT (DESIGN §13.2-§13.4): rollouts through the serving
engine with partial rollout (rollout.py), the per-token policy objective and the trainer's packed
log-probs (objective.py), verifiable task domains (domains.py) and effort budgets (effort.py).
docs/RL.md describes what exists and what remains."""
