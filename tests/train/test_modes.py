"""The three training modes on tiny-random-llama: losses go down, outputs reload, frozen-base is exact."""
import json

import pytest
import torch
from safetensors.torch import load_file
from space.adapter_layers import GatedLoraLinear, fuse_frozen_base, prepare_model
from space.config import SpaceSettings, parse_train_args
from space.data.collator import SpaceCollator
from space.loader import load_space, warm_start
from space.masking import mask_rows
from space.models import load_model, tiny_random_llama
from space.train import run as run_module
from space.train.run import run_sft
from space.train.steps import frozen_base_step, one_pass_step


@pytest.fixture(scope="module")
def confident_tiny(tmp_path_factory):
    """The tiny Llama with init std 0.2, saved as a local HF folder. At transformers' ordinary 0.02
    its logits are nearly uniform, and a frozen base whose outputs cannot sharpen leaves the masks
    nothing to learn in 40 steps; these tests are about learning, not about exactness."""
    path = tmp_path_factory.mktemp("confident-tiny")
    model, tok = tiny_random_llama(seed=0, initializer_range=0.2)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def train(tmp_path, mode, steps=40, extra=(), model="tiny-random-llama"):
    args = parse_train_args([
        "--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path / mode), "--mode", mode,
        "--model_name_or_path", model,
        "--limit", "4", "--max_steps", str(steps), "--learning_rate", "1e-2", "--save_steps", "1000",
        "--logging_steps", "5", "--mask_num", "3", "--spans_per_sample", "4", "--lr_scheduler_type", "constant",
        *extra])
    out = run_sft(*args)
    history = json.loads((tmp_path / mode / "log_history.json").read_text())
    return out, [h for h in history if "mask_loss" in h]


def test_frozen_base_keeps_real_logits_and_learns_masks(tmp_path, monkeypatch, confident_tiny):
    """The artifact holds no base weight, so comparing it with the base cannot show a base that
    trained: the trained model is read as it is saved, its trainable parameters must be the LoRA
    and mask rows alone, and every base weight must be the base model's bit for bit."""
    seen = {}

    def save_and_read(out_dir, model, *args, **kwargs):
        seen["trainable"] = {n for n, p in model.named_parameters() if p.requires_grad}
        seen["base"] = {n: p.detach().clone() for n, p in model.named_parameters()
                        if "lora_" not in n and "mask_rows" not in n}
        return real_save(out_dir, model, *args, **kwargs)

    real_save = run_module.save_artifact
    monkeypatch.setattr(run_module, "save_artifact", save_and_read)
    out, logs = train(tmp_path, "frozen-base", model=confident_tiny)
    assert seen["trainable"] and all("lora_" in n or "mask_rows" in n for n in seen["trainable"]), seen["trainable"]
    original = dict(load_model(confident_tiny)[0].named_parameters())
    model, _, spec = load_space(adapter=out)
    for name, weight in seen["base"].items():  # peft's names: base_model.model.<name>, base_layer; MaskEmbedding's base
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".base.weight", ".weight")
        # the mask token's own row is written when it is added (its trained row is MaskEmbedding's)
        rows = [i for i in range(original[plain].shape[0]) if i not in spec.token_ids]
        assert torch.equal(weight[rows], original[plain][rows]), name
    assert logs[-1]["mask_loss"] < 0.7 * logs[0]["mask_loss"]
    assert "ar_loss" not in logs[0]  # two-pass: real tokens run without gradients
    base, _ = load_model(confident_tiny)
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, base(input_ids=ids).logits
    assert torch.equal(got[..., : want.shape[-1]][..., :259], want[..., :259])  # bit-identical
    assert (out / "adapter_model.safetensors").stat().st_size < 1_000_000


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_full_and_lora_learn_and_reload(tmp_path, monkeypatch, confident_tiny, mode):
    """The reloaded artifact computes what the trained model computed, mask rows included."""
    probe = torch.tensor([[1, 2, 3, 40, 41, 259, 259, 259]])  # real tokens, then a mask group
    trained = {}

    def save_and_remember(out_dir, model, *args, **kwargs):
        with torch.no_grad():
            trained["logits"] = model.eval()(input_ids=probe).logits
        return real_save(out_dir, model, *args, **kwargs)

    real_save = run_module.save_artifact
    monkeypatch.setattr(run_module, "save_artifact", save_and_remember)
    out, logs = train(tmp_path, mode, model=confident_tiny)
    assert logs[-1]["ar_loss"] < 0.7 * logs[0]["ar_loss"] and logs[-1]["mask_loss"] < 0.7 * logs[0]["mask_loss"]
    model, tok, spec = load_space(model=str(out)) if mode == "full" else load_space(adapter=out)
    assert spec.mask_num == 3 and spec.token_ids == (259,)
    untrained, _ = load_model(confident_tiny)
    with torch.no_grad():
        got = model(input_ids=probe).logits
        base = untrained(input_ids=probe[:, :5]).logits
    assert torch.allclose(got, trained["logits"], atol=1e-4)  # a merged LoRA rounds differently
    assert not torch.allclose(got[:, :5, :256], base[..., :256], atol=1e-2)  # and training changed it


def test_two_pass_equals_gated_one_pass():
    """frozen-base: the trainer's two passes give the same mask logits as one gated forward."""
    model, tok = load_model("tiny-random-llama")
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    for name, p in model.named_parameters():  # make the LoRA update non-zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    col = SpaceCollator(spec.ids_for(3), 3, tok.pad_token_id, spans_per_sample=2)
    b = col([{"input_ids": list(range(30, 60)), "prompt_len": 5, "idx": 0},
             {"input_ids": list(range(70, 90)), "prompt_len": 5, "idx": 1}])
    T = b["num_real"]
    with torch.no_grad():
        one = one_pass_step(model, b, SpaceSettings(mask_num=3)).logits
        two = frozen_base_step(model, b, SpaceSettings(mask_num=3)).logits
    rows = b["mask_offset"][:, T:] >= 0
    assert (one[:, T:][rows] - two[rows]).abs().max() < 1e-4


def test_fused_gated_lora_equals_peft():
    """Decoding's GatedLoraLinear gives the peft-gated model's logits: mask rows close, real rows
    bit-identical, and a forward without masks is exactly the base model."""
    model, tok = load_model("tiny-random-llama")
    model, spec = prepare_model(model, tok, "frozen-base", 3)
    for name, p in model.named_parameters():  # make the LoRA update non-zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    mask = spec.token_ids[0]
    block = torch.tensor([[5, 6, 7, 8, mask, mask, mask, mask, mask, mask]])  # real rows, then mask rows
    plain = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with mask_rows(4):
            want = model(input_ids=block).logits
        want_plain = model(input_ids=plain).logits  # no mask_rows scope: the LoRA updates no row
        with model.disable_adapter():
            base_block, base_plain = model(input_ids=block).logits, model(input_ids=plain).logits
        fused = fuse_frozen_base(model)
        with mask_rows(4):
            got = fused(input_ids=block).logits
        got_plain = fused(input_ids=plain).logits
    assert sum(isinstance(m, GatedLoraLinear) for m in fused.modules()) == 7 * fused.config.num_hidden_layers
    assert (want[0, 4:] - base_block[0, 4:]).abs().max() > 1e-2  # the update really acts on mask rows
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[0, :4], want[0, :4]) and torch.equal(got_plain, base_plain) and torch.equal(want_plain, base_plain)
    with pytest.raises(ValueError, match="frozen-base"):
        fuse_frozen_base(load_model("tiny-random-llama")[0])


def test_resume_from_last_checkpoint(tmp_path, capsys):
    train(tmp_path, "frozen-base", steps=4, extra=("--save_steps", "2"))
    rows_before = load_space(adapter=tmp_path / "frozen-base" / "final")[0].get_input_embeddings().mask_rows.clone()
    capsys.readouterr()
    out, _ = train(tmp_path, "frozen-base", steps=6, extra=("--save_steps", "2"))
    assert "resuming: 4 of" in capsys.readouterr().out and "checkpoint-4" in str(sorted((tmp_path / "frozen-base").iterdir()))
    cfg = json.loads((out / "space_config.json").read_text())
    assert cfg["global_step"] == 6 and cfg["mode"] == "frozen-base" and cfg["base_model"] == "tiny-random-llama"
    rows_after = load_space(adapter=out)[0].get_input_embeddings().mask_rows
    assert not torch.equal(rows_before, rows_after)


def test_warm_start_copies_lora_and_mask_rows(tmp_path):
    """init_adapter: the new run starts exactly where the artifact ended, and a mismatch is refused."""
    out, _ = train(tmp_path, "frozen-base", steps=3)
    fresh, spec = prepare_model(*load_model("tiny-random-llama"), "frozen-base", 3)  # tiny_smoke's LoRA shape
    saved = load_file(out / "adapter_model.safetensors")
    lora = {k: v for k, v in fresh.state_dict().items() if "lora_B" in k}
    assert all(torch.count_nonzero(v) == 0 for v in lora.values())  # peft starts B at zero
    warm_start(fresh, out, "frozen-base", spec)
    state = fresh.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key.replace(".weight", ".default.weight")], value), key
    assert torch.equal(fresh.get_input_embeddings().mask_rows, load_space(adapter=out)[0].get_input_embeddings().mask_rows)
    with pytest.raises(ValueError, match="mask_num"):
        k2, k2_spec = prepare_model(*load_model("tiny-random-llama"), "frozen-base", 2)
        warm_start(k2, out, "frozen-base", k2_spec)
    with pytest.raises(ValueError, match="other settings.*'lora_r': .16, 4."):
        other, other_spec = prepare_model(*load_model("tiny-random-llama"), "frozen-base", 3, lora_r=4)
        warm_start(other, out, "frozen-base", other_spec)
    with pytest.raises(ValueError, match="mode"):
        warm_start(fresh, out, "lora", spec)


def test_time_budget_stops_saves_and_writes_the_artifact(tmp_path):
    """max_train_minutes: the step that crosses the budget is the last; it is checkpointed (so a
    relaunch resumes) and the artifact records it. Without the budget the run would take 50 steps."""
    args = parse_train_args(["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path),
                             "--limit", "4", "--max_steps", "50", "--save_steps", "1000",
                             "--max_train_minutes", "1e-6"])
    out = run_sft(*args)
    assert json.loads((out / "space_config.json").read_text())["global_step"] == 1
    assert (tmp_path / "checkpoint-1").is_dir()
    with pytest.raises(ValueError, match="max_train_minutes"):
        parse_train_args(["--config", "configs/train/tiny_smoke.yaml", "--output_dir", str(tmp_path),
                          "--max_train_minutes", "-1"])


def test_a_gated_lora_on_flattened_rows_is_refused():
    """Qwen2-MoE's shared expert runs its gate/up/down on (tokens, features), which the default
    targets match (peft 0.22 refuses those names on Qwen2-MoE for its routed experts, so they are
    named through the shared expert here): the gate then took columns for rows. Decoding failed
    with a shape error, and frozen-base training applied the LoRA to every row of a batch's second sequence (its real
    rows changed: no longer lossless). Both now say which layer to leave out."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from space.adapter_layers import apply_lora
    from space.decoding import DecodeConfig, SpaceDecoder
    from space.models import tiny_tokenizer

    def moe():
        config = Qwen2MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=64)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return Qwen2MoeForCausalLM(config).eval(), tiny_tokenizer()

    model, tok = moe()
    shared = [f"shared_expert.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    peft_model, spec = prepare_model(model, tok, "frozen-base", 4, lora_targets=["q_proj", "v_proj", *shared])
    ids = torch.randint(11, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[:, 8:] = spec.token_ids[0]
    with pytest.raises(ValueError, match=r"got input of shape \(24, 64\).*leave it out of lora_targets"), mask_rows(8):
        peft_model(input_ids=ids)
    model, tok = moe()
    attention_only = prepare_model(model, tok, "frozen-base", 4, lora_targets=["q_proj", "v_proj"])[0]
    with mask_rows(8):
        attention_only(input_ids=ids)  # what the message advises runs
    model, tok = moe()
    _, spec = prepare_model(model, tok, "full", 4)
    name = "model.layers.0.mlp.shared_expert.up_proj"
    linear = model.get_submodule(name)
    apply_lora(model, {name: (torch.randn(4, linear.in_features), torch.randn(linear.out_features, 4))}, "frozen-base", "x")
    with pytest.raises(ValueError, match="leave it out of lora_targets"):
        SpaceDecoder(model, spec, DecodeConfig(4)).generate(ids[0, :8], 6)


@pytest.mark.parametrize("mode", ["frozen-base", "lora"])
def test_targets_peft_moves_onto_fused_experts_are_refused_at_setup(mode):
    """A DeepSeek-V3 with a dense layer and an MoE layer: peft under transformers 5 puts the
    gate_proj / up_proj / down_proj targets on the MoE experts' stacked weights (peft 0.19-0.21 also
    took them off the dense layer's MLP). The experts' update moved real rows (1.4 in logits:
    frozen-base no longer lossless), and the run failed only when it saved its final adapter. ``prepare_model`` refuses
    it, and half of a fused pair (peft's own error advised adding the other half), before it changes
    the model; the attention-only LoRA it advises keeps a frozen base's real rows."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from space.models import tiny_tokenizer

    def moe():
        config = DeepseekV3Config(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=16)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return DeepseekV3ForCausalLM(config).eval(), tiny_tokenizer()

    attention = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
    model, tok = moe()
    untouched = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"peft retargets lora_targets \['down_proj', 'gate_proj', 'up_proj'\] of a "
                                         r"deepseek_v3 model .*leave \['down_proj', 'gate_proj', 'up_proj'\] out"):
        prepare_model(model, tok, mode, 3, lora_targets=attention + ["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"peft refuses lora_targets .* on a deepseek_v3 model \(Cannot convert .*"
                                         r"leave them out of lora_targets"):
        prepare_model(model, tok, mode, 3, lora_targets=attention + ["gate_proj"])  # half of a fused pair
    state = model.state_dict()  # refused before the model changed: no mask token, no LoRA layer
    assert state.keys() == untouched.keys() and all(torch.equal(state[k], v) for k, v in untouched.items())
    ids = torch.randint(11, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids[:, :8]).logits
    peft_model, spec = prepare_model(model, tok, mode, 3, lora_targets=attention)
    assert not peft_model.peft_config["default"].target_parameters
    if mode == "frozen-base":
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
            ids[:, 8:] = spec.token_ids[0]
            with mask_rows(8):
                got = peft_model(input_ids=ids).logits[:, :8, :want.shape[-1]]
        tokens = [i for i in range(want.shape[-1]) if i not in spec.token_ids]  # the mask's own row is new
        assert (got - want)[..., tokens].abs().max() < 1e-5


def small_deepseek_moe():
    """A DeepSeek-V3 with a dense layer and an MoE layer (peft 0.22 converts targets only where there
    are experts), random weights: for what peft's conversion does to LoRA targets."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8))


def test_peft_rewrite_leaves_the_config_it_is_given():
    """``peft_rewrite`` answers how peft will rewrite a LoRA config on a model, on a copy: the config
    ``prepare_model`` then hands to peft is the one asked for. Catches the rewrite done in place
    (peft's conversion is in place: the caller's targets would be the rewritten ones)."""
    from peft import LoraConfig
    from space.adapter_layers import peft_rewrite

    model = small_deepseek_moe()
    targets = ["q_a_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoraConfig(r=4, target_modules=list(targets), task_type="CAUSAL_LM")
    rewritten = peft_rewrite(cfg, model)
    assert rewritten is not cfg
    assert rewritten.target_parameters  # what peft does (0.19-0.21 also drop the MLP names from target_modules)
    assert sorted(cfg.target_modules) == sorted(targets) and not cfg.target_parameters
    assert not cfg.rank_pattern and not cfg.alpha_pattern


@pytest.mark.parametrize("peft_keeps_the_names", [False, True], ids=["peft-0.21", "peft-0.22"])
def test_a_refusal_names_the_targets_peft_moves_whichever_peft_rewrote(peft_keeps_the_names):
    """peft 0.19-0.21 drop ``gate_proj`` / ``up_proj`` / ``down_proj`` from ``target_modules`` when
    they add the experts' parameters; 0.22 keeps them there. The refusal must name those three either
    way, not the attention targets and not an empty list (under 0.22 it said "leave [] out")."""
    from peft import LoraConfig
    from space.adapter_layers import check_targets_kept, retargeted

    model = small_deepseek_moe()
    asked = ["q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]
    kept = asked if peft_keeps_the_names else asked[:2]
    rewritten = LoraConfig(target_modules=kept, target_parameters=["gate_up_proj", "down_proj"],
                           rank_pattern={r".*\.gate_up_proj": 16}, alpha_pattern={r".*\.gate_up_proj": 32})
    mlp = r"\['down_proj', 'gate_proj', 'up_proj'\]"
    refusal = rf"peft retargets lora_targets {mlp} of a deepseek_v3 model .*leave {mlp} out"
    with pytest.raises(ValueError, match=refusal):
        check_targets_kept(asked, rewritten, model)
    assert retargeted(asked, model) == ["down_proj", "gate_proj", "up_proj"]
    assert retargeted(["q_a_proj", "o_proj"], model) == []
    check_targets_kept(asked[:2], LoraConfig(target_modules=asked[:2]), model)  # nothing rewritten: no refusal


@pytest.mark.parametrize("moved", ["down_proj", "gate"])
def test_an_moe_target_that_peft_only_adds_parameters_for_is_refused(moved):
    """peft 0.22 keeps ``down_proj`` in ``target_modules`` and adds the experts' ``down_proj`` to
    ``target_parameters``, with no rank or alpha pattern (those come with the fused gate/up pair);
    the router ``gate`` becomes ``gate.weight``. Catches the refusal reading only dropped names and
    rank/alpha patterns: down_proj alone trained the experts' weights unrefused."""
    from space.models import tiny_tokenizer

    with pytest.raises(ValueError, match=rf"peft retargets lora_targets \['{moved}'\] of a deepseek_v3 model .*"
                                         rf"leave \['{moved}'\] out"):
        prepare_model(small_deepseek_moe(), tiny_tokenizer(), "frozen-base", 3, lora_targets=["q_a_proj", moved])


@pytest.mark.parametrize("rewrite", [dict(target_modules=["q_a_proj"]), dict(target_parameters=["down_proj"]),
                                     dict(rank_pattern={r".*\.down_proj": 8}), dict(alpha_pattern={r".*\.down_proj": 8})],
                         ids=["dropped", "target_parameters", "rank_pattern", "alpha_pattern"])
def test_each_rewrite_peft_makes_is_refused_on_its_own(rewrite):
    """``check_targets_kept`` refuses a config that peft changed in any one way: a target dropped, or
    parameters, a rank pattern or an alpha pattern added. Catches a condition that needs one of the
    others (peft adds the patterns only with parameters today, another release need not)."""
    from peft import LoraConfig
    from space.adapter_layers import check_targets_kept

    asked = ["q_a_proj", "down_proj"]
    with pytest.raises(ValueError, match="peft retargets lora_targets"):
        check_targets_kept(asked, LoraConfig(**{"target_modules": asked, **rewrite}))


def test_a_refusal_without_the_model_names_the_dropped_targets_else_every_target():
    """Without the model (``prepare_model``'s check after peft), the refusal names the targets peft
    dropped from ``target_modules``, or, where it dropped none (peft 0.22 keeps them), every target:
    not the kept ones alone, not "leave [] out"."""
    from peft import LoraConfig
    from space.adapter_layers import check_targets_kept

    asked = ["q_a_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]
    mlp = r"\['down_proj', 'gate_proj', 'up_proj'\]"
    with pytest.raises(ValueError, match=rf"peft retargets lora_targets {mlp} of this model .*leave {mlp} out"):
        check_targets_kept(asked, LoraConfig(target_modules=asked[:2], target_parameters=["down_proj"]))
    every = r"\['down_proj', 'gate_proj', 'kv_a_proj_with_mqa', 'q_a_proj', 'up_proj'\]"
    with pytest.raises(ValueError, match=rf"peft retargets lora_targets {every} of this model .*leave {every} out"):
        check_targets_kept(asked, LoraConfig(target_modules=asked, target_parameters=["down_proj"]))


def test_prepare_model_refuses_a_rewrite_that_peft_made_but_its_preview_missed(monkeypatch):
    """``prepare_model`` checks the config peft actually used after ``get_peft_model`` too: a peft
    whose conversion ``peft_rewrite`` does not foresee (played by a preview that rewrites nothing)
    still cannot put a LoRA on the experts' stacked weights. Catches that second check dropped."""
    import copy

    from space import adapter_layers
    from space.models import tiny_tokenizer

    monkeypatch.setattr(adapter_layers, "peft_rewrite", lambda config, model: copy.deepcopy(config))
    with pytest.raises(ValueError, match=r"peft retargets lora_targets .*'down_proj'.* of this model"):
        prepare_model(small_deepseek_moe(), tiny_tokenizer(), "lora", 3, lora_targets=["q_a_proj", "down_proj"])


def test_retargeted_counts_each_change_peft_can_make_to_one_target(monkeypatch):
    """``retargeted`` names a target that peft's conversion, given it alone, drops, joins to
    parameters, gives a rank or alpha pattern, or refuses; not one it leaves as it was. A stand-in
    conversion makes each change to the target of that name (peft 0.22 adds parameters with every
    other change, a release need not)."""
    from peft import LoraConfig
    from space import adapter_layers

    def rewrite(config, model):
        (target,) = config.target_modules
        if target == "refused":
            raise ValueError("half of a fused pair")
        return LoraConfig(target_modules=[] if target == "dropped" else [target],
                          target_parameters=["w"] if target == "parameters" else None,
                          rank_pattern={"w": 8} if target == "rank" else {},
                          alpha_pattern={"w": 8} if target == "alpha" else {})

    monkeypatch.setattr(adapter_layers, "peft_rewrite", rewrite)
    asked = ["kept", "dropped", "parameters", "rank", "alpha", "refused"]
    assert adapter_layers.retargeted(asked, model=None) == sorted(asked[1:])
