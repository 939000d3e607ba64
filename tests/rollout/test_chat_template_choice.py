"""A base model that ships no chat template (Gemma 3 270M base) runs once a job chooses one:
``ModelSpec.chat_template`` "plain" (documented in ``opentinker.chat_templates``) or a Jinja
template, or the catalog entry's choice. Without a choice the rollout refuses it, naming the
field. The tiny local Qwen2 with its template removed stands in for such a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine, play
from pydantic import ValidationError

from opentinker.chat_templates import PLAIN_CHAT_TEMPLATE
from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import models_pb2
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.chat_format import ChatFormat
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason
from opentinker.services.scheduler.model_admission import admit_model
from opentinker.spec import JobSpec, ModelSpec, RlConfig, from_proto, to_proto

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 saved without any chat template, as a base model ships."""
    folder = build_tiny_model(tmp_path_factory.mktemp("bare-qwen2"))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    return folder


def _engine(folder: Path, chat_template: str = "") -> TransformersEngine:
    spec = ModelSpec(base_model=str(folder), finetune="full", chat_template=chat_template)
    return TransformersEngine.load(spec, device="cpu")


def test_without_a_choice_the_rollout_refuses_naming_the_field(bare_model_dir: Path) -> None:
    engine = _engine(bare_model_dir)
    assert not engine.tokenizer.chat_template
    with pytest.raises(ValueError, match="no chat template; set model.chat_template to 'plain'"):
        ChatFormat(engine.tokenizer)


def test_plain_template_plays_multi_turn_episodes(bare_model_dir: Path) -> None:
    engine = RecordingEngine(_engine(bare_model_dir, "plain"))
    tokenizer = engine.tokenizer
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    sessions = [GameSession(Countdown(turns=2))]
    [t] = play(engine, sessions, max_turns=3, max_new_tokens=4, seeds=[3])
    assert (t.finish_reason, t.num_turns) == (FinishReason.ENV_DONE, 2)
    prompt = tokenizer.decode(t.token_ids[: t.prompt_length])
    assert prompt == "System: Count down with me.\n\nUser: Start at 243.\n\nAssistant:"
    # Observation turns (loss mask 0) are rendered by the plain template, after the eos
    chat = ChatFormat(tokenizer)
    observation = chat.observation_ids("Now 242, go on.")
    assert tokenizer.decode(observation) == "\n\nUser: Now 242, go on.\n\nAssistant:"
    completion = t.token_ids[t.prompt_length :]
    env_text = tokenizer.decode([i for i, m in zip(completion, t.loss_mask, strict=True) if m == 0])
    assert "\n\nUser: " in env_text and env_text.endswith("\n\nAssistant:")
    assert t.loss_mask[0] == 1 and tokenizer.eos_token_id in completion


def test_the_choice_is_validated_and_travels(bare_model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="neither 'plain' nor a Jinja chat template"):
        ModelSpec(chat_template="chatml")
    jinja = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    spec = JobSpec(
        model=ModelSpec(base_model="m", chat_template=jinja), rl=RlConfig(env_name="letter")
    )
    assert from_proto(to_proto(spec)).model.chat_template == jinja
    # A catalog entry's choice is the job's when its spec makes none
    entry = models_pb2.Model(name="gemma-3-270m", location="/m/gemma", chat_template="plain")
    bare = to_proto(JobSpec(model=ModelSpec(base_model="gemma-3-270m"), rl=RlConfig(env_name="x")))
    admitted = admit_model(bare, [entry])
    assert (admitted.model.base_model, admitted.model.chat_template) == ("/m/gemma", "plain")
    assert admit_model(to_proto(spec), [entry.__class__(name="m")]).model.chat_template == jinja
    assert isinstance(admitted, common_pb2.JobSpec)


def test_a_job_with_a_chosen_template_gets_a_rollout_of_its_own() -> None:
    """A shared LoRA engine renders with its base tokenizer's template: a job that chose
    another does not join it (it would be refused there, its choice unseen)."""
    from opentinker.services.worker.shared_rollouts import shares_engine

    def job(chat_template: str) -> common_pb2.Job:
        spec = JobSpec(
            model=ModelSpec(base_model="/m/gemma", chat_template=chat_template),
            rl=RlConfig(env_name="letter"),
        )
        return common_pb2.Job(job_id="job-1", spec=to_proto(spec))

    assert shares_engine(job(""), ["w/cpu:0"])
    assert not shares_engine(job("plain"), ["w/cpu:0"])


def test_a_choice_does_not_outlive_its_job_on_a_reused_tokenizer(bare_model_dir: Path) -> None:
    """A process that keeps its loaded tokenizer for the next job (a warm or reused one) gives
    the next job the tokenizer's own template back, not the last job's choice."""
    from transformers import AutoTokenizer

    from opentinker.services.modeling.template_choice import use_chat_template

    tokenizer = AutoTokenizer.from_pretrained(bare_model_dir)
    use_chat_template(tokenizer, "plain")
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    use_chat_template(tokenizer, "")
    assert not tokenizer.chat_template
    with pytest.raises(ValueError, match="model.chat_template"):
        ChatFormat(tokenizer)
