"""An RL trainer reduced to its update (`RLTrainer.optimize`): a tiny model, the real optimizer,
schedule, balance rule and graph step, no run folder, rollout engine or budgets; and random
trajectories to train on (what rollouts would have sampled)."""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.rl.distill import DistillTrainer
from k3.rl.objective import ObjectiveConfig
from k3.rl.trainer import RLTrainer
from k3.train.muon import param_groups
from k3.train.parallel import World

VOCAB = 320


def update_only_trainer(device: str = "cpu", *, graphs: bool, seed: int = 0, cls=RLTrainer, **changes) -> RLTrainer:
    """An RLTrainer (or DistillTrainer: one teacher, another random model) whose `optimize()` runs as
    in a run; `graphs`: through GraphStep even off CUDA (there it runs the padded host-free body
    eagerly), else the eager update."""
    s = dataclasses.replace(cls.SETTINGS(device=device, lr=1e-2, steps=8, temperature=0.9, cuda_graphs=graphs),
                            **changes)
    trainer = cls.__new__(cls)
    trainer.s, trainer.world, trainer.progress = s, World(0, 1, torch.device(device)), False
    trainer.log = lambda *_a, **_k: None
    torch.manual_seed(seed)
    trainer.config = load_config("k3-tiny").replace(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, kda_layers=[], full_attn_layers=[],
        intermediate_size=96, num_experts=4, num_experts_per_token=2, kda_chunk_size=16)
    trainer.model = K3ForCausalLM(trainer.config).to(device)
    trainer.objective = ObjectiveConfig(s.eps_low, s.eps_high, getattr(s, "kl_coef", 0.0))
    trainer.ref_model = None
    if isinstance(trainer, DistillTrainer):
        trainer.teachers, trainer.teacher_gap = [SimpleNamespace(model=K3ForCausalLM(trainer.config).to(device))], []
    elif s.kl_coef > 0:  # a reference that differs from the policy: the KL term has a gradient
        trainer.ref_model = copy.deepcopy(trainer.model).eval().requires_grad_(False)
        with torch.no_grad():
            trainer.ref_model.lm_head.weight.mul_(1.5)
    trainer.rollouts = SimpleNamespace(policy_version=0)
    if graphs:
        trainer._graph_refusal = lambda: None  # CPU too: GraphStep then runs its body eagerly
    trainer._start_optimizer(param_groups(trainer.model, trainer.config, weight_decay=s.weight_decay,
                                          optimizer=s.optimizer), resume=False)
    return trainer


def random_trajectories(seed: int, lengths: list[tuple[int, int]], version: int = 0) -> tuple[list, list[float]]:
    """Trajectories of (prompt, completion) lengths with random tokens, behaviour log-probs around
    the uniform policy's (ratios spread over both clip bounds), versions up to `version` and
    teacher 0, and an advantage each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, c in lengths:
        out.append(SimpleNamespace(
            prompt_ids=torch.randint(3, VOCAB, (p,), generator=g).tolist(),
            completion_ids=torch.randint(3, VOCAB, (c,), generator=g).tolist(),
            logprobs=(-5.77 + 0.4 * torch.randn(c, generator=g)).tolist(),
            versions=torch.randint(0, version + 1, (c,), generator=g).tolist(), tag={"teacher": 0}))
    return out, (2 * torch.rand(len(out), generator=g) - 1).tolist()
