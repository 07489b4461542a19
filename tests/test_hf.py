"""Hugging Face causal LMs (model.hf): fit on CPU, the loss against transformers' own, compile, export, errors."""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ROOT, losses
from trainer import Trainer, load_config
from trainer.config import ConfigError, to_yaml

transformers = pytest.importorskip("transformers")

# Tiny configs, as a model directory's config.json (special token ids inside the 256-token vocabulary).
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
             eos_token_id=0)  # fmt: skip
# GPT-2's configs default to dropout 0.1 (embd_pdrop, attn_pdrop, resid_pdrop), which the trainer keeps: off here,
# so that a forward is a function of the weights alone.
GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)  # fmt: skip
STEPS = 12


def _model_dir(root, config: dict):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Model directories holding only a config.json (what model.hf reads), and a small byte corpus."""
    root = tmp_path_factory.mktemp("hf")
    text = root / "text.txt"
    text.write_text((ROOT / "trainer" / "config.py").read_text())  # ~30 KB of bytes: loads in no time
    return SimpleNamespace(llama=_model_dir(root / "llama", LLAMA), gpt2=_model_dir(root / "gpt2", GPT2), text=text)


def _overrides(model_dir, run_dir, dirs, *extra):
    return [f"model.hf={model_dir}", f"data.path={dirs.text}", "data.seq_len=32", "train.micro_batch_size=4",
            f"train.steps={STEPS}", "train.eval_batches=2", "schedule.warmup_steps=2", "log.every=1",
            "log.progress=false", "optim.lr=3e-3", "compile.enabled=false", f"run.dir={run_dir}", *extra]  # fmt: skip


def _fit(*overrides):
    cfg = load_config(None, list(overrides))
    trainer = Trainer(cfg)
    trainer.fit()
    return cfg, trainer.raw_model, losses(Path(cfg.run.dir))


@pytest.fixture(scope="module")
def runs(dirs, tmp_path_factory):
    """One eager run of each model; the compile tests, the loss check and export compare against them."""
    out = {}
    for name in ("llama", "gpt2"):
        run_dir = tmp_path_factory.mktemp(f"run-{name}")
        cfg, model, loss = _fit(*_overrides(getattr(dirs, name), run_dir, dirs))
        out[name] = SimpleNamespace(cfg=cfg, model=model, losses=loss, dir=run_dir)
    return out


def _first_batch(cfg):
    from trainer import build, plan
    from trainer.data import load_corpus

    corpus = load_corpus(cfg.data.path, cfg.data.vocab_size, cfg.data.val_fraction, cfg.data.seq_len)
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    return build.batches(plan.one_process(cfg), corpus, env).train_batch(0, 0), corpus


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fit_trains_and_the_first_loss_is_transformers_own(name, runs):
    from trainer import build, plan

    run = runs[name]
    steps = sorted(run.losses)
    assert steps == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(v)) for v in run.losses.values())
    # From ~ln(256) = 5.55 at random init; observed 4.03 (llama) and 4.06 (gpt2) after 12 steps at lr 3e-3.
    assert run.losses[STEPS] < run.losses[1] - 0.7, run.losses
    # Step 1's logged loss is the initial model's on batch 0: rebuild that model (same seed) and compute the loss by
    # hand from transformers' logits, with the targets as they are (already shifted: no labels=, no second shift).
    (x, y), corpus = _first_batch(run.cfg)
    build.seed_everything(run.cfg.seed)
    model = build.make_model(plan.one_process(run.cfg), corpus.vocab_size)
    with torch.no_grad():
        logits = model.hf(x).logits  # (B, T, V)
        by_hand = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()
        double_shift = model.hf(x, labels=y).loss.item()  # what labels= computes: y shifted once more
    # Same fp32 kernels in the same order: observed equal to the last bit (the logged value went through .item()).
    assert run.losses[1] == pytest.approx(by_hand, abs=1e-6)
    # At init every loss is near ln(256), but a second shift still moves it far more than the tolerance above:
    # observed 3.5e-3 (llama) and 2.7e-2 (gpt2).
    assert abs(double_shift - by_hand) > 1e-4, (double_shift, by_hand)


def test_find_blocks_finds_the_decoder_layers_through_the_adapter(runs):
    from trainer.models.blocks import find_blocks
    from trainer.models.hf import HFCausalLM

    llama, gpt2 = runs["llama"].model, runs["gpt2"].model
    assert isinstance(llama, HFCausalLM) and isinstance(gpt2, HFCausalLM)
    path, blocks = find_blocks(llama)
    assert path == "hf.model.layers" and blocks is llama.hf.model.layers and len(blocks) == 2
    path, blocks = find_blocks(gpt2)
    assert path == "hf.transformer.h" and blocks is gpt2.hf.transformer.h
    assert find_blocks(gpt2, "hf.transformer.h")[1] is blocks  # compile.blocks names them by this path
    # The state dict is the Hugging Face model's under one prefix.
    assert set(llama.state_dict()) == {f"hf.{k}" for k in llama.hf.state_dict()}


def test_tied_embeddings_stay_tied_through_training_and_checkpoints(runs):
    model = runs["gpt2"].model
    assert model.hf.lm_head.weight is model.hf.transformer.wte.weight
    saved = torch.load(runs["gpt2"].dir / "checkpoints" / f"step_{STEPS:06d}" / "model.pt", weights_only=True)
    assert torch.equal(saved["hf.lm_head.weight"], saved["hf.transformer.wte.weight"])
    assert torch.equal(saved["hf.lm_head.weight"], model.hf.lm_head.weight.detach())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_resume_continues_exactly(name, runs, dirs, tmp_path, monkeypatch):
    """Stopped at step 6 with a checkpoint, resumed to 12: the straight run's losses, bit for bit. The resume builds
    the model without initialising it (trainer.models.no_init): the checkpoint fills every parameter, and the
    buffers it does not hold (Llama's rotary inv_freq, non-persistent) are computed as a fresh build computes them.
    GPT-2's head stays tied to its token table."""
    from trainer.models import no_init

    cfg = load_config(None, _overrides(getattr(dirs, name), tmp_path, dirs, "train.stop_at=6"))
    Trainer(cfg).fit()
    assert sorted(losses(tmp_path)) == list(range(1, 7))
    built, original = [], no_init.build_without_init
    monkeypatch.setattr(no_init, "build_without_init", lambda build: built.append(original(build)) or built[-1])
    cfg = load_config(None, _overrides(getattr(dirs, name), tmp_path, dirs))
    trainer = Trainer(cfg, resume="last")
    trainer.fit()
    assert len(built) == 1 and built[0][0] is trainer.raw_model and built[0][1] is None  # no init, no fallback
    straight, resumed = runs[name].losses, losses(tmp_path)
    assert [resumed[s] for s in range(7, STEPS + 1)] == [straight[s] for s in range(7, STEPS + 1)]
    buffers = dict(runs[name].model.named_buffers())
    assert buffers.keys() == dict(trainer.raw_model.named_buffers()).keys()
    assert all(torch.equal(b, buffers[n]) for n, b in trainer.raw_model.named_buffers()), name
    if name == "llama":
        rotary = trainer.raw_model.hf.model.rotary_emb
        assert "model.rotary_emb.inv_freq" not in trainer.raw_model.hf.state_dict()  # not in the checkpoint
        assert torch.equal(rotary.original_inv_freq, runs[name].model.hf.model.rotary_emb.original_inv_freq)
    else:
        assert trainer.raw_model.hf.lm_head.weight is trainer.raw_model.hf.transformer.wte.weight


def test_flops_per_token_counts_as_the_builtin_gpt_does(runs):
    """GPT-2 through the adapter and the built-in GPT of the same shape (64 positions): the same 6N + 12·L·C·T."""
    from trainer.models import GPT, GPTConfig, flops_per_token

    gpt = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))
    hf = runs["gpt2"].model
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in gpt.parameters())
    assert flops_per_token(hf, 32) == flops_per_token(gpt, 32) == gpt.flops_per_token(32)
    # Llama, untied: 2 layers x (attention 64x64 q, o + 2 x 64x32 k, v; MLP 3 x 64x128; 2 norms) + final norm +
    # head 64x256, the embedding table not counted; attention 12 x 2 layers x 64 x 32.
    n = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64 + 64 * 256
    assert flops_per_token(runs["llama"].model, 32) == 6 * n + 12 * 2 * 64 * 32


@pytest.mark.parametrize(
    "name, extra",
    [
        ("llama", ["compile.scope=model"]),
        ("gpt2", ["compile.scope=blocks", "compile.blocks=hf.transformer.h"]),
    ],
)
def test_compiled_runs_match_eager(name, extra, runs, dirs, tmp_path, fresh_dynamo):
    cfg, _, loss = _fit(*_overrides(getattr(dirs, name), tmp_path, dirs, "compile.enabled=true",
                                    "compile.backend=aot_eager", *extra))  # fmt: skip
    eager = runs[name].losses
    # aot_eager runs the same aten ops as eager, but the captured graph's decompositions may reorder a reduction:
    # observed equal to the last bit on CPU.
    for step in eager:
        assert loss[step] == pytest.approx(eager[step], abs=1e-5), (step, loss[step], eager[step])
    report = json.loads((tmp_path / "compile_report.json").read_text())
    assert report["graph_break_count"] == 0, report["graph_breaks"]
    train = [c for c in report["graphs"]["compiles"] if c["kind"] == "forward" and c["compile_id"].endswith("/0")]
    if cfg.compile.scope == "model":
        assert len(train) == 1, train  # the whole model, one graph (the evaluation's no-grad recompile aside)
    else:  # one graph for both blocks (their parameters are graph inputs), one for the head and loss
        assert len(train) == 2 and [c["function"] for c in train].count("head_loss") == 1, train


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process: intended here
@pytest.mark.parametrize("checkpoint", ["model.pt", "dcp"])
def test_export_loads_with_from_pretrained(checkpoint, runs, tmp_path):
    from trainer.cli import main

    run = runs["llama"]
    run_dir = run.dir
    if checkpoint == "dcp":  # the layout an fsdp run writes: the model's tensors as DCP shards, no model.pt
        import torch.distributed.checkpoint as dcp

        from trainer.checkpoint.integrity import write_manifest

        run_dir = tmp_path / "run"
        shutil.copytree(run.dir, run_dir)
        ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
        state = torch.load(ckpt / "model.pt", weights_only=True)
        dcp.save({"model": state}, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
        (ckpt / "model.pt").unlink()
        write_manifest(ckpt)  # the checkpoint's files as this layout has them: it is intact
    out = tmp_path / "out"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "trainer_config.yaml").is_file()
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = run.model(x)  # the trained adapter's logits (forward without targets)
        got = exported(x).logits
    # The same weights through the same fp32 code: observed max |diff| 0.0.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_export_keeps_gpt2_tied(runs, tmp_path):
    from trainer.cli import main

    assert main(["export", str(runs["gpt2"].dir), str(tmp_path)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert exported.lm_head.weight is exported.transformer.wte.weight
    assert torch.equal(exported.lm_head.weight, runs["gpt2"].model.hf.lm_head.weight.detach())


def test_export_gives_the_config_the_trained_vocabularys_special_ids(dirs, tmp_path, capsys):
    """The README's shrunk Llama-3.2-1B (bos 128000, eos 128001 in its config) trained with 256 tokens of bytes:
    the exported config and generation config name no token past the vocabulary."""
    from trainer.cli import main

    shrunk = ("model.hf_overrides={num_hidden_layers: 1, hidden_size: 64, num_attention_heads: 4, "
              "num_key_value_heads: 2, intermediate_size: 128, vocab_size: 256}")  # fmt: skip
    _fit(*_overrides("configs/hf/llama-3.2-1b", tmp_path / "run", dirs, shrunk, "train.steps=2"))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert (
        "export: special token ids of the trained 256-token vocabulary (the data is bytes, which have no special "
        "tokens): bos_token_id 128000 -> None, eos_token_id 128001 -> None"
    ) in capsys.readouterr().out
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / "out" / name).read_text())
        assert saved.get("bos_token_id") is None and saved.get("eos_token_id") is None, (name, saved)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.eos_token_id is None


def test_special_ids_of_prepared_or_unknown_data():
    """Prepared data: eos is its end-of-text token, an id past the vocabulary becomes it; data whose tokenizer is
    not known keeps the ids the vocabulary holds."""
    from trainer.models.hf import HFCausalLM, fit_special_ids

    def llama(**ids):
        config = transformers.LlamaConfig(**{**{k: v for k, v in LLAMA.items() if k != "model_type"}, **ids})
        return HFCausalLM(transformers.LlamaForCausalLM(config))

    model = llama(bos_token_id=128000, eos_token_id=[128001, 128009], pad_token_id=None)
    said = fit_special_ids(model, 256, "prepared", 0)
    assert said.endswith("bos_token_id 128000 -> 0, eos_token_id [128001, 128009] -> 0")
    config = model.hf.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, None)
    assert (model.hf.generation_config.bos_token_id, model.hf.generation_config.eos_token_id) == (0, 0)
    model = llama(bos_token_id=1, eos_token_id=128001, pad_token_id=2)
    assert fit_special_ids(model, 256, "unknown", None).endswith("eos_token_id 128001 -> None")
    assert (model.hf.config.bos_token_id, model.hf.config.pad_token_id) == (1, 2)
    assert fit_special_ids(llama(bos_token_id=1, eos_token_id=2), 256, "prepared", 2) is None  # nothing to change


def test_pretrained_loads_the_weights(dirs, tmp_path):
    from trainer.models.hf import build_hf_model

    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path)
    model = build_hf_model(str(tmp_path), pretrained=True, vocab_size=256, seq_len=32)
    for k, v in saved.state_dict().items():
        assert torch.equal(model.state_dict()[f"hf.{k}"], v), k
    random = build_hf_model(str(tmp_path), pretrained=False)
    assert not torch.equal(random.hf.lm_head.weight, saved.lm_head.weight)
    with pytest.raises(ValueError, match="model.pretrained: cannot load the weights"):
        build_hf_model(str(dirs.llama), pretrained=True)  # a config.json and no weights
    # hf_overrides change the config before the model is built.
    small = build_hf_model(str(dirs.llama), overrides={"num_hidden_layers": 1, "vocab_size": 300})
    assert len(small.hf.model.layers) == 1 and small.hf.lm_head.out_features == 300


def test_a_pretrained_run_resumes_without_reading_the_weights_again(dirs, tmp_path):
    """model.pretrained=true: a resume's checkpoint holds every weight, so the pretrained ones are not read again (here
    they are gone by then, which a read would stop on) and the run continues as the straight run, bit for bit."""
    model_dir = tmp_path / "model"
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    straight = _fit(*_overrides(model_dir, tmp_path / "straight", dirs, "model.pretrained=true"))[2]
    run = tmp_path / "run"
    Trainer(load_config(None, _overrides(model_dir, run, dirs, "model.pretrained=true", "train.stop_at=6"))).fit()
    weights = list(model_dir.glob("*.safetensors"))
    assert weights
    for f in weights:
        f.unlink()
    Trainer(load_config(None, _overrides(model_dir, run, dirs, "model.pretrained=true")), resume="last").fit()
    resumed = losses(run)
    assert [resumed[s] for s in range(7, STEPS + 1)] == [straight[s] for s in range(7, STEPS + 1)]


def _cli(capsys, *argv):
    from trainer.cli import main

    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_user_errors_exit_2(dirs, tmp_path, capsys):
    rc, err = _cli(capsys, "print-config", f"model.hf={dirs.llama}", "model.target=pkg.mod:make")
    assert rc == 2 and "model.hf" in err and "model.target" in err, err
    rc, err = _cli(capsys, "print-config", f"model.hf={dirs.llama}", "model.n_layer=2")
    assert rc == 2 and "model.n_layer" in err and "model.hf_overrides" in err, err
    rc, err = _cli(capsys, "print-config", "model.pretrained=true")
    assert rc == 2 and "model.pretrained" in err and "set model.hf" in err, err
    missing = tmp_path / "no" / "such" / "model"
    rc, err = _cli(capsys, "fit", "configs/tiny.yaml", *_overrides(missing, tmp_path / "r1", dirs))
    assert rc == 2 and "no such directory" in err and str(missing) in err, err
    # A byte corpus (256 tokens) in a 128-token vocabulary; 64 positions for sequences of 128.
    rc, err = _cli(capsys, "fit", "configs/tiny.yaml", *_overrides(dirs.gpt2, tmp_path / "r2", dirs),
                   "model.hf_overrides={vocab_size: 128}")  # fmt: skip
    assert rc == 2 and "data.vocab_size" in err and "(256 tokens)" in err and "(128," in err, err
    rc, err = _cli(capsys, "fit", "configs/tiny.yaml", *_overrides(dirs.gpt2, tmp_path / "r3", dirs),
                   "data.seq_len=128")  # fmt: skip
    assert rc == 2 and "data.seq_len: 128" in err and "64 positions" in err, err
    rc, err = _cli(capsys, "fit", "configs/tiny.yaml", *_overrides(dirs.gpt2, tmp_path / "r4", dirs),
                   "model.hf_overrides={n_layers: 1}")  # fmt: skip
    assert rc == 2 and "model.hf_overrides.n_layers" in err and "did you mean 'n_layer'" in err, err
    # export: of a run of the built-in GPT, of a directory that is no run, of a run without checkpoints.
    gpt_run = tmp_path / "gpt-run"
    gpt_run.mkdir()
    (gpt_run / "config.yaml").write_text(to_yaml(load_config(None)))
    rc, err = _cli(capsys, "export", str(gpt_run), str(tmp_path / "out"))
    assert rc == 2 and "needs a run of a model.hf model" in err, err
    rc, err = _cli(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert rc == 2 and "no such run directory" in err, err
    rc, err = _cli(capsys, "export", str(dirs.llama), str(tmp_path / "out"))
    assert rc == 2 and "not a run directory" in err, err
    hf_run = tmp_path / "hf-run"
    hf_run.mkdir()
    (hf_run / "config.yaml").write_text(to_yaml(load_config(None, [f"model.hf={dirs.llama}"])))
    rc, err = _cli(capsys, "export", str(hf_run), str(tmp_path / "out"))
    assert rc == 2 and "no complete checkpoint" in err, err


def test_hf_config_checks():
    cfg = load_config(None, ["model.hf=some/dir"])
    assert cfg.model.preset is None  # set to null: the shape is the Hugging Face config's
    with pytest.raises(ConfigError, match="model.attention: applies to the built-in GPT only; drop it with model.hf"):
        load_config(None, ["model.hf=some/dir", "model.attention=math"])
    with pytest.raises(ConfigError, match="model.layer_norm: removed .* use compile.kernels"):
        load_config(None, ["model.hf=some/dir", "model.layer_norm=triton"])
    with pytest.raises(ConfigError, match="model.dropout"):
        load_config(None, ["model.hf=some/dir", "model.dropout=0.1"])


def test_without_transformers_or_network_the_message_says_what_to_do(dirs, monkeypatch):
    from trainer.models.hf import build_hf_model

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
        with pytest.raises(ValueError, match=r"pip install -e '\.\[hf\]'"):
            build_hf_model(str(dirs.llama))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as without network, without retries
    with pytest.raises(ValueError, match="cannot be fetched from the Hugging Face hub.*pass the local directory"):
        build_hf_model("someorg/no-such-model")


def test_an_architecture_without_sdpa_runs_eager_attention_and_says_so(dirs, monkeypatch):
    """transformers refuses sdpa for some architectures (Gemma-2 in 5.24): the model is built with its eager
    attention instead, and the startup line says so; a config that cannot build is a user error."""
    from trainer import describe
    from trainer.models.hf import attention_of, build_hf_model

    auto = transformers.AutoModelForCausalLM
    real = auto.from_config.__func__

    def refuses_sdpa(cls, config, **kwargs):  # what transformers raises for such an architecture
        if kwargs.get("attn_implementation") == "sdpa":
            raise ValueError("LlamaForCausalLM does not support an attention implementation through "
                             "torch.nn.functional.scaled_dot_product_attention yet.")  # fmt: skip
        return real(cls, config, **kwargs)

    monkeypatch.setattr(auto, "from_config", classmethod(refuses_sdpa))
    model = build_hf_model(str(dirs.llama))
    assert attention_of(model) == "eager" and model.hf.config._attn_implementation == "eager"
    cfg = load_config(None, [f"model.hf={dirs.llama}", f"data.path={dirs.text}"])
    from trainer.distributed.env import DistEnv
    from trainer.plan import resolve

    the_plan = resolve(cfg, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None))
    corpus = SimpleNamespace(description="text", train=[0] * 10)
    line = describe.describe_run(the_plan, model, corpus, 1024)
    assert "attention: transformers' eager implementation (LlamaForCausalLM has no sdpa" in line, line
    monkeypatch.undo()
    assert attention_of(build_hf_model(str(dirs.llama))) == "sdpa"
    assert "attention:" not in describe.describe_run(the_plan, build_hf_model(str(dirs.llama)), corpus, 1024)
    # A token id past the vocabulary: the embedding's padding_idx assertion, as a user error naming the config.
    with pytest.raises(ValueError, match=r"LlamaConfig cannot be built from this config \(AssertionError: Padding"):
        build_hf_model(str(dirs.llama), overrides={"pad_token_id": 999})


def _two_rank_common(dirs) -> list[str]:
    """The Llama run of test_two_ranks_reproduce_one_process, but its run.dir and batch size: 4 steps, compiled."""
    common = [*_overrides(dirs.llama, None, dirs), "train.steps=4", "compile.enabled=true", "compile.backend=aot_eager"]
    return [o for o in common if not o.startswith(("run.dir=", "train.micro_batch_size="))]


@pytest.fixture(scope="module")
def llama_one_process(dirs, tmp_path_factory):
    """The reference of both strategies below: one process (a test process) x 4 sequences."""
    from tests.conftest import shared_run

    def make(one):
        torch._dynamo.reset()  # compiled as in a process of its own
        _fit(*_two_rank_common(dirs), "train.micro_batch_size=4", f"run.dir={one}")
        torch._dynamo.reset()

    return shared_run(tmp_path_factory, "hf-llama-one", make)


@pytest.mark.parametrize(
    "strategy",
    [
        ["distributed.strategy=ddp", "distributed.bucket_mb=0.01"],
        ["distributed.strategy=fsdp", "distributed.fsdp_unit_mb=0"],
    ],
    ids=["ddp", "fsdp"],
)
def test_two_ranks_reproduce_one_process(strategy, dirs, llama_one_process, tmp_path):
    """2 gloo ranks x 2 sequences against 1 process x 4 (tests/test_distributed.py's harness), compiled: ddp split at
    the bucket plan's blocks, fsdp with a unit per decoder layer."""
    from tests.test_distributed import _params, _torchrun

    one, two = llama_one_process, tmp_path / "two"
    r = _torchrun(2, *_two_rank_common(dirs), "train.micro_batch_size=2", *strategy, f"run.dir={two}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "do not follow the bucket plan" not in r.stdout + r.stderr
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    # The ranks' gradients are summed in another order than one process's batched matmuls: observed max |diff| 7.2e-7
    # for ddp and for fsdp.
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    pa, pb = _params(one, 4), _params(two, 4)
    assert set(pa) == set(pb)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 1.4e-6 (Adam's update, fp32)


def test_compiled_blocks_attend_causally_with_no_mask_made_between_them(dirs, monkeypatch):
    """compile.scope=blocks (and fsdp) run the model's code between the blocks eagerly. There transformers makes the
    attention mask each forward: it reads the positions on the host (a sync) to look for packed sequences, and while
    a CUDA graph is captured (which it takes for tracing, as forced here) it makes a dense mask, a new input of every
    block. A causal model on SDPA gets no mask made at all: the blocks see None (SDPA's is_causal), the logits are
    the uncompiled model's, and a model with a sliding window keeps transformers' masks."""
    import transformers.masking_utils as masking

    from trainer.compile.capture import apply_compile
    from trainer.models.hf import CAUSAL_SDPA, attention_of, build_hf_model, causal_sdpa_without_mask

    torch.manual_seed(0)
    reference = build_hf_model(str(dirs.llama))
    model = build_hf_model(str(dirs.llama))
    model.load_state_dict(reference.state_dict())
    compiled = apply_compile(model, load_config(None, ["compile.scope=blocks", "compile.backend=aot_eager"]).compile)
    assert model.hf.config._attn_implementation == CAUSAL_SDPA and attention_of(model) == "sdpa"
    seen, looked = [], []
    for layer in model.hf.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    real_find = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: looked.append(1) or real_find(*a, **k))
    monkeypatch.setattr(masking, "is_tracing", lambda *a, **k: True)  # as transformers sees a CUDA graph's capture
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        out = compiled(idx)
        assert seen == [None, None] and not looked
        expected = reference(idx)  # the uncompiled model on transformers' SDPA: its mask made, as the blocks' was
    assert looked
    torch.testing.assert_close(out, expected)
    window = _model_dir(dirs.llama.parent / "mistral", dict(LLAMA, model_type="mistral", sliding_window=8))
    mistral = build_hf_model(str(window))
    assert not causal_sdpa_without_mask(mistral) and mistral.hf.config._attn_implementation == "sdpa"


DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               vocab_size=128, max_position_embeddings=64)  # fmt: skip
NO_WINDOW = dict(DECODER, sliding_window=None)
CAUSAL_SDPA_CONFIGS = {
    "llama": DECODER, "mistral": NO_WINDOW, "mixtral": dict(NO_WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": DECODER, "qwen3": dict(DECODER, head_dim=16), "gemma": dict(DECODER, head_dim=16), "phi": DECODER,
    "phi3": dict(NO_WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2), "olmo": DECODER, "granite": DECODER,
    "starcoder2": NO_WINDOW, "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(DECODER, rotary_pct=0.25),
}  # fmt: skip


def test_each_architecture_that_makes_no_mask_computes_what_transformers_sdpa_path_does():
    """Every architecture of CAUSAL_SDPA_MODELS, a tiny random model of each: the logits with no mask made (SDPA's
    is_causal) equal those on transformers' own SDPA path, exactly; an architecture outside it (Falcon, whose
    attention branches on the name "sdpa") keeps transformers' path."""
    import copy

    from trainer.models.hf import CAUSAL_SDPA_MODELS, HFCausalLM, causal_sdpa_without_mask

    assert set(CAUSAL_SDPA_CONFIGS) == CAUSAL_SDPA_MODELS
    idx = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    for model_type, fields in CAUSAL_SDPA_CONFIGS.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **fields)
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        reference, model = HFCausalLM(hf), HFCausalLM(copy.deepcopy(hf))
        assert causal_sdpa_without_mask(model), model_type
        with torch.no_grad():
            assert torch.equal(model(idx), reference(idx)), model_type
    falcon = transformers.AutoConfig.for_model("falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               vocab_size=128)  # fmt: skip
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(falcon, attn_implementation="sdpa"))
    assert not causal_sdpa_without_mask(model) and model.hf.config._attn_implementation == "sdpa"
