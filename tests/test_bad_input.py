"""Every kind of bad input a user can type: one `error:` line, exit code 2, no MLflow run, no folder left.

Most kinds run in-process through the CLI's own path (`check_args`: compose + validate every point, then
`launch_or_clean_up`: the job with its pre-run checks); a representative set runs through the real CLI."""

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli

FLAWED = "data.train._target_=tests.plugins.FlawedSynthetic"

KINDS = [
    # Hydra's own composition errors: unknown keys, group choices, types, syntax.
    (["foo=1"], "unknown key 'foo'"),
    (["privacy.epsilon=3"], "did you mean privacy.target_epsilon?"),
    (["+privacy.epsilon=3"], "unknown key 'privacy.epsilon'"),
    (["+foo=1"], "unknown key 'foo'"),
    (["++foo=1"], "unknown key 'foo'"),
    (["+tracking.foo=1"], "unknown key 'tracking.foo'"),
    (["+launcher.gpus=2"], "did you mean launcher.gpus_per_node?"),
    (["learning_rat=0.1"], "did you mean learning_rate?"),
    (["model.foo=1"], "add it with +model.foo="),
    (["shard=bogus"], "shard=bogus is unknown; choose one of global, per_rank"),
    (["model=bogus"], "model=bogus is unknown; choose one of cnn, gpt, hf, mlp, resnet_gn, tiny_bert, tiny_gpt2, transformer, vit"),
    (["data=bogus"], "choose one of cifar10, digits, hf_text, synthetic, synthetic_images, synthetic_sequences, "
                     "synthetic_text"),
    (["privacy=bogus"], "choose one of bandmf, blt, dp, dpsgd, none"),
    (["backend=bogus"], "backend=bogus is unknown; choose one of auto, cncl, gloo"),
    (["launcher=bogus"], "choose one of inline, local, slurm"),
    (["tracking=bogus"], "choose one of mlflow, off"),
    (["dataloader=bogus"], "choose one of default, workers"),
    (["experiment=bogus"], "choose one of bench_gpt2_lora, bench_minilm, bench_resnet18, digits_eps1, gpt, images_resnet, "
                           "lm_lora, quick, text_classifier, users, vit"),
    (["seed=abc"], "wrong type for seed"),
    (["per_device_train_batch_size=1.5"], "wrong type for per_device_train_batch_size"),
    (["learning_rate=fast"], "wrong type for learning_rate"),
    (["privacy.enabled=maybe"], "wrong type for privacy.enabled"),
    (["launcher.nodes=two"], "wrong type for launcher.nodes"),
    (["tracking.tags=5"], "wrong type for tracking.tags"),
    (["~seed"], "seed cannot be removed"),
    (["+seed=3"], "An item is already at 'seed'"),
    (["seed=[1"], "cannot parse the override 'seed=[1'"),
    # Every numeric knob: NaN, inf, out of range.
    (["learning_rate=nan"], "learning_rate must be a finite number > 0, got nan"),
    (["learning_rate=inf"], "learning_rate must be a finite number > 0, got inf"),
    (["learning_rate=-inf"], "learning_rate must be a finite number > 0"),
    (["learning_rate=0"], "learning_rate must be > 0"),
    (["learning_rate=1e400"], "learning_rate must be a finite number > 0, got inf"),
    (["weight_decay=nan"], "weight_decay must be a finite number >= 0"),
    (["weight_decay=-1"], "weight_decay must be >= 0"),
    (["num_train_epochs=nan"], "num_train_epochs must be a finite number"),
    (["num_train_epochs=inf"], "num_train_epochs must be a finite number"),
    (["num_train_epochs=-1"], "num_train_epochs must be >= 0"),
    (["max_steps=-2"], "max_steps must be in [-1, 1000000000]"),
    (["max_steps=10000000000"], "max_steps must be in [-1, 1000000000]"),
    (["seed=-1"], "seed must be in [0, 4294967295], got -1"),
    (["seed=99999999999999999999999"], "seed must be in [0, 4294967295]"),
    (["seed=4294967296"], "seed must be in [0, 4294967295]"),
    (["data_seed=-1"], "data_seed must be in [0, 4294967295]"),
    (["per_device_train_batch_size=0"], "per_device_train_batch_size must be >= 1"),
    (["per_device_eval_batch_size=0"], "per_device_eval_batch_size must be >= 1"),
    (["max_physical_batch_size=-4"], "max_physical_batch_size must be >= 1"),
    (["warmup_steps=-1"], "warmup_steps must be in [0, "),
    (["logging_steps=0"], "logging_steps must be >= 1"),
    (["eval_steps=0"], "eval_steps must be >= 1"),
    (["save_steps=-5"], "save_steps must be >= 1"),
    (["save_total_limit=0"], "save_total_limit must be >= 1"),
    (["ddp_timeout=0"], "ddp_timeout must be >= 1"),
    (["dataloader_num_workers=-1"], "dataloader_num_workers must be >= 0"),
    (["dataloader_num_workers=1", "dataloader_prefetch_factor=0"], "dataloader_prefetch_factor must be >= 1"),
    (["dataloader_prefetch_factor=2"], "need dataloader_num_workers > 0"),
    (["dataloader_persistent_workers=true"], "need dataloader_num_workers > 0"),
    (["privacy.target_epsilon=nan"], "privacy.target_epsilon must be a finite number > 0, got nan"),
    (["privacy.target_epsilon=inf"], "privacy.target_epsilon must be a finite number > 0, got inf"),
    (["privacy.target_epsilon=-1"], "privacy.target_epsilon must be > 0"),
    (["privacy.target_epsilon=0"], "privacy.target_epsilon must be > 0"),
    (["privacy.target_delta=0"], "privacy.target_delta must be in (0, 1)"),
    (["privacy.target_delta=1"], "privacy.target_delta must be in (0, 1)"),
    (["privacy.target_delta=nan"], "privacy.target_delta must be a finite number in (0, 1)"),
    (["privacy.noise_multiplier=-1"], "privacy.noise_multiplier must be >= 0"),
    (["privacy.noise_multiplier=inf"], "privacy.noise_multiplier must be a finite number >= 0"),
    (["privacy.noise_multiplier=nan"], "privacy.noise_multiplier must be a finite number >= 0"),
    (["privacy.max_grad_norm=0"], "privacy.max_grad_norm must be > 0"),
    (["privacy.max_grad_norm=inf"], "privacy.max_grad_norm must be a finite number > 0"),
    (["privacy.secure_seed=-1"], "privacy.secure_seed must be in [0, "),
    (["launcher.nprocs=0"], "launcher.nprocs must be >= 1"),
    (["launcher.nodes=0"], "launcher.nodes must be >= 1"),
    (["launcher.gpus_per_node=-1"], "launcher.gpus_per_node must be >= 0"),
    (["launcher.tasks_per_node=0"], "launcher.tasks_per_node must be >= 1"),
    (["launcher.cpus_per_task=0"], "launcher.cpus_per_task must be >= 1"),
    (["launcher.mem_gb=nan"], "launcher.mem_gb must be a finite number > 0"),
    (["launcher.timeout_min=0"], "launcher.timeout_min must be >= 1"),
    (["launcher.max_num_timeout=-1"], "launcher.max_num_timeout must be >= 0"),
    (["audit.canaries=0"], "audit.canaries must be >= 1"),
    (["audit.significance=1"], "audit.significance must be in (0, 1)"),
    (["sweep.poisson_mean=inf"], "sweep.poisson_mean must be a finite number >= 0, got inf"),
    (["sweep.poisson_mean=0.5"], "sweep.poisson_mean must be >= 1, got 0.5: Papernot & Steinke"),
    (["sweep.poisson_mean=0"], "sweep.poisson_mean must be >= 1, got 0"),
    (["sweep.poisson_mean=-2"], "sweep.poisson_mean must be >= 1, got -2"),
    (["sweep.tnb_eta=-1"], "sweep.tnb_eta must be > -1"),
    (["sweep.tnb_gamma=1"], "sweep.tnb_gamma must be in (0, 1)"),
    (["fp16_loss_scale=65536"], "fp16_loss_scale must be in (0, 32768]"),
    (["tracking.flush_timeout=nan"], "tracking.flush_timeout must be a finite number >= 0, got nan"),
    (["tracking.flush_timeout=inf"], "tracking.flush_timeout must be a finite number >= 0, got inf"),
    (["tracking.flush_timeout=-1"], "tracking.flush_timeout must be >= 0, got -1"),
    # Names, refused knobs, cross-field rules, interpolations.
    (["lr_scheduler_type=exotic"], "lr_scheduler_type='exotic' is unknown"),
    (["ddp_shard=diagonal"], "ddp_shard='diagonal' is unknown"),
    (["privacy.accountant=moments"], "privacy.accountant='moments' is unknown"),
    (["privacy.grad_sample_mode=magic"], "privacy.grad_sample_mode='magic' is unknown"),
    (["launcher.name=k8s"], "launcher.name='k8s' is unknown"),
    (["split_batches=true"], "split_batches is refused"),
    (["even_batches=false"], "even_batches is refused"),
    (["privacy.target_epsilon=null"], "privacy needs privacy.noise_multiplier or privacy.target_epsilon"),
    (["max_steps=-1", "num_train_epochs=0"], "set max_steps > 0 or num_train_epochs > 0"),
    (["tracking.uri=${oc.env:WB_NO_SUCH_VARIABLE}"], "Environment variable 'WB_NO_SUCH_VARIABLE' not found"),
    (["tracking.run_name=${no_such_key}"], "tracking.run_name: cannot resolve"),
    (["-m", "seed=1,-1"], "seed must be in [0, 4294967295], got -1"),
    (["-m", "privacy.target_epsilon=1,nan", "seed=0,1"], "privacy.target_epsilon must be a finite number > 0, got nan"),
    (["--cfg", "job", "foo=1"], "unknown key 'foo'"),
    # Found by the job's pre-run checks (data, model, criterion, privacy), before its MLflow run.
    (["data.train.in_features=32"], "data.train (workbench.data.Synthetic): example 0 does not fit the model"),
    (["data.eval.in_features=32"], "data.eval (workbench.data.Synthetic): example 0 does not fit the model"),
    (["data.train.num_classes=12"], "outside the model's 10 classes (0..9)"),
    (["data.eval.num_classes=12"], "data.eval (workbench.data.Synthetic): example"),
    (["criterion._target_=torch.nn.MSELoss"], "example 0 does not fit the criterion MSELoss"),
    ([FLAWED, "+data.train.flaw=nan_input", "+data.train.at=5"], "example 5 has a non-finite input value (nan)"),
    ([FLAWED, "+data.train.flaw=inf_input", "+data.train.at=700"], "example 700 has a non-finite input value (inf)"),
    ([FLAWED, "+data.train.flaw=negative_label", "+data.train.at=33"], "example 33 has label -3, outside"),
    ([FLAWED, "+data.train.flaw=float_labels"], "labels are float32"),
    (["data.train.size=0"], "the training dataset is empty"),
    (["max_steps=-1", "num_train_epochs=1e12"], "steps, more than 1000000000; lower it or set max_steps"),
    (["data.train._target_=no.such.Dataset"], "could not build data.train"),
    (["data=cifar10", "data.root=/no/such/folder"],
     "could not build data.train: CIFAR-10 not found: /no/such/folder/cifar-10-batches-py/data_batch_1 is missing"),
    (["optimizer._target_=torch.optim.Nope"], "could not build optimizer"),
    (["per_device_train_batch_size=5000"], "larger than the training set"),
    (["privacy.noise_multiplier=0"], "gives no privacy"),
    (["privacy.target_epsilon=1e-6"], "unreachable"),
    (["compute_metrics=os.path.nosuch"], "not an importable function"),
    (["model._target_=builtins.dict"], "not a torch.nn.Module"),
    (["model._target_=tests.plugins.lone_groupnorm_mlp"],
     "model.1: GroupNorm(32, 32, eps=1e-05, affine=True, bias=True) normalises each value of its input (8, 32) alone"),
    (["backend=nccl"], "ddp_backend=nccl"),
    (["experiment=lm_lora", "~peft"], "peft names no _target_ to build (it holds only target_modules); set "
                                      "peft._target_, or remove it with its keys (~peft.target_modules)"),
]


def _assert_nothing_left(tmp_path):
    """No folder in the working dir, and no run in the store (if anything created it at all)."""
    left = {p.name for p in tmp_path.iterdir()}  # an empty mlflow.db too: a refused command creates nothing
    assert not left, left
    if (tmp_path / "mlflow.db").exists():
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_the_table_covers_at_least_80_kinds():
    assert len({" ".join(args) for args, _ in KINDS}) == len(KINDS) >= 80


@pytest.mark.parametrize("args, message", KINDS, ids=[" ".join(a)[:60] for a, _ in KINDS])
def test_bad_input_is_one_line_before_any_run_or_folder(tmp_path, args, message):
    from workbench.__main__ import check_args, launch_or_clean_up
    from workbench.errors import WorkbenchError

    setup = [f"output_dir={tmp_path / 'run' / 'nested'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
             "disable_tqdm=true", "experiment=quick"]
    with pytest.raises(WorkbenchError) as err:
        for cfg in check_args([*setup, *args]):  # the CLI's check before Hydra's app, then its job
            launch_or_clean_up(cfg)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    _assert_nothing_left(tmp_path)


# Through the real CLI (each call costs seconds): refusals before Hydra's app and one from inside the job.
@pytest.mark.parametrize("args, message", [
    (["foo=1"], "unknown key 'foo'"),
    (["shard=bogus"], "shard=bogus is unknown; choose one of global, per_rank"),
    (["seed=abc"], "wrong type for seed"),
    (["+privacy.epsilon=3"], "did you mean privacy.target_epsilon?"),
    (["learning_rate=nan"], "learning_rate must be a finite number > 0, got nan"),
    (["tracking.uri=${oc.env:WB_NO_SUCH_VARIABLE}"], "Environment variable 'WB_NO_SUCH_VARIABLE' not found"),
    (["-m", "seed=1,99999999999999999999999"], "seed must be in [0, 4294967295]"),
    (["experiment=quick", "data.train.in_features=32"], "example 0 does not fit the model"),
    (["-m", "sweep.tuning=random_stopping", "sweep.trials=poisson", "sweep.poisson_mean=0.5", "seed=0,1"],
     "sweep.poisson_mean must be >= 1, got 0.5"),
])
def test_cli_refuses_in_one_line_with_exit_2_and_leaves_nothing(tmp_path, args, message):
    proc = run_cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr[-2000:]
    _assert_nothing_left(tmp_path)


def test_a_refusal_never_removes_the_working_dir_or_a_folder_that_existed(tmp_path, monkeypatch):
    """Ranks > 0 under torchrun run with hydra.run.dir=. (the working dir as Hydra's folder); an output_dir given by
    the user may exist already, empty: a refusal removes neither."""
    from workbench.__main__ import check_args, launch_or_clean_up
    from workbench.errors import WorkbenchError

    existing = tmp_path / "mine"
    existing.mkdir()
    (cfg,) = check_args([f"output_dir={existing}", "experiment=quick", "data.train.in_features=32"])
    with pytest.raises(WorkbenchError):
        launch_or_clean_up(cfg, hydra_dir=tmp_path)
    assert tmp_path.is_dir() and existing.is_dir()
