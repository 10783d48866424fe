"""Serving: the engine with K3's hybrid paged cache and the OpenAI-compatible server (docs/SERVING.md).

Layers, each talking only to the next: block_pool -> prefix_cache / cache_manager -> scheduler
(ids and counts) -> runner (the only tensor code) -> engine -> api/. Entry points: `k3 serve`
(k3/serve/cli.py) and `k3 chat` (k3/serve/chat_cli.py).
"""
