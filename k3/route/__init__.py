"""`k3 route`: an OpenAI-compatible front for several `k3 serve` replicas (K3 report §7.4): session
affinity over a consistent-hash ring, health checks and failover, budgeted admission. See docs/ROUTING.md."""
