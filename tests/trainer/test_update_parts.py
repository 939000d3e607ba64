"""The update's pure parts: LR schedule, micro-batch split, per-token advantages of episodes."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.services.trainer.model.microbatch import group_by_token_budget
from opentinker.services.trainer.model.schedule import lr_factor
from opentinker.services.trainer.rl.advantages import (
    episode_advantages,
    token_advantages,
    turn_rewards_per_token,
)
from opentinker.services.trainer.rl.batch import Episode, collate

pytestmark = pytest.mark.unit


def test_warmup_then_constant() -> None:
    # warmup 4: (s + 1) / 4 -> 0.25, 0.5, 0.75, 1.0; then 1
    factors = [lr_factor(s, total_steps=10, warmup_steps=4, schedule="constant") for s in range(6)]
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_and_cosine_decay_after_warmup() -> None:
    # warmup 2, total 6: progress at step s >= 2 is (s - 2) / 4
    # linear at s = 4: 1 - 2/4 = 0.5; cosine at s = 4: (1 + cos(pi/2)) / 2 = 0.5
    # at s = 3: linear 0.75, cosine (1 + cos(pi/4)) / 2 = 0.8536
    assert lr_factor(4, total_steps=6, warmup_steps=2, schedule="linear") == pytest.approx(0.5)
    assert lr_factor(4, total_steps=6, warmup_steps=2, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(3, total_steps=6, warmup_steps=2, schedule="linear") == pytest.approx(0.75)
    assert lr_factor(3, total_steps=6, warmup_steps=2, schedule="cosine") == pytest.approx(
        (1 + math.cos(math.pi / 4)) / 2
    )
    # no warmup, step 0: full LR for every schedule
    assert lr_factor(0, total_steps=6, warmup_steps=0, schedule="cosine") == 1.0


def test_micro_batches_respect_the_token_budget() -> None:
    # longest first: 6 (i4) -> [4]; 5 (i2): 2 * 6 = 12 > 10 -> new [2]; 4 (i1): 2 * 5 = 10 ok;
    # 3 (i0): 3 * 5 = 15 > 10 -> new [0]; 2 (i3): 2 * 3 = 6 ok; each group in index order
    assert group_by_token_budget([3, 4, 5, 2, 6], 10) == [[4], [1, 2], [0, 3]]
    assert group_by_token_budget([3, 4, 5], 0) == [[0, 1, 2]]  # no budget: one group
    # a sequence over the budget goes alone (the spec keeps micro_batch_tokens >= an episode)
    assert group_by_token_budget([3, 5], 4) == [[1], [0]]


def test_micro_batches_are_cut_where_padding_would_pass_its_share() -> None:
    # multi-turn lengths, longest first. With 570: 6 x 1090 = 6540 padded, 5110 real (22%
    # padding); with 440 too: 7630 and 5550 (27%), so 440 starts the next pass
    lengths = [310, 830, 440, 1090, 570, 180, 700, 440, 1090, 830, 310]
    groups = group_by_token_budget(lengths, 0, 0.25)
    assert [sorted((lengths[i] for i in g), reverse=True) for g in groups] == [
        [1090, 1090, 830, 830, 700, 570],
        [440, 440, 310, 310, 180],  # 5 x 440 = 2200 padded, 1680 real: 24%
    ]
    for g in groups:  # no pass is more than a quarter padding
        longest = max(lengths[i] for i in g)
        assert sum(lengths[i] for i in g) >= 0.75 * len(g) * longest
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert group_by_token_budget(lengths, 0, 1.0) == [list(range(len(lengths)))]  # no cut
    assert len(group_by_token_budget(lengths, 0, 0.0)) == 7  # every distinct length alone
    # both limits: the budget of 3000 padded tokens cuts the first group at 2 x 1090
    assert [len(g) for g in group_by_token_budget(lengths, 3000, 0.25)][:2] == [2, 3]
    with pytest.raises(ValueError, match="max_padding"):
        group_by_token_budget(lengths, 0, 1.5)


def _episode(group: int, reward: float, completion: int = 2, **turns: object) -> Episode:
    ids = [1, 2] + [3] * completion
    return Episode(group, 0, ids, 2, [0.0] * completion, [1] * completion, reward, False, **turns)  # type: ignore[arg-type]


def test_single_turn_token_advantages_are_the_episode_advantages() -> None:
    # group rewards [1, 0] -> GRPO [1, -1] on each completion token (positions 1, 2 of T = 3)
    episodes = [_episode(0, 1.0), _episode(0, 0.0)]
    adv = token_advantages(episodes, 3, loss="grpo", gamma=1.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]]), atol=1e-5)
    assert torch.allclose(episode_advantages(episodes, "rloo"), torch.tensor([1.0, -1.0]))
    # reinforce over the batch [1, 0, 0, 3]: mean 1 -> [0, -1, -1, 2]
    four = [_episode(0, 1.0), _episode(0, 0.0), _episode(1, 0.0), _episode(1, 3.0)]
    assert torch.allclose(episode_advantages(four, "reinforce"), torch.tensor([0.0, -1, -1, 2]))


def test_multi_turn_tokens_get_their_turns_returns() -> None:
    # episode a: 2 turns, rewards [0, 1], ends [1, 3] of 3 completion tokens, gamma 0.5:
    #   G = [0 + 0.5*1, 1] = [0.5, 1]; episode b: 1 turn, reward 0 (G_0 = 0).
    # RLOO on G_0 [0.5, 0]: a -> 0.5 - 0 = 0.5, b -> 0 - 0.5 = -0.5 (scale 1)
    # a's tokens: turn 0 -> 0.5 + (0.5 - 0.5) = 0.5; turn 1 -> 0.5 + (1 - 0.5) = 1.0
    a = _episode(0, 1.0, 3, turn_rewards=(0.0, 1.0), turn_ends=(1, 3))
    b = _episode(0, 0.0, 3)
    adv = token_advantages([a, b], 4, loss="rloo", gamma=0.5)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, 1.0, 1.0], [0.0, -0.5, -0.5, -0.5]]))


def test_one_turn_given_as_turn_rewards_is_a_single_turn_episode() -> None:
    # The rollout sends every episode's turn rewards, a single-turn one's too: its tokens all
    # carry G_0 (after the turn's end as well: env tokens), so each gets the row's advantage,
    # the same as without turn rewards, for any gamma.
    stated = [
        _episode(0, 1.0, 3, turn_rewards=(1.0,), turn_ends=(2,)),
        _episode(0, 0.0, 3, turn_rewards=(0.0,), turn_ends=(3,)),
    ]
    plain = [_episode(0, 1.0, 3), _episode(0, 0.0, 3)]
    for loss in ("grpo", "rloo", "reinforce"):
        adv = token_advantages(stated, 4, loss=loss, gamma=0.5)
        assert torch.equal(adv, token_advantages(plain, 4, loss=loss, gamma=0.5))
    expected = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -1.0, -1.0, -1.0]])
    assert torch.allclose(token_advantages(stated, 4, loss="grpo", gamma=0.5), expected, atol=1e-5)
    beyond = _episode(0, 1.0, 3, turn_rewards=(1.0,), turn_ends=(4,))  # past the completion
    with pytest.raises(ValueError, match="turn ends"):
        token_advantages([beyond, plain[1]], 4, loss="grpo", gamma=1.0)


def test_turn_rewards_sit_on_each_turns_last_model_token() -> None:
    # completion [m, m, e, m] (e = env token, mask 0), turns end at 2 and 4, rewards [0.3, 1]
    # positions: completion token k at t = prompt_length - 1 + k = 1 + k -> last model token of
    # turn 0 is k = 1 (t = 2), of turn 1 k = 3 (t = 4)
    ep = Episode(0, 0, [1, 2, 3, 3, 9, 3], 2, [0.0] * 4, [1, 1, 0, 1], 1.3, False,
                 turn_rewards=(0.3, 1.0), turn_ends=(2, 4))  # fmt: skip
    mask = collate([ep], 0).loss_mask_B_T
    assert torch.allclose(
        turn_rewards_per_token([ep], mask), torch.tensor([[0.0, 0.0, 0.3, 0.0, 1.0]])
    )


def test_a_multi_turn_group_with_equal_episode_returns_is_not_scaled_by_rounding() -> None:
    """Three episodes whose turns add up to 0.9 each: the group's std must be 0, so its
    per-turn scale 1 (the turns' own differences as they are). In float32 it came out 6e-8,
    and the per-turn advantages ~1e6 (-8.5e5 on a turn-1 token)."""
    turns = [(0.9, 0.0), (0.0, 0.9), (0.45, 0.45)]
    episodes = [_episode(0, sum(t), 2, turn_rewards=t, turn_ends=(1, 2)) for t in turns]
    adv = token_advantages(episodes, 3, loss="grpo", gamma=1.0)
    # turn 0 -> 0 + (G_0 - G_0) = 0; turn 1 -> 0 + (G_1 - G_0) = the turn-1 reward - 0.9
    expected = torch.tensor([[0.0, 0.0, -0.9], [0.0, 0.0, 0.0], [0.0, 0.0, -0.45]])
    assert torch.allclose(adv, expected, atol=1e-6), adv
