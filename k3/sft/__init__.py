"""Supervised fine-tuning data: the default tool-use set, reading user data, and held-out scoring."""
