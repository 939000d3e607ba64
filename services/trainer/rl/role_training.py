"""The update of a multi-agent self-play job with one LoRA adapter per role: each role's
adapter is trained on that role's trajectories only (advantages grouped within the role: a
role's GRPO group is its views of the games that shared a seed), one ``rl_update`` per role
with that role's adapter active. The figures of the roles are merged into one ``TrainStats``
(token means weighted by trained tokens, step means by optimizer steps)."""

from __future__ import annotations

from opentinker.errors import ConfigError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.parallel.ranks import LeaderPolicy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.critic import Critic
from opentinker.services.trainer.rl.reference import ReferencePolicy
from opentinker.services.trainer.rl.training import TrainStats, rl_update
from opentinker.spec import RlConfig

_TOKEN_MEANS = ("entropy", "clip_fraction", "ratio_mean", "logprob_gap", "kl", "padding_share")
_STEP_MEANS = ("loss", "grad_norm", "value_loss")


def adopt_roles(policy: Policy | LeaderPolicy, roles: tuple[str, ...], rl: RlConfig) -> bool:
    """Give ``policy`` one adapter per role when the job asks for it (``role_adapters``
    per_role, LoRA, an env with roles); True when it did. ConfigError on several ranks (a
    ``LeaderPolicy``), which train one shared adapter only: the spec cannot refuse it, as
    only the env knows its roles."""
    if not roles or rl.role_adapters != "per_role" or not policy.is_lora:
        return False
    if isinstance(policy, LeaderPolicy):
        raise ConfigError(
            f"rl.role_adapters: 'per_role' (one adapter per role of {list(roles)}) cannot train "
            "on several ranks yet; set rl.role_adapters 'shared' or num_devices 1"
        )
    policy.use_role_adapters(roles)
    return True


def role_update(
    policy: Policy,
    episodes: list[Episode],
    config: UpdateConfig,
    *,
    reference: ReferencePolicy | None = None,
    critic: Critic | None = None,
) -> TrainStats:
    """One update per role present in ``episodes`` (non-empty), each through its adapter."""
    by_role: dict[str, list[Episode]] = {}
    for ep in episodes:
        if ep.role not in policy.role_adapters:
            raise ValueError(
                f"a trajectory of role {ep.role!r} came for a policy with adapters for "
                f"{policy.role_adapters}"
            )
        by_role.setdefault(ep.role, []).append(ep)
    stats = []
    for role in policy.role_adapters:
        if by_role.get(role):
            policy.activate_role(role)
            stats.append(
                rl_update(policy, by_role[role], config, reference=reference, critic=critic)
            )
    policy.activate_role(policy.role_adapters[0])
    return merge_stats(stats)


def merge_stats(parts: list[TrainStats]) -> TrainStats:
    """The figures of several updates as one (see the module docstring)."""

    def mean(name: str, weights: list[int]) -> float:
        total = sum(weights)
        values = [getattr(p, name) for p in parts]
        if total == 0:
            return sum(values) / len(values)
        return sum(v * w for v, w in zip(values, weights, strict=True)) / total

    tokens = [p.trained_tokens for p in parts]
    steps = [p.optimizer_steps for p in parts]
    figures = {name: mean(name, tokens) for name in _TOKEN_MEANS}
    figures.update({name: mean(name, steps) for name in _STEP_MEANS})
    return TrainStats(
        **figures,
        sequences=sum(p.sequences for p in parts),
        trained_tokens=sum(tokens),
        explained_variance=mean("explained_variance", tokens),
        optimizer_steps=sum(steps),
    )
