"""What our vLLM code passes to vLLM, checked against the vLLM release the GPU machine runs
(bench/gpu_wheels.txt), read from its wheel's source with ``ast``: nothing of vLLM is installed
or imported here, and no GPU is needed. A keyword vLLM does not take, a LoRARequest field in
another place, an adapter folder vLLM would refuse, a rank it has no slot for: each fails here,
not in a device call.

Each test runs against two releases: the GPU machine's (bench/gpu_wheels.txt) and the newest
the ``vllm`` extra admits (NEWEST_CHECKED). The wheels are looked for in ``.whl/api`` (.ci/run
downloads both there) and ``.whl/dl`` (bench/gpu_wheels.sh's) of this checkout, then of the
main checkout this one is a worktree of; without one its tests skip, saying so.
CUDA IPC's side (torch's ``rebuild_cuda_tensor``) is checked against the torch installed here.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling import cuda_ipc
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.modeling.weights import dtype_to_pb
from opentinker.services.rollout.engines.engine import WeightUpdateError
from opentinker.services.rollout.engines.vllm_adapters import (
    VLLM_LORA_RANKS,
    AdapterVersions,
    WeightShapes,
)
from opentinker.services.rollout.engines.vllm_engine import (
    PROBE_OPTIONS,
    sampling_options,
    vllm_options,
)
from opentinker.services.rollout.engines.vllm_multi_lora import multi_lora_options
from opentinker.services.rollout.engines.vllm_worker import WeightUpdateExtension
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# The newest vLLM release these tests were run against; pyproject's ``vllm`` extra admits up to
# its minor release. Raise both together once these tests pass against a newer wheel.
NEWEST_CHECKED = "0.33.0"


def _pinned_version() -> str:
    text = (ROOT / "bench" / "gpu_wheels.txt").read_text()
    match = re.search(r"^vllm==(\S+)", text, re.MULTILINE)
    assert match, "bench/gpu_wheels.txt pins no vllm version"
    return match.group(1)


def _wheel_dirs() -> list[Path]:
    """.whl/api (.ci/run's downloads) and .whl/dl (bench/gpu_wheels.sh's, carried to the GPU
    machine: only its wheels go there) of this checkout, then of the main checkout this one is
    a worktree of."""
    roots = [ROOT]
    common = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if common.returncode == 0:  # a worktree's main checkout (itself in a plain clone)
        main = Path(common.stdout.strip()).parent
        if main.resolve() != ROOT.resolve():
            roots.append(main)
    return [root / ".whl" / folder for root in roots for folder in ("api", "dl")]


class VllmSource:
    """The .py files of a vLLM wheel, parsed (never imported)."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)
        self._trees: dict[str, ast.Module] = {}

    def text(self, path: str) -> str:
        return self._zip.read(path).decode()

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.text(path))
        return self._trees[path]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in self.tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{path} has no class {name}")

    def fields(self, path: str, name: str) -> list[str]:
        """A dataclass/msgspec Struct's annotated fields, in order."""
        return [
            n.target.id
            for n in self.cls(path, name).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        ]

    def method(self, path: str, cls: str, name: str) -> ast.FunctionDef:
        for node in self.cls(path, cls).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{path}: {cls} has no method {name}")

    def literal(self, path: str, name: str) -> list[object]:
        """The values of a module-level ``Name = Literal[...]``."""
        for node in self.tree(path).body:
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Subscript)
            ):
                elements = node.value.slice
                items = elements.elts if isinstance(elements, ast.Tuple) else [elements]
                return [ast.literal_eval(e) for e in items]
        raise AssertionError(f"{path} has no Literal {name}")

    def function(self, path: str, name: str) -> dict[str, object]:
        """A module-level function of only builtins, run from its source (vLLM's own code)."""
        for node in self.tree(path).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                namespace: dict[str, object] = {}
                exec(ast.get_source_segment(self.text(path), node), namespace)  # noqa: S102
                return namespace
        raise AssertionError(f"{path} has no function {name}")


@pytest.fixture(scope="module", params=["gpu-machine", "newest"])
def vllm_src(request: pytest.FixtureRequest) -> VllmSource:
    """Each test runs against the release the GPU machine runs (bench/gpu_wheels.txt) and the
    newest the ``vllm`` extra admits (what ``pip install opentinker[vllm]`` gets)."""
    version = _pinned_version() if request.param == "gpu-machine" else NEWEST_CHECKED
    for folder in _wheel_dirs():
        wheels = sorted(folder.glob(f"vllm-{version}-*.whl"))
        if wheels:
            return VllmSource(wheels[0])
    where = ", ".join(str(d) for d in _wheel_dirs())
    fetch = f"pip download vllm=={version} --no-deps -d .whl/api"  # as .ci/run does
    print(f"\nno vllm-{version} wheel in {where}: `{fetch}` downloads it")
    pytest.skip(f"the vllm-{version} wheel is not downloaded ({fetch}): {where}")


@pytest.mark.unit
def test_the_vllm_extra_admits_what_these_tests_check() -> None:
    """pyproject's ``vllm`` extra ends below the next minor release after NEWEST_CHECKED and
    starts at the GPU machine's: a release whose API nobody checked is not installed."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = pyproject["project"]["optional-dependencies"]["vllm"]
    major, minor, _ = NEWEST_CHECKED.split(".")
    lowest = ".".join(_pinned_version().split(".")[:2])
    assert requirement == f"vllm>={lowest},<{major}.{int(minor) + 1}", requirement


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


SETTINGS = RolloutSettings(gpu_memory_utilization=0.3, vllm_max_model_len=2048)


def test_every_llm_keyword_we_pass_is_one_vllm_takes(vllm_src: VllmSource) -> None:
    """LLM(**options): LLM.__init__'s own keywords, the rest go to EngineArgs(**kwargs)."""
    init = _params(vllm_src.method("vllm/entrypoints/llm.py", "LLM", "__init__"))
    engine_args = vllm_src.fields("vllm/engine/arg_utils.py", "EngineArgs")
    taken = set(init) | set(engine_args)
    lora = ModelSpec(base_model="m", finetune="lora", lora=LoraConfig(rank=4))
    for options in (
        vllm_options(ModelSpec(base_model="m", finetune="full"), SETTINGS, "cuda"),
        vllm_options(lora, SETTINGS, "cuda:0"),
        multi_lora_options("m", SETTINGS, "cuda", capacity=16, max_lora_rank=64),
    ):
        assert set(options) <= taken, f"vLLM's LLM takes no {sorted(set(options) - taken)}"
        modes = vllm_src.literal("vllm/config/model.py", "LogprobsMode")
        assert options["logprobs_mode"] in modes
        if "max_lora_rank" in options:
            assert options["max_lora_rank"] in vllm_src.literal(
                "vllm/config/lora.py", "MaxLoRARanks"
            )
            assert options["max_cpu_loras"] >= options["max_loras"]  # LoRAConfig's own check


def test_our_lora_slots_are_vllms(vllm_src: VllmSource) -> None:
    ranks = vllm_src.literal("vllm/config/lora.py", "MaxLoRARanks")
    assert tuple(ranks) == VLLM_LORA_RANKS


def test_every_sampling_field_we_set_is_one_vllm_has(vllm_src: VllmSource) -> None:
    fields = set(vllm_src.fields("vllm/sampling_params.py", "SamplingParams"))
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)
    for options in (
        sampling_options(sampling, 7, greedy=False, eos=2),
        sampling_options(sampling, 7, greedy=True, eos=2),
        PROBE_OPTIONS,
    ):
        assert set(options) <= fields, f"SamplingParams has no {sorted(set(options) - fields)}"


def test_lora_request_takes_name_id_path_in_that_order(vllm_src: VllmSource) -> None:
    """We build LoRARequest(name, int id, path) positionally (vllm_engine.add_lora)."""
    fields = vllm_src.fields("vllm/lora/request.py", "LoRARequest")
    assert fields[:3] == ["lora_name", "lora_int_id", "lora_path"]


def test_the_engine_calls_we_make_exist_with_these_keywords(vllm_src: VllmSource) -> None:
    llm = "vllm/entrypoints/llm.py"
    generate = vllm_src.method(llm, "LLM", "generate")
    assert {"use_tqdm", "lora_request"} <= {p.arg for p in generate.args.kwonlyargs}
    rpc = _params(vllm_src.method(llm, "LLM", "collective_rpc"))
    assert rpc[:5] == ["self", "method", "timeout", "args", "kwargs"]  # we pass args=(...,)
    vllm_src.method(llm, "LLM", "reset_prefix_cache")
    engine = "vllm/v1/engine/llm_engine.py"
    assert _params(vllm_src.method(engine, "LLMEngine", "add_lora"))[1] == "lora_request"
    assert _params(vllm_src.method(engine, "LLMEngine", "remove_lora"))[1] == "lora_id"
    vllm_src.method(engine, "LLMEngine", "list_loras")
    # The engines' max_model_len (the token RPCs' limit) is llm.llm_engine.model_config's.
    assert "self.model_config = vllm_config.model_config" in vllm_src.text(engine)
    assert "max_model_len" in vllm_src.fields("vllm/config/model.py", "ModelConfig")
    # vllm_worker.py reaches the model through the worker's model_runner.get_model() and
    # calls its load_weights(weights=...) (Qwen2's skips lm_head when tied, as we never send it)
    vllm_src.method("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "get_model")
    qwen2 = "vllm/model_executor/models/qwen2.py"
    load = vllm_src.method(qwen2, "Qwen2ForCausalLM", "load_weights")
    assert _params(load) == ["self", "weights"]
    # A tied lm_head is never sent; vLLM must not need it: 0.26 skips the "lm_head." prefix in
    # Qwen2's own loader, 0.33 skips every alias of a tied embedding in AutoWeightsLoader.
    skips_prefix = '"lm_head."' in ast.get_source_segment(vllm_src.text(qwen2), load)
    utils = "vllm/model_executor/models/utils.py"
    skips_alias = "_get_tied_embedding_params" in vllm_src.text(utils)
    assert skips_prefix or skips_alias, "this vLLM may need the tied lm_head in an update"
    # our methods are mixed into vLLM's worker class; vLLM refuses a name the worker has
    worker = {n.name for n in vllm_src.cls("vllm/v1/worker/gpu_worker.py", "Worker").body}
    ours = {m for m in vars(WeightUpdateExtension) if not m.startswith("__")}
    assert ours and not ours & worker


def test_the_adapter_folder_is_one_vllm_loads_for_qwen2(vllm_src: VllmSource, tmp_path) -> None:
    """adapter_config.json has every field vLLM's PEFTHelper requires and none of what it
    refuses; every tensor name parses with vLLM's own parse_fine_tuned_lora_name into a module
    Qwen2ForCausalLM takes LoRA on."""
    model = build_tiny_model(tmp_path / "tiny")
    lora = LoraConfig(
        rank=8,
        alpha=16.0,
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
    )
    spec = ModelSpec(base_model=str(model), finetune="lora", lora=lora)
    folder = AdapterVersions(spec, WeightShapes.of(spec), tmp_path / "adapters").write(1)
    config = json.loads((folder / "adapter_config.json").read_text())
    helper = "vllm/lora/peft_helper.py"
    required = [
        n.target.id
        for n in vllm_src.cls(helper, "PEFTHelper").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is None
    ]
    assert required and set(required) <= set(config), f"missing {set(required) - set(config)}"
    assert not config.get("modules_to_save") and config.get("bias", "none") == "none"
    assert not config.get("use_dora") and config["r"] <= 8

    parse = vllm_src.function("vllm/lora/utils.py", "parse_fine_tuned_lora_name")[
        "parse_fine_tuned_lora_name"
    ]
    qwen2 = vllm_src.cls("vllm/model_executor/models/qwen2.py", "Qwen2ForCausalLM")
    packed: dict[str, list[str]] = {}
    class_attrs = set()
    for node in qwen2.body:
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            class_attrs.update(names)
            if "packed_modules_mapping" in names:
                packed = ast.literal_eval(node.value)
    # vLLM takes LoRA on a model's linear layers (get_supported_lora_modules): Qwen2's are
    # qkv_proj, o_proj, gate_up_proj, down_proj, the packed ones loaded from their parts.
    expected = {m for parts in packed.values() for m in parts} | {"o_proj", "down_proj"}
    assert "embedding_modules" not in class_attrs, "Qwen2 in vLLM now takes LoRA on embeddings"
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert len(keys) == 2 * 7 * 2  # 2 layers x 7 modules x (A, B)
    for key in keys:
        module, is_a = parse(key, None)
        assert module.rsplit(".", 1)[-1] in expected, key
        assert is_a == key.endswith("lora_A.weight")


def test_cuda_ipc_passes_rebuild_cuda_tensors_arguments_in_its_order() -> None:
    """cuda_ipc.open_tensor calls torch's rebuild_cuda_tensor positionally, and describe()
    unpacks reduce_tensor's arguments for it by position: the names must be these, in this
    order (torch 2.13 here; the GPU machine's torch 2.11 has the same 15 since torch 1.x)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert list(inspect.signature(rebuild_cuda_tensor).parameters) == [
        "tensor_cls",
        "tensor_size",
        "tensor_stride",
        "tensor_offset",
        "storage_cls",
        "dtype",
        "storage_device",
        "storage_handle",
        "storage_size_bytes",
        "storage_offset_bytes",
        "requires_grad",
        "ref_counter_handle",
        "ref_counter_offset",
        "event_handle",
        "event_sync_required",
    ]
    source = inspect.getsource(cuda_ipc.describe)
    unpacked = re.search(r"\(\n(.*?)\) = args", source, re.DOTALL)
    assert unpacked and len(unpacked.group(1).split(",")) - 1 == 15


def test_a_vllm_cuda_ipc_update_is_checked_against_the_model_before_any_handle_opens(
    tmp_path,
) -> None:
    """VllmEngine.apply_cuda_ipc checks the described names and shapes (meta tensors) as
    apply_weights checks tensors: a wrong one is a WeightUpdateError, not vLLM's load_weights
    failing in its worker."""
    model = build_tiny_model(tmp_path / "tiny")
    shapes = WeightShapes.of(ModelSpec(base_model=str(model), finetune="full"))
    name, shape = next(iter(shapes.shapes.items()))
    bf16 = dtype_to_pb(name, torch.bfloat16)

    def described(n: str, s: tuple[int, ...]) -> rollout_pb2.CudaIpcTensor:
        return rollout_pb2.CudaIpcTensor(name=n, shape=list(s), dtype=bf16)

    good = cuda_ipc.meta_tensors([described(name, shape)])
    assert good[name].is_meta and good[name].dtype == torch.bfloat16
    shapes.check(good)
    with pytest.raises(WeightUpdateError, match="has shape"):
        shapes.check(cuda_ipc.meta_tensors([described(name, (shape[0] + 1, *shape[1:]))]))
    with pytest.raises(WeightUpdateError, match="does not have"):
        shapes.check(cuda_ipc.meta_tensors([described("model.nope.weight", shape)]))
    with pytest.raises(ValueError, match="unknown dtype"):
        cuda_ipc.meta_tensors([rollout_pb2.CudaIpcTensor(name="w", shape=[2], dtype=999)])


def test_an_embedding_adapter_folder_parses_in_vllm(vllm_src: VllmSource, tmp_path) -> None:
    """LoRA on embed_tokens, which vLLM takes for models listing it in embedding_modules
    (Llama, Qwen3; not Qwen2): every key of our folder parses with vLLM's own function. PEFT
    names these parameters ``...lora_embedding_A.default`` (no ``.weight``); a key that kept
    ``.default`` is "unsupported LoRA weight" to vLLM."""
    llama = vllm_src.cls("vllm/model_executor/models/llama.py", "LlamaForCausalLM")
    embedding_modules = next(
        ast.literal_eval(n.value)
        for n in llama.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "embedding_modules" for t in n.targets)
    )
    assert "embed_tokens" in embedding_modules
    parse = vllm_src.function("vllm/lora/utils.py", "parse_fine_tuned_lora_name")[
        "parse_fine_tuned_lora_name"
    ]
    model = build_tiny_model(tmp_path / "tiny")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("embed_tokens", "q_proj"))
    spec = ModelSpec(base_model=str(model), finetune="lora", lora=lora)
    folder = AdapterVersions(spec, WeightShapes.of(spec), tmp_path / "adapters").write(1)
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())  # a safetensors file is not iterable
    parsed = {key: parse(key, None) for key in keys}
    embedding = {k: v for k, v in parsed.items() if "lora_embedding" in k}
    assert len(embedding) == 2
    assert {module for module, _ in embedding.values()} == {"model.embed_tokens"}


def test_the_output_fields_we_read_are_vllms(vllm_src: VllmSource) -> None:
    """vllm_outputs.py reads RequestOutput.outputs/prompt_logprobs, CompletionOutput.token_ids/
    logprobs/finish_reason and Logprob.logprob (the Protocols there), as list-of-dict logprobs:
    what vLLM returns unless SamplingParams.flat_logprobs, which we never set."""
    from opentinker.services.rollout.engines import vllm_outputs

    completion = set(vllm_src.fields("vllm/outputs.py", "CompletionOutput"))
    request = _params(vllm_src.method("vllm/outputs.py", "RequestOutput", "__init__"))
    logprob = set(vllm_src.fields("vllm/logprobs.py", "Logprob"))
    assert set(vllm_outputs.CompletionOutputLike.__annotations__) <= completion
    assert set(vllm_outputs.RequestOutputLike.__annotations__) <= set(request)
    assert set(vllm_outputs.LogprobLike.__annotations__) <= logprob
    sampling = sampling_options(SamplingParams(), 0, greedy=False, eos=2)
    assert "flat_logprobs" in vllm_src.fields("vllm/sampling_params.py", "SamplingParams")
    assert "flat_logprobs" not in sampling and "flat_logprobs" not in PROBE_OPTIONS
