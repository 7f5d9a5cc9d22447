"""Refusals of combinations that no run supports come before any work (issue 42): from the config alone, in the CLI's
up-front check (workbench/job.py's refuse_unsupported, asked before Hydra's app makes a folder and before any data is
read); what needs the data (b B / N) as soon as the shard is known, before any line, model or data check. One line,
exit 2, nothing left; under torchrun one rank says it. And a value the user typed in a free-form node is passed to a
replaced ``_target_`` even where it equals the replaced option's default (README: arguments "you set or add are")."""

import pytest

from tests.conftest import run_cli
from workbench.errors import WorkbenchError

# Combinations the config alone decides: check_args (the CLI before Hydra's app) refuses them.
UP_FRONT = [
    (["optimizer=dp_adamw", "privacy.mechanism=bandmf"], "privacy.mechanism=bandmf's noise is correlated"),
    (["optimizer=dp_adamw", "privacy.mechanism=blt"], "privacy.mechanism=blt's noise is correlated"),
    (["optimizer=dp_adamw", "privacy=none"], "corrects for the DP noise and needs privacy"),
    (["optimizer=dp_adamw", "+optimizer.noise_std=0.1"], "optimizer.noise_std is set from the run's mechanism"),
    (["optimizer._target_=torch.optim.Nope"], "could not build optimizer"),
    (["privacy.noise_multiplier=0"], "privacy.noise_multiplier=0 gives no privacy"),
    (["fp16=true"], "fp16=true needs CUDA (this job runs on cpu)"),
    (["backend=nccl"], "ddp_backend=nccl needs"),
    (["privacy.grad_sample_mode=ew", "bf16=true"], "grad_sample_mode=ew cannot run in mixed precision"),
    (["privacy.accountant=rdp", "shard=global", "launcher=local", "launcher.nprocs=2"],
     "accountant 'rdp' does not support shard=global (parallel Poisson) with world_size=2"),
]
USERS_BANDS = ["experiment=users", "privacy.mechanism=bandmf", "privacy.num_bands=20"]
BANDS_MESSAGE = "privacy.num_bands=20 makes the in-band sampling rate b B / N = 1.28 > 1"


@pytest.mark.parametrize("args, message", UP_FRONT, ids=["-".join(a) for a, _ in UP_FRONT])
def test_a_combination_the_config_decides_is_refused_by_the_up_front_check(args, message):
    """check_args is what the CLI runs before Hydra's app: no folder, no store, no dataset exists yet."""
    from workbench.__main__ import check_args

    if args == ["fp16=true"]:
        import torch

        if torch.cuda.is_available():  # fp16 runs on this machine's CUDA: the check lets it through
            assert len(check_args(args)) == 1
            return
    with pytest.raises(WorkbenchError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        check_args(args)
    assert "\n" not in str(e.value)


def test_the_same_combinations_run_once_they_are_supported():
    """Not a check that refuses everything: the neighbours of the refused combinations pass it."""
    from workbench.__main__ import check_args

    for args in (["optimizer=dp_adamw"], ["privacy.mechanism=bandmf"], ["optimizer=dp_adamw", "privacy.clipping=adaptive"],
                 ["bf16=true"], ["privacy.grad_sample_mode=hooks", "bf16=true"], ["backend=gloo"], USERS_BANDS[:2],
                 ["privacy.accountant=rdp", "shard=global"]):  # one process: no parallel Poisson
        assert len(check_args(args)) == 1, args
    # Hydra's SLURM launcher runs the job on a node: its device and backend are asked there, not here
    for args in (["fp16=true"], ["backend=nccl"]):
        assert len(check_args(["-m", "hydra/launcher=submitit_slurm", *args])) == 1, args
    with pytest.raises(WorkbenchError, match="ddp_backend=nccl needs"):  # Hydra's local one runs it here
        check_args(["-m", "hydra/launcher=submitit_local", "backend=nccl"])


def _assert_nothing_left(tmp_path):
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused command left files"


@pytest.mark.parametrize("args, message", [UP_FRONT[0], UP_FRONT[1], (USERS_BANDS, BANDS_MESSAGE)],
                         ids=["dp_adamw-bandmf", "dp_adamw-blt", "users-bandmf-20-bands"])
def test_the_listed_commands_give_one_line_and_exit_2_and_leave_nothing(tmp_path, args, message):
    proc = run_cli(*args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""  # no data check's line, no mode note, no calibration note before it
    _assert_nothing_left(tmp_path)  # no mlflow.db, no outputs/


def test_too_many_bands_for_the_users_is_refused_before_the_model_is_built(make_cfg, monkeypatch):
    """b B / N needs N (the users): refused as soon as the shard is known, before the model, the data check and
    the calibration (the model is never built)."""
    from workbench import job, train

    def no_model(cfg):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(job, "build_model", no_model)
    with pytest.raises(WorkbenchError, match=BANDS_MESSAGE.replace("(", r"\(")):
        train(make_cfg(*USERS_BANDS, "tracking.enabled=false"))


def test_a_rank_above_0_refuses_in_silence_and_says_it_only_when_rank_0_did_not(monkeypatch, capsys):
    from workbench import __main__ as cli
    from workbench.errors import TrainingStopped

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for rank, expect in (("0", "error: no\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            cli.refuse(WorkbenchError("no"), alike=True)
        assert e.value.code == 2 and capsys.readouterr().err == expect
    # A refusal rank 0 was not found to make alike (this rank's own data), or a stop: this rank says it, named.
    alike_in_job = WorkbenchError("no")
    alike_in_job.alike = True
    for error, code, expect in ((WorkbenchError("no"), 2, "error: rank 1: no\n"), (alike_in_job, 2, ""),
                                (TrainingStopped("stopped"), 1, "error: rank 1: stopped\n")):
        with pytest.raises(SystemExit) as e:
            cli.refuse(error)
        assert e.value.code == code and capsys.readouterr().err == expect
    # Under torchrun, a rank > 0 waits for torchrun to stop it (rank 0 refused alike and said why); if it is still
    # running afterwards, rank 0 did not refuse, and this rank says why itself.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setattr(cli, "PEER_REFUSAL_WAIT_S", 0.0)
    with pytest.raises(SystemExit) as e:
        cli.refuse(WorkbenchError("no"), alike=True)
    assert e.value.code == 2 and capsys.readouterr().err == "error: rank 1: no\n"


def test_rank_0_tells_its_refusal_and_a_peer_stays_quiet_only_on_the_same_line():
    """Peers.refused_alike on a real TCPStore, two runs apart in one store (as in one torchrun job): rank 0's
    refusal is read by rank 1 under this run's key alone; another line, or another run's, is not alike."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from workbench import interrupt

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    old_wait = interrupt.REFUSAL_WAIT
    interrupt.REFUSAL_WAIT = 0.5
    try:
        first = [interrupt.join(s, 2, rank, "run-a") for rank, s in ((0, server), (1, client))]
        assert first[0].refused_alike(WorkbenchError("b B / N > 1"))
        assert first[1].refused_alike(WorkbenchError("b B / N > 1"))
        assert not first[1].refused_alike(WorkbenchError("example 1048 has label 12"))
        first[1].count("failed")
        assert first[0].read("failed") == 1
        second = interrupt.join(client, 2, 1, "run-b")  # the job's next run: rank 0 has not refused in it
        assert not second.refused_alike(WorkbenchError("b B / N > 1"))
        assert second.read("failed") == 0 and second.read("signalled") == 0
    finally:
        interrupt.REFUSAL_WAIT = old_wait


def _torchrun(tmp_path, module, *args):
    return run_cli("--standalone", "--nproc-per-node=2", "-m", "workbench", "backend=gloo", *args, cwd=tmp_path,
                   timeout=300, module=("-m", module))


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [(["optimizer=dp_adamw", "privacy.mechanism=bandmf"], UP_FRONT[0][1]),
                                           (USERS_BANDS, "privacy.num_bands=20 makes the in-band sampling rate")],
                         ids=["up-front", "in-job"])
def test_under_torchrun_one_rank_says_it_and_the_job_exits_2(tmp_path, args, message):
    """Two gloo ranks under real torchrun. python -m workbench.torchrun (torchrun's own parse_args and agent): the one
    line and exit 2. Stock torchrun: the same one line from the ranks, then its own ChildFailedError report naming
    rank 0's exit code 2 as the root cause, and exit 1: torchrun raises that error whenever a worker exits non-zero,
    and exits 0 only when every worker did (measured: every worker exiting 2 cleanly still gives torchrun's exit 1)."""
    ours = _torchrun(tmp_path, "workbench.torchrun", *args)
    assert ours.returncode == 2, ours.stderr[-3000:]
    assert ours.stderr.splitlines() == [ours.stderr.strip()] and ours.stderr.startswith("error: ") \
        and message in ours.stderr, ours.stderr
    _assert_nothing_left(tmp_path)
    stock = _torchrun(tmp_path, "torch.distributed.run", *args)
    assert stock.returncode == 1, stock.stderr[-3000:]
    errors = [line for line in stock.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], stock.stderr
    root_cause = stock.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and "exitcode  : 2" in root_cause, stock.stderr
    _assert_nothing_left(tmp_path)


# --- values the user typed in a free-form node ----------------------------------------------------------------------

# (the option chosen, the node, a key of the option and its value there, another key of the option left untouched)
NODES = [
    ("model=mlp", "model", "in_features", "64", "hidden"),
    ("data=digits", "data.train", "split", "train", None),
    ("data=digits", "data.eval", "split", "eval", None),
    ("data=synthetic", "data.train", "in_features", "64", "size"),
    ("data=synthetic", "data.eval", "in_features", "64", "size"),
    ("data=hf_text", "data.collator", "pad_token_id", "0", None),
    ("optimizer=sgd", "optimizer", "momentum", "0.5", None),
    ("optimizer=dp_adamw", "optimizer", "eps", "1.0e-08", "gamma"),
]


@pytest.mark.parametrize("choice, path, key, value, untouched", NODES, ids=[f"{c}-{p}.{k}" for c, p, k, _, _ in NODES])
def test_a_typed_value_equal_to_the_replaced_options_default_is_passed(choice, path, key, value, untouched):
    from omegaconf import OmegaConf

    from workbench import compose, config, overrides

    option = OmegaConf.select(compose([choice]), path)
    assert str(option[key]) == value or option[key] == float(value), "the typed value must be the option's default"
    typed = [choice, f"{path}._target_=collections.OrderedDict", f"{path}.{key}={value}", f"+{path}.extra=1"]
    own = overrides.own_arguments(compose(typed), path)
    assert own["_target_"] == "collections.OrderedDict"
    assert key in own and own[key] == option[key], own  # typed, though equal to the option's value: kept
    assert own["extra"] == 1  # added: kept
    if untouched is not None:  # the option's other arguments, not typed: still dropped
        assert untouched not in own, own
    assert own.get("_partial_") == option.get("_partial_")  # how to build it is Hydra's, never an argument
    # The same node without the typed value: the option's default is dropped, as before.
    assert key not in overrides.own_arguments(compose([choice, f"{path}._target_=collections.OrderedDict"]), path)


def test_a_value_typed_inside_a_dict_argument_keeps_the_whole_argument():
    """model.config.vocab_size=64 (equal to tiny_bert's) types inside `config`: the replaced class gets config whole,
    as typed; num_labels, not typed, is dropped."""
    from workbench import compose, config, overrides

    for typed in (["model.config.vocab_size=64"], ["model.config={model_type: bert, vocab_size: 64}"]):
        own = overrides.own_arguments(compose(["model=tiny_bert", "model._target_=builtins.dict", *typed]), "model")
        assert own["config"]["vocab_size"] == 64 and "num_labels" not in own, own


def test_an_option_whose_arguments_are_interpolations_can_have_its_target_replaced():
    """cifar10's data.train.root is ${data.root}: read in its option file alone it cannot be resolved. Still the
    option's value, it is dropped for another class; typed (or typed as the same interpolation), it is passed."""
    from workbench import compose, overrides

    common = ["data=cifar10", "data.root=/tmp/cifar", "data.train._target_=collections.OrderedDict"]
    assert dict(overrides.own_arguments(compose(common), "data.train")) == {"_target_": "collections.OrderedDict"}
    for typed in ("data.train.root=/tmp/cifar", "data.train.root=${data.root}"):
        assert overrides.own_arguments(compose([*common, typed]), "data.train")["root"] == "/tmp/cifar"


def test_set_keys_reads_each_override_as_hydra_parses_it():
    from workbench.overrides import set_keys

    assert set_keys(["model._target_=torch.nn.Linear", "+model.out_features=10", "++model.in_features=64",
                     "~model.hidden", "model=mlp", "data.train={size: 3, opts: {a: 1}}", "seed=3",
                     "tracking.tags.x=1", "optimizer.momentum=0.5"]) == [
        "model._target_", "model.out_features", "model.in_features", "data.train.size", "data.train.opts.a",
        "optimizer.momentum"]


def test_the_issues_command_builds_the_replaced_class_with_the_typed_arguments(tmp_path):
    """python -m workbench model._target_=torch.nn.Linear model.in_features=64 +model.out_features=10: 64 is mlp's
    own in_features, typed by the user, so torch.nn.Linear gets it (it failed with "missing 1 required positional
    argument: 'in_features'")."""
    proc = run_cli("model._target_=torch.nn.Linear", "model.in_features=64", "+model.out_features=10", "max_steps=2",
                   "tracking=off", f"output_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_launched_job_keeps_the_typed_keys_without_hydra():
    """The submitted config carries the typed keys (a SLURM job has no HydraConfig): they survive the YAML."""
    from omegaconf import OmegaConf

    from workbench import compose, config, overrides

    cfg = compose(["model._target_=torch.nn.Linear", "model.in_features=64", "+model.out_features=10"])
    again = OmegaConf.create(OmegaConf.to_yaml(cfg))
    assert dict(overrides.own_arguments(again, "model")) == {"_target_": "torch.nn.Linear", "in_features": 64,
                                                           "out_features": 10}

