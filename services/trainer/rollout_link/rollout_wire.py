"""The rollout stream's messages from the trainer's side: the OpenRollout of a job, and
trajectories back into the trainer's episodes and evaluation result rows."""

from __future__ import annotations

from typing import Any

from opentinker.common.v1 import common_pb2
from opentinker.inference_rows import episode_row, wire_row
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling.vision_inputs import ImageInput
from opentinker.services.rollout.agent.seeds import eval_episode_seed
from opentinker.services.trainer.rl.batch import Episode
from opentinker.spec import JobSpec, to_proto


def open_request(job_id: str, spec: JobSpec) -> rollout_pb2.OpenRollout:
    """The OpenRollout of an RL job (training and validation) or an inference job."""
    pb = to_proto(spec)
    if spec.inference is not None:
        c, model = pb.inference, common_pb2.ModelSpec()
        model.CopyFrom(pb.model)
        model.finetune = common_pb2.FINETUNE_MODE_FULL  # served as is, never trained
        return rollout_pb2.OpenRollout(
            job_id=job_id,
            model=model,
            env_name=c.env_name,
            env_options=c.env_options,
            sampling=c.sampling,
            max_turns=c.max_turns,
            max_episode_tokens=c.max_episode_tokens,
            seed=c.seed,
            adapter_dir=c.adapter_dir,
            agent=c.agent if c.HasField("agent") else None,
        )
    r = pb.rl
    return rollout_pb2.OpenRollout(
        job_id=job_id,
        model=pb.model,
        env_name=r.env_name,
        env_options=r.env_options,
        sampling=r.sampling,
        max_turns=r.max_turns,
        max_episode_tokens=r.max_episode_tokens,
        seed=r.seed,
        eval_env_options=r.val_env_options,
        role_adapters=(
            spec.rl is not None
            and spec.rl.role_adapters == "per_role"
            and spec.model.finetune == "lora"
        ),
        agent=r.agent if r.HasField("agent") else None,
    )


def eval_row(t: rollout_pb2.Trajectory, seed: int) -> dict[str, Any]:
    """A result row of an evaluation episode (its group_index is its episode index)."""
    row = episode_row(
        episode_id=t.episode_id,
        index=t.group_index,
        env_seed=eval_episode_seed(seed, t.group_index),
        reward=t.reward,
        turns=t.num_turns,
        finish_reason=rollout_pb2.FinishReason.Name(t.finish_reason).removeprefix("FINISH_REASON_"),
        finish_detail=t.finish_detail,
        info=t.info,
        env_retries=t.env_retries,
        completion_tokens=sum(t.loss_mask),
    )
    if t.role:  # a self-play game's row per role
        row["role"] = t.role
    return wire_row(row, t.completion_text)


_TRUNCATED_BY = {
    rollout_pb2.FINISH_REASON_MAX_TURNS: "max_turns",
    rollout_pb2.FINISH_REASON_MAX_TOKENS: "max_tokens",
}


def episode_from_proto(t: rollout_pb2.Trajectory) -> Episode:
    return Episode(
        group_index=t.group_index,
        policy_version=t.policy_version,
        token_ids=list(t.token_ids),
        prompt_length=t.prompt_length,
        logprobs=list(t.logprobs),
        loss_mask=list(t.loss_mask),
        reward=t.reward,
        env_error=t.finish_reason == rollout_pb2.FINISH_REASON_ENV_ERROR,
        finish_detail=t.finish_detail,
        num_turns=t.num_turns,
        outcome=t.info.get("outcome", ""),
        truncated_by=_TRUNCATED_BY.get(t.finish_reason, ""),
        turn_rewards=tuple(t.turn_rewards),
        turn_ends=tuple(t.turn_ends),
        images=tuple(ImageInput(i.data, i.mime_type) for i in t.images),
        role=t.role,
        episode_id=t.episode_id,
        agent_rewrites=int(t.info["agent_rewrites"]) if "agent_rewrites" in t.info else None,
    )
