"""A multi-turn episode's next turn continues the keys and values of its previous one
(services/rollout/engines/prefix_cache.py, TransformersEngine.keep_prefixes)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.multi_lora import LoraRow, SharedLoraEngine
from opentinker.services.rollout.engines.prefix_cache import CachedPrefix, PrefixCache, row_prefix
from opentinker.services.rollout.types import Completion
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

EOS = 9
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)
JOBS = ("job-a", "job-b", "job-c")


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, object]:
    """The random-init tiny Qwen2, nudged to end a turn (eos) after a few tokens, as a chat
    model does: a few Adam steps towards eos at every position of random sequences."""
    model_dir = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids_B_T = torch.randint(0, 500, (8, 40))
    for _ in range(3):
        logp_B_T = torch.log_softmax(model(input_ids=ids_B_T).logits, -1)
        (-logp_B_T[..., tokenizer.eos_token_id].mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer


def play_turns(
    engine: TransformersEngine, turns: int, *, rows: int = 16, seed: int = 1
) -> list[list[Completion]]:
    """``turns`` turns of ``rows`` episodes: each next prompt is the last one, its completion
    and 20 tokens of an env's reply."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 500, (30,), generator=generator).tolist() for _ in range(rows)]
    played = []
    for turn in range(turns):
        completions = engine.generate(prompts, SAMPLING, seed=turn)
        played.append(completions)
        replies = torch.randint(0, 500, (rows, 20), generator=generator).tolist()
        prompts = [
            p + c.token_ids + r for p, c, r in zip(prompts, completions, replies, strict=True)
        ]
    return played


def fed_tokens(model: PreTrainedModel) -> list[int]:
    """A running count of the tokens the model's forward computes."""
    count = [0]
    model.register_forward_pre_hook(
        lambda _m, _a, kwargs: count.__setitem__(0, count[0] + kwargs["input_ids"].numel()),
        with_kwargs=True,
    )
    return count


def assert_same_turns(got: list[list[Completion]], want: list[list[Completion]]) -> None:
    for turn_got, turn_want in zip(got, want, strict=True):
        for a, b in zip(turn_got, turn_want, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_turn_continues_the_previous_turns_keys_and_values(eos_model) -> None:
    model, tokenizer = eos_model
    plain_model, cached_model = copy.deepcopy(model), copy.deepcopy(model)
    plain_count, cached_count = fed_tokens(plain_model), fed_tokens(cached_model)
    plain = TransformersEngine(plain_model, tokenizer)
    cached = TransformersEngine(cached_model, tokenizer)
    cached.keep_prefixes(64 * 2**20)
    assert cached.prefixes is not None and plain.prefixes is None

    want = play_turns(plain, 5)
    got = play_turns(cached, 5)
    # The same samples and logprobs, from fewer tokens computed.
    assert_same_turns(got, want)
    ended = sum(c.token_ids[-1:] == [tokenizer.eos_token_id] for turn in got[:-1] for c in turn)
    assert ended >= 10, "the nudged model ends some turns with eos"
    assert cached.prefixes.hits == ended  # each turn ended with eos is continued by the next
    assert cached.prefixes.reused_tokens > 0
    saved = plain_count[0] - cached_count[0]
    assert saved >= cached.prefixes.reused_tokens // 2, (plain_count, cached_count)


def test_a_weight_update_drops_what_the_old_weights_computed(eos_model) -> None:
    model, tokenizer = eos_model
    cached = TransformersEngine(copy.deepcopy(model), tokenizer)
    cached.keep_prefixes(64 * 2**20)
    assert cached.prefixes is not None
    play_turns(cached, 2)
    assert len(cached.prefixes) > 0
    update = {
        name: tensor + 0.01 * torch.randn_like(tensor)
        for name, tensor in cached.model.state_dict().items()
        if name.endswith("mlp.down_proj.weight")
    }
    cached.apply_weights(update, policy_version=1)
    assert len(cached.prefixes) == 0 and cached.prefixes.nbytes == 0
    # Play on from the new weights: as an engine that never kept anything.
    fresh = TransformersEngine(copy.deepcopy(cached.model), tokenizer)
    assert_same_turns(play_turns(cached, 3, seed=2), play_turns(fresh, 3, seed=2))


def test_new_episodes_beside_continued_ones_compute_a_shared_prompt_once(eos_model) -> None:
    """The async loop batches whichever episodes are ready: four on their second turn beside a
    new GRPO group (one prompt, four samples), whose prompt is computed once."""
    model, tokenizer = eos_model
    plain = TransformersEngine(copy.deepcopy(model), tokenizer)
    cached_model = copy.deepcopy(model)
    cached = TransformersEngine(cached_model, tokenizer)
    cached.keep_prefixes(64 * 2**20)
    assert cached.prefixes is not None
    generator = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 500, (n,), generator=generator).tolist()

    played = [tokens(30) + [tokenizer.eos_token_id] for _ in range(4)]  # first turns, ended
    for turn in played:
        cached.prefixes.put(turn, cached_entry(cached, turn[:-1]))
    group = tokens(50)
    # Each old episode's turn, then the env's reply: 21 tokens not cached.
    prompts = [turn + tokens(20) for turn in played] + [group] * 4
    count = fed_tokens(cached_model)
    got = cached.generate(prompts, SAMPLING, seed=5)
    want = plain.generate(prompts, SAMPLING, seed=5)
    assert_same_turns([got], [want])
    assert cached.prefixes.hits == 4
    # The group's first 50 - 21 tokens once, then generate: 21 tokens a row, one per step.
    assert count[0] <= (50 - 21) + 8 * 21 + 8 * (SAMPLING.max_new_tokens - 1), count


def shared_lora_engine(
    model: PreTrainedModel, tokenizer, keep: tuple[str, ...]
) -> SharedLoraEngine:  # noqa: ANN001
    """Three jobs' adapters (random, lora_B too: each adapter samples its own tokens) on one
    shared engine; ``keep``: the jobs whose episodes take several turns."""
    engine = SharedLoraEngine(copy.deepcopy(model), tokenizer, base_model="tiny")
    for k, job in enumerate(JOBS):
        engine.add_adapter(job, ModelSpec(base_model="tiny", finetune="lora",
                                          lora=LoraConfig(rank=4)))  # fmt: skip
        generator = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, param in sorted(engine._params[job].items()):
                scale = 0.01 if "lora_B" in name else 0.3  # small: the nudged eos still ends turns
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    for job in keep:
        engine.keep_prefixes(job, 64 * 2**20)
    return engine


def play_shared_turns(engine: SharedLoraEngine, turns: int) -> list[list[Completion]]:
    """``turns`` turns of 4 episodes per job, all jobs' rows in each call."""
    generator = torch.Generator().manual_seed(4)
    jobs = [job for job in JOBS for _ in range(4)]
    prompts = [torch.randint(0, 500, (30,), generator=generator).tolist() for _ in jobs]
    played = []
    for turn in range(turns):
        rows = [LoraRow(p, job, SAMPLING, seed=100 * turn + i)
                for i, (p, job) in enumerate(zip(prompts, jobs, strict=True))]  # fmt: skip
        completions = engine.generate_rows(rows)
        played.append(completions)
        replies = torch.randint(0, 500, (len(jobs), 20), generator=generator).tolist()
        prompts = [
            p + c.token_ids + r for p, c, r in zip(prompts, completions, replies, strict=True)
        ]
    return played


def test_a_shared_multi_lora_engine_continues_each_multi_turn_jobs_turns(eos_model) -> None:
    """Three LoRA jobs on one shared engine, two of them multi-turn: their turns continue
    their own adapter's keys and values, with the plain engine's samples; the one-turn job's
    rows are not kept; an update of one adapter, or its leaving, drops only its entries."""
    model, tokenizer = eos_model
    plain = shared_lora_engine(model, tokenizer, keep=())
    cached = shared_lora_engine(model, tokenizer, keep=JOBS[:2])
    plain_count, cached_count = fed_tokens(plain.base), fed_tokens(cached.base)
    want, got = play_shared_turns(plain, 4), play_shared_turns(cached, 4)
    assert_same_turns(got, want)
    assert plain.prefixes is None and cached.prefixes is not None
    eos = tokenizer.eos_token_id
    ended = sum(c.token_ids[-1:] == [eos] for turn in got[:-1] for c in turn[:8])  # jobs a, b
    assert ended >= 4 and cached.prefixes.hits == ended
    assert cached_count[0] < plain_count[0] - cached.prefixes.reused_tokens // 2
    assert cached.prefixes.count(JOBS[2]) == 0  # the one-turn job's rows: never kept
    kept = [cached.prefixes.count(job) for job in JOBS[:2]]
    assert all(kept), kept  # the last turn's rows ended with eos
    update = {n: torch.zeros_like(t) for n, t in cached._params[JOBS[0]].items()}
    cached.apply_adapter_weights(JOBS[0], update)
    assert [cached.prefixes.count(job) for job in JOBS[:2]] == [0, kept[1]]
    cached.remove_adapter(JOBS[1])
    assert len(cached.prefixes) == 0 and cached.prefixes.nbytes == 0
    with pytest.raises(ValueError, match="not loaded"):
        cached.keep_prefixes(JOBS[1], 1 << 20)


def cached_entry(engine: TransformersEngine, tokens: list[int]) -> CachedPrefix:
    """The keys and values of ``tokens`` as the engine would keep them."""
    out = engine.model(input_ids=torch.tensor([tokens]), use_cache=True)
    return row_prefix(out.past_key_values, 0, 0, len(tokens))


def entry(length: int, layers: int = 2) -> CachedPrefix:
    kv = tuple((torch.zeros(2, length, 4), torch.zeros(2, length, 4)) for _ in range(layers))
    return CachedPrefix(layers=kv, length=length)


def test_the_longest_prefix_ending_at_an_eos_of_the_same_adapter_is_taken() -> None:
    cache = PrefixCache(capacity_bytes=1 << 20, eos_token_id=EOS)
    cache.put([1, 2, EOS], entry(2))
    cache.put([1, 2, EOS, 5, 6, EOS], entry(5))
    cache.put([1, 2, EOS, 5, 6, EOS], entry(5), tag="role-b")
    cache.put([1, 2, 3], entry(2))  # cut short, not ended with eos: a turn never continues it
    assert len(cache) == 3
    assert cache.take([7, 7, EOS, 1]) is None  # no stored prefix
    assert cache.take([1, 2, EOS, 5, 6, EOS, 8, 8]).length == 5  # the longest
    assert cache.take([1, 2, EOS, 5, 6, EOS, 8, 8]).length == 2  # taken once: now the shorter
    assert cache.take([1, 2, EOS, 5, 6, EOS, 8, 8], tag="role-b").length == 5
    assert (len(cache), cache.nbytes, cache.hits, cache.reused_tokens) == (0, 0, 3, 12)


def test_the_oldest_entries_go_past_the_capacity() -> None:
    size = entry(10).nbytes
    cache = PrefixCache(capacity_bytes=2 * size, eos_token_id=EOS)
    for first in (1, 2, 3):
        cache.put([first, EOS], entry(10))
    assert cache.nbytes == 2 * size and cache.take([1, EOS]) is None
    assert cache.take([3, EOS]) is not None and cache.take([2, EOS]) is not None
    cache.put([4, EOS], entry(30))  # larger than the whole cache: not kept
    assert len(cache) == 0 and cache.nbytes == 0


def test_off_for_zero_bytes_and_for_models_with_windowed_attention(
    eos_model,
) -> None:
    model, tokenizer = eos_model
    engine = TransformersEngine(copy.deepcopy(model), tokenizer)
    engine.keep_prefixes(0)
    assert engine.prefixes is None
    windowed = copy.deepcopy(model)
    windowed.config.layer_types = ["sliding_attention"] * windowed.config.num_hidden_layers
    engine = TransformersEngine(windowed, tokenizer)
    engine.keep_prefixes(1 << 20)
    assert engine.prefixes is None
    engine = TransformersEngine(copy.deepcopy(model), tokenizer)  # a one-turn job's session
    engine.keep_prefixes(1 << 20)
    engine.keep_prefixes(0)
    assert engine.prefixes is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_on_a_gpu_in_bfloat16_continued_turns_score_as_a_full_forward(eos_model) -> None:
    """The GPU path: keys and values kept on the device, turns continued in bfloat16; each
    sampled token's logprob is what one forward over the whole sequence gives (to bf16
    rounding), so the trainer recomputes what was sampled."""
    model, tokenizer = eos_model
    engine = TransformersEngine(copy.deepcopy(model).to("cuda", torch.bfloat16), tokenizer)
    engine.keep_prefixes(64 * 2**20)
    assert engine.prefixes is not None
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (30,), generator=generator).tolist() for _ in range(8)]
    for turn in range(4):
        completions = engine.generate(prompts, SAMPLING, seed=turn)
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion.token_ids], device="cuda")
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            start = len(prompt) - 1
            expected = [
                logprobs[start + t, tok].item() for t, tok in enumerate(completion.token_ids)
            ]
            assert completion.logprobs == pytest.approx(expected, abs=0.05), turn
        replies = torch.randint(0, 500, (8, 20), generator=generator).tolist()
        prompts = [
            p + c.token_ids + r for p, c, r in zip(prompts, completions, replies, strict=True)
        ]
    assert engine.prefixes.hits > 0
