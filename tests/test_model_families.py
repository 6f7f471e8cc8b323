"""The model families users bring, on every path a run takes (``tests/model_families.py``).

Per family (tied and untied Llama, Qwen2, Qwen3, Mistral, Gemma2; SmolLM2's chat tokenizer):

- in process: the native engine's greedy tokens == HF ``generate`` and its log-probs == a forward;
  the trainer's shared-prompt and per-row log-probs == a plain forward;
- one 3-rank world for all families (``tp_world.py``): a TP-2 generator gives the TP-1 greedy tokens, and DDMA from
  an FSDP2 trainer gives it the trainer's weights bitwise, each TP rank exactly its shard;
- a colocated recipe run with a checkpoint after tick 1, and a run resumed from it (every family's
  runs in one process, ``colocated_runs.py``, so the imports are paid once): bitwise the
  same final weights; the final HF export loads with ``from_pretrained`` and HF ``generate`` on it
  writes the run's own final greedy evaluation, text for text.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import rows_batch
from launch import check, run_colocated_runs, run_torchrun
from model_families import FAMILIES, build_family, chat_tokenizer, save_family

from llamarl.engines.torch_engine import Request, SamplingParams, TorchEngine
from llamarl.models.loading import load_causal_lm, stop_token_ids
from llamarl.models.logprobs import completion_logprobs
from llamarl.models.microbatch import microbatch_inputs
from llamarl.models.shared_prefix import shared_prefix_logprobs, supports
from recipes.arithmetic import prompt_fn

QUESTIONS = ["What is 12 + 7?", "Name a colour.", "2 + 2 ="]
TEMPERATURE = 0.7
NAMES = list(FAMILIES)
# One colocated run: 2 ticks with a checkpoint after each, fp32 generation (its weights are then
# the trainer's exactly, so the final evaluation is what the export must reproduce). One thread, as
# every test process (the recipe's 2 beside the other pytest worker spun: 76 s -> 35 s here).
COLOCATED = ["--run.schedule", "colocated", "--run.max-steps", "2", "--checkpoint.every", "1",
             "--checkpoint.keep", "0", "--generator.dtype", "float32", "--generator.max-new-tokens", "6",
             "--generator.num-prompts-per-step", "2", "--generator.temperature", "1.0", "--trainer.lr", "1e-3",
             "--reward.num-workers", "0", "--run.num-eval-problems", "3", "--run.device-guard",
             "--trainer.num-threads", "1"]


# LoRA on every family (rank 4, every linear of the decoder layers; the merged model exported too).
LORA = ["--trainer.lora.rank", "4", "--trainer.lora.export-merged", "--trainer.lr", "1e-2"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """``{family: HF directory}`` of every family's tiny model."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(root / name / "model", name) for name in NAMES}


@pytest.fixture(scope="module")
def tp_worlds(family_dirs, tmp_path_factory):
    """Every family through ``tp_world.py`` in one 3-rank world: ``{family: output directory}``."""
    root = tmp_path_factory.mktemp("tp")
    outs = {name: root / name for name in NAMES}
    args = []
    for name in NAMES:
        outs[name].mkdir()
        args += ["--pair", str(family_dirs[name]), str(outs[name])]
    check(run_torchrun("tp_world.py", nproc=3, args=args, timeout_s=400))
    return outs


@pytest.fixture(scope="module")
def colocated_runs(family_dirs, tmp_path_factory):
    """Per family, a colocated run straight through and one resumed from its tick-1 checkpoint, all in
    one process (``colocated_runs.py``): ``{family: (straight run dir, resumed run dir)}``."""
    root = tmp_path_factory.mktemp("colocated")
    runs, plan = {}, []
    for name in NAMES:
        straight, resumed = root / name / "straight", root / name / "resumed"
        runs[name] = (straight, resumed)
        model = ["--model.name", str(family_dirs[name])]
        plan.append([*model, *COLOCATED, "--run.output-dir", str(straight)])
        plan.append([*model, *COLOCATED, "--run.output-dir", str(resumed),
                     "--checkpoint.resume", str(straight / "checkpoints" / "step_1")])
        if name == NAMES[0]:  # the same run with each decoder layer checkpointed (recomputed in the backward)
            runs["checkpointed"] = (root / name / "checkpointed",)
            plan.append([*model, *COLOCATED, "--trainer.activation-checkpointing", "on",
                         "--run.output-dir", str(root / name / "checkpointed")])
        lora_straight, lora_resumed = root / name / "lora_straight", root / name / "lora_resumed"
        runs[f"lora:{name}"] = (lora_straight, lora_resumed)
        plan.append([*model, *COLOCATED, *LORA, "--run.output-dir", str(lora_straight)])
        plan.append([*model, *COLOCATED, *LORA, "--run.output-dir", str(lora_resumed),
                     "--checkpoint.resume", str(lora_straight / "checkpoints" / "step_1")])
    proc = run_colocated_runs(plan, plan_file=root / "runs.json",
                              env={"LLAMARL_TEST_SCORER": "scorers_for_tests:first_char_even"})
    check(proc)
    return runs


def prompts() -> list[list[int]]:
    return [list(prompt_fn(chat_tokenizer(), q)) for q in QUESTIONS]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=chat_tokenizer().pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_native_greedy_equals_hf_generate_and_its_logprobs_a_forward(name):
    model = build_family(name)
    engine = TorchEngine(model, eos_token_ids=stop_token_ids(model, chat_tokenizer()), pad_token_id=0)
    outs = engine.generate([Request(i, p) for i, p in enumerate(prompts())],
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=10), version=0)
    for prompt, out in zip(prompts(), outs):
        assert out.completion_ids == hf_greedy(model, prompt, 10)
        ids = torch.tensor([prompt + out.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        want = logp[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_trainer_logprobs_shared_and_per_row_equal_a_plain_forward(name):
    model = build_family(name)
    gen = torch.Generator().manual_seed(0)
    rows = [(p, torch.randint(10, 40000, (int(k),), generator=gen).tolist())
            for p in prompts() for k in (3, 5)]  # a group of 2 samples per prompt
    batch = rows_batch(rows)
    ids, attention, mask, start, _ = microbatch_inputs(batch, list(range(len(batch))), device="cpu")
    with torch.no_grad():
        per_row = completion_logprobs(model, ids, attention, start=start, temperature=TEMPERATURE) * mask
        expected = torch.zeros_like(per_row)
        for r, (p, c) in enumerate(rows):  # each row alone, unpadded
            full = torch.tensor([p + c])
            logp = torch.log_softmax(model(input_ids=full).logits.float()[0, :-1] / TEMPERATURE, dim=-1)
            row_logp = logp.gather(-1, full[0, 1:, None]).squeeze(-1)
            expected[r, 1:len(p) + len(c)] = row_logp
        expected = expected * mask
        assert per_row.abs().sum() > 1.0
        torch.testing.assert_close(per_row, expected, rtol=1e-5, atol=1e-4)
        if supports(model):
            shared = shared_prefix_logprobs(model, ids, attention, mask, temperature=TEMPERATURE) * mask
            torch.testing.assert_close(shared, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_tp2_generator_and_ddma_match_tp1_and_the_trainer(name, tp_worlds):
    out = tp_worlds[name]
    read = lambda name: json.loads((out / name).read_text())
    for phase in ("greedy", "greedy2"):
        want = read(f"{phase}_tp1.json")
        assert any(w["ids"] for w in want)
        for rank in (0, 1):
            got = read(f"{phase}_gen{rank}.json")
            assert [g["ids"] for g in got] == [w["ids"] for w in want], (phase, rank)
    trainer = load_file(out / "trainer.safetensors")
    full = load_file(out / "generator_full.safetensors")
    assert sorted(full) == sorted(trainer)
    for param, tensor in trainer.items():
        assert torch.equal(full[param], tensor), param
    sharded = 0
    for rank in (0, 1):
        for param, tensor in load_file(out / f"generator_local{rank}.safetensors").items():
            if tensor.shape != trainer[param].shape:  # a TP shard: exactly this rank's chunk
                dim = next(d for d, (a, b) in enumerate(zip(tensor.shape, trainer[param].shape)) if a != b)
                assert torch.equal(tensor, trainer[param].chunk(2, dim=dim)[rank]), (rank, param)
                sharded += 1
            else:
                assert torch.equal(tensor, trainer[param]), (rank, param)
    assert sharded >= 2 * 2 * 7  # 2 ranks x 2 layers x 7 projections at least


@pytest.mark.parametrize("name", NAMES)
def test_colocated_checkpoint_resume_and_export(name, family_dirs, colocated_runs):
    runs = dict(zip(("straight", "resumed"), colocated_runs[name]))
    model_dir = family_dirs[name]
    straight, resumed = (load_file(str(runs[n] / "hf" / "final" / "model.safetensors")) for n in runs)
    assert sorted(straight) == sorted(resumed)
    for param, tensor in straight.items():
        assert torch.equal(resumed[param], tensor), param
    # The export loads as HF loads it (a tied model re-ties), and HF generate on it writes the run's
    # own final greedy evaluation.
    model, tokenizer = load_causal_lm(str(runs["straight"] / "hf" / "final"))
    initial, _ = load_causal_lm(str(model_dir))
    assert any(not torch.equal(p, initial.state_dict()[n]) for n, p in model.state_dict().items()), "no update"
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()) == tied
    records = [json.loads(line) for line in (runs["straight"] / "eval_final.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for record in records:
        prompt = list(prompt_fn(tokenizer, record["question"]))
        text = tokenizer.decode(hf_greedy(model, prompt, 6), skip_special_tokens=True)
        assert text == record["completion"], record["question"]


@pytest.mark.parametrize("name", NAMES)
def test_lora_trains_resumes_exactly_and_exports_an_adapter_peft_loads(name, family_dirs, colocated_runs):
    """LoRA on each family, colocated: the checkpoint holds the adapters alone and a resume from it
    ends with bitwise the adapters of the run straight through; the exported adapter directory loads
    with ``peft.PeftModel``, whose log-probs equal the exported merged model's and whose greedy text
    is the run's own final evaluation (the generator's merged weights), text for text."""
    from peft import PeftModel

    straight, resumed = colocated_runs[f"lora:{name}"]
    adapters = [load_file(str(run / "hf" / "final" / "adapter_model.safetensors")) for run in (straight, resumed)]
    assert sorted(adapters[0]) == sorted(adapters[1]) and all(".lora_" in k for k in adapters[0])
    for key, tensor in adapters[0].items():
        assert torch.equal(adapters[1][key], tensor), key
    assert any(k.endswith("lora_B.weight") and tensor.abs().max() > 0 for k, tensor in adapters[0].items()), "no update"
    (state,) = (straight / "checkpoints" / "step_1").glob("**/state/rank0.safetensors")
    saved = load_file(str(state))
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:3]
    base, tokenizer = load_causal_lm(str(family_dirs[name]))
    policy = PeftModel.from_pretrained(base, str(straight / "hf" / "final")).eval()
    merged, _ = load_causal_lm(str(straight / "hf" / "final" / "merged"))
    records = [json.loads(line) for line in (straight / "eval_final.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for record in records:
        prompt = list(prompt_fn(tokenizer, record["question"]))
        completion = hf_greedy(policy, prompt, 6)
        assert tokenizer.decode(completion, skip_special_tokens=True) == record["completion"], record["question"]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            mask = torch.ones_like(ids)
            want = completion_logprobs(policy, ids, mask, start=len(prompt), temperature=1.0)
            got = completion_logprobs(merged, ids, mask, start=len(prompt), temperature=1.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_trains_exactly_the_same_policy(colocated_runs):
    """--trainer.activation-checkpointing on: every decoder layer recomputed in the backward, the same
    gradients, so bitwise the same final weights as the run without it."""
    (checkpointed,) = colocated_runs["checkpointed"]
    straight = colocated_runs[NAMES[0]][0]
    want = load_file(str(straight / "hf" / "final" / "model.safetensors"))
    got = load_file(str(checkpointed / "hf" / "final" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert json.loads((checkpointed / "config.json").read_text())["trainer"]["activation_checkpointing"] == "on"


def test_every_eos_id_of_the_generation_config_stops_generation(tmp_path):
    """Qwen2.5 and Llama-3 list several end-of-turn ids; stopping at the tokenizer's EOS only would
    run on past ``<|im_end|>`` into the next turn."""
    model = build_family("llama-untied")  # its random greedy text does not repeat a token early
    (free,) = TorchEngine(model, eos_token_ids=[], pad_token_id=0).generate(
        [Request(0, prompts()[0])], sampling=SamplingParams(temperature=0.0, max_new_tokens=10), version=0)
    stop = free.completion_ids[3]
    assert stop not in free.completion_ids[:3]
    model.generation_config.eos_token_id = [chat_tokenizer().eos_token_id, stop]
    save_dir = tmp_path / "llama"
    model.save_pretrained(save_dir)
    chat_tokenizer().save_pretrained(save_dir)
    loaded, tokenizer = load_causal_lm(str(save_dir))
    assert stop_token_ids(loaded, tokenizer) == sorted({tokenizer.eos_token_id, stop})
    (out,) = TorchEngine(loaded, eos_token_ids=stop_token_ids(loaded, tokenizer), pad_token_id=0).generate(
        [Request(0, prompts()[0])], sampling=SamplingParams(temperature=0.0, max_new_tokens=10), version=0)
    assert out.completion_ids == free.completion_ids[:4] and out.finish_reason == "stop"
    assert out.completion_ids == hf_greedy(loaded, prompts()[0], 10)  # HF stops there too
