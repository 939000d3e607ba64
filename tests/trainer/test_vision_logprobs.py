"""An image episode: the rollout samples turns with the figure's pixels; the trainer recomputes
every sampled token's logprob from the kept token ids and image bytes, equal within 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from opentinker.services.envhub.games.geometry_env import GeometryToolsGame
from opentinker.services.modeling.tiny_vl_model import ensure_tiny_vl_model
from opentinker.services.modeling.vision_inputs import ImageInput, load_image_processor
from opentinker.services.rollout.agent.multimodal import VisionChat, generate_with_images
from opentinker.services.trainer.model.forward import policy_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.vision_logprobs import vision_token_logprobs
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.services.trainer.rl.reference import ReferencePolicy
from opentinker.spec import ModelSpec, SamplingParams


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


@pytest.mark.integration
def test_trainer_recomputes_the_rollouts_logprobs_for_an_image_episode(tiny_vl_dir: Path) -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    processor = load_image_processor(tiny_vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    chat = VisionChat(tokenizer, processor)
    game = GeometryToolsGame()
    question = game.reset(seed=5)
    images = [ImageInput(image.data, image.mime_type) for image in game.get_initial_images()]
    # Two turns, each the figure again (a second image), so both image positions count.
    ids = chat.prompt_ids(game.get_system_prompt(), question, images)
    pads = ids.count(chat.pad_id)
    assert pads == 16  # a 112x112 figure: (112 / 14) ** 2 patches / (2 x 2 merged) = 16
    sampling = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=8)
    logprobs, mask, seen = [0.0] * len(ids), [0] * len(ids), list(images)
    for _ in range(2):
        turn = generate_with_images(
            model,
            processor,
            ids,
            seen,
            sampling,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            decoding={"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0},
        )
        ids += turn.token_ids
        logprobs += turn.logprobs
        mask += [1] * len(turn.token_ids)
        closing = [] if turn.token_ids[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
        observation = closing + chat.observation_ids("Again:", images)
        ids += observation
        logprobs += [0.0] * len(observation)
        mask += [0] * len(observation)
        seen += images
    assert ids.count(chat.pad_id) == 3 * 16 and sum(mask) == 16  # 2 turns of 8 tokens
    recomputed = vision_token_logprobs(model, processor, ids, seen, temperature=0.7)
    model_positions = [t for t in range(1, len(ids)) if mask[t]]
    rollout = torch.tensor([logprobs[t] for t in model_positions])
    trainer = recomputed[[t - 1 for t in model_positions]].detach()
    assert torch.allclose(trainer, rollout, atol=1e-4), (trainer - rollout).abs().max()
    # The pixels matter: another figure under the same ids scores the turns differently.
    other_game = GeometryToolsGame()
    other_game.reset(seed=6)
    other_image = ImageInput(other_game.get_initial_images()[0].data)
    assert other_image.data != images[0].data
    swapped = vision_token_logprobs(model, processor, ids, [other_image] * 3, temperature=0.7)
    assert not torch.allclose(
        swapped[[t - 1 for t in model_positions]].detach(), rollout, atol=1e-4
    )


@pytest.mark.integration
def test_the_policys_batched_forward_matches_the_rollout_on_image_episodes(
    tiny_vl_dir: Path,
) -> None:
    policy = Policy(ModelSpec(base_model=str(tiny_vl_dir), finetune="full"), learning_rate=1e-3)
    policy.model.eval()
    tokenizer, processor = policy.tokenizer, policy.image_processor
    chat = VisionChat(tokenizer, processor)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    decoding = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    episodes = []
    for seed in (1, 2, 3):  # three figures, three rows of different lengths in one batch
        game = GeometryToolsGame()
        question = game.reset(seed=seed)
        images = tuple(ImageInput(i.data) for i in game.get_initial_images())
        prompt = chat.prompt_ids("", question + " " * seed, images)
        turn = generate_with_images(
            policy.model,
            processor,
            prompt,
            images,
            sampling,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            decoding=decoding,
        )
        episodes.append(
            Episode(
                group_index=0,
                policy_version=0,
                token_ids=prompt + turn.token_ids,
                prompt_length=len(prompt),
                logprobs=turn.logprobs,
                loss_mask=[1] * len(turn.token_ids),
                reward=0.0,
                env_error=False,
                images=images,
            )
        )
    batch = collate(episodes, tokenizer.pad_token_id)
    assert len(batch.images) == 3
    with torch.no_grad():
        logprobs_B_T = policy_forward(policy, batch, temperature=1.0).logprobs_B_T.cpu()
    mask = batch.loss_mask_B_T.bool()
    assert int(mask.sum()) == sum(len(e.logprobs) for e in episodes)
    assert torch.allclose(logprobs_B_T[mask], batch.old_logprobs_B_T[mask], atol=1e-4)
    # The KL term's frozen reference sees the same pixels (before any update: equal).
    reference_B_T = ReferencePolicy.from_policy(policy).logprobs(batch, temperature=1.0).cpu()
    assert torch.allclose(reference_B_T[mask], logprobs_B_T[mask], atol=1e-5)
