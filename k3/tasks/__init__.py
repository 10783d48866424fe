"""The task world the post-training stages share as peers: the tools and their facts (tools.py),
conversations in K3's chat form and their checks (conversations.py), the default tool-use set
(default_set.py), how a reply is scored (scoring.py), the RL domains (domains.py), and the one
runner of agent episodes over any of them (episodes.py). `k3.sft`, `k3.rl` and evaluation import
it; it imports none of them (tests/test_layout.py)."""
