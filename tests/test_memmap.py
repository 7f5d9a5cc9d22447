"""Data that does not fit in memory (issue 44): a memory-mapped token file of 1e8 rows trains reading only the rows
each step drew, the pre-run checks read a bounded number of rows, and memory does not grow with N.

The files are sparse: ``np.memmap(mode="w+")`` of zeros costs no disk until written, so 1e8 rows of 8 uint16 ids
(1.6 GB as far as the file's size goes) take a few pages here."""

import pickle
import tracemalloc

import dp_accounting
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.data import ArrayDataset, TokenMemmap, check_fit
from workbench.data.checks import SCAN
from workbench.errors import WorkbenchError
from workbench.privacy import DEFAULT_PLD_DISCRETIZATION, sampling

SEQ, VOCAB, BATCH, STEPS, SECRET = 8, 16, 32, 3, 918273645
MAX_READ = 4096  # a read of more rows at once than any batch here: a check or loader reading the whole file


def _token_file(path, rows: int, seed: int = 0):
    """A sparse file of ``rows`` rows of SEQ uint16 ids: zeros, with its first 64 rows and its last written."""
    m = np.memmap(path, dtype=np.uint16, mode="w+", shape=(rows, SEQ))
    rng = np.random.default_rng(seed)
    m[:64] = rng.integers(0, VOCAB, (64, SEQ))
    m[-1] = rng.integers(0, VOCAB, SEQ)
    m.flush()
    del m
    return str(path)


def _overrides(tmp_path, rows: int, *more: str) -> list[str]:
    return ["experiment=gpt", "data=token_memmap", f"data.path={_token_file(tmp_path / 'train.bin', rows)}",
            f"data.eval_path={_token_file(tmp_path / 'eval.bin', 200, seed=1)}", f"data.seq_len={SEQ}",
            "data.eval_rows=64", f"model.vocab={VOCAB}", f"model.max_len={SEQ}", "model.d_model=16", "model.heads=2",
            "model.layers=1", f"per_device_train_batch_size={BATCH}", f"max_steps={STEPS}",
            "privacy.noise_multiplier=1.0", "privacy.target_epsilon=null", "disable_tqdm=true", *more]


def _train(tmp_path, rows: int, monkeypatch, *more: str) -> tuple[list[tuple[str, list[int]]], int]:
    """Train a few steps on a ``rows``-row file: every read of a TokenMemmap, in order, as (path, rows asked for), and
    the sampling stream's seed."""
    from workbench import compose
    from workbench.run import train

    reads = []
    read = TokenMemmap.__getitems__

    def counted(self, indices):
        indices = [int(i) for i in indices]
        if len(indices) > MAX_READ:  # fail at once, not after reading 1e8 rows
            raise AssertionError(f"{len(indices)} rows of {len(self)} read at once from {self.path}")
        reads.append((self.path, indices))
        return read(self, indices)

    monkeypatch.setattr(TokenMemmap, "__getitems__", counted)
    monkeypatch.setattr(TokenMemmap, "__getitem__", lambda self, i: pytest.fail("a row read alone, not by its batch"))
    cfg = compose([*_overrides(tmp_path, rows, *more), f"output_dir={tmp_path / f'run-{rows}'}",
                   "tracking.enabled=false", f"privacy.secure_seed={SECRET}"])
    train(cfg)
    return reads, sampling.stream_seed(SECRET, cfg.data_seed if cfg.data_seed is not None else cfg.seed)


def test_token_memmap_reads_its_rows_and_refuses_a_bad_file_in_one_line(tmp_path):
    path = _token_file(tmp_path / "t.bin", 100)
    want = np.asarray(np.memmap(path, dtype=np.uint16, mode="r", shape=(100, SEQ)))
    ds = TokenMemmap(path, SEQ)
    assert len(ds) == 100
    x, y = ds.__getitems__([99, 3, 0])
    assert x.dtype == torch.long and x is y and torch.equal(x, torch.from_numpy(want[[99, 3, 0]].astype(np.int64)))
    assert torch.equal(ds[63][0], torch.from_numpy(want[63].astype(np.int64)))
    tail = TokenMemmap(path, SEQ, start=90, max_rows=50)  # a bounded slice: rows 90..99
    assert len(tail) == 10 and torch.equal(tail.__getitems__([9])[0][0], ds[99][0])
    assert len(TokenMemmap(path, SEQ, max_rows=5)) == 5
    with pytest.raises(IndexError):
        ds.__getitems__([100])
    with pytest.raises(IndexError):
        ds.__getitems__([-1])  # numpy would read the last row
    ds.__getitems__([0])
    assert pickle.loads(pickle.dumps(ds))._map is None  # a DataLoader worker maps the file itself, not a copy of it
    (tmp_path / "odd.bin").write_bytes(b"\0" * (SEQ * 2 * 3 + 1))
    for args, message in [(("/no/such.bin", SEQ), "path='/no/such.bin' is not a file"),
                          ((str(tmp_path / "odd.bin"), SEQ), "holds 49 bytes, not a whole number of rows of seq_len=8 "
                                                             "uint16 ids (16 bytes each)"),
                          ((path, SEQ, "float32"), "dtype='float32' is not a token id type"),
                          ((path, 1), "seq_len must be an int >= 2"),
                          ((path, SEQ, "uint16", 100), "select no row of the 100")]:
        with pytest.raises(WorkbenchError) as err:
            TokenMemmap(*args)
        assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["data.path=/no/such.bin"], "could not build data.train: TokenMemmap path='/no/such.bin' is not a file"),
    (["data.seq_len=7"], "holds 1600 bytes, not a whole number of rows of seq_len=7 uint16 ids (14 bytes each)"),
])
def test_a_bad_token_file_is_refused_in_one_line_before_any_run_or_folder(tmp_path, args, message):
    from tests.test_bad_input import _assert_nothing_left
    from workbench.__main__ import check_args, launch_or_clean_up

    data = tmp_path.parent / f"{tmp_path.name}-data"  # outside the working dir, which must stay empty
    data.mkdir()
    setup = [*_overrides(data, 100), f"output_dir={tmp_path / 'run'}",
             f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    with pytest.raises(WorkbenchError) as err:
        for cfg in check_args([*setup, *args]):
            launch_or_clean_up(cfg)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    _assert_nothing_left(tmp_path)


def test_the_cli_refuses_a_token_file_of_part_rows_with_exit_2_and_leaves_nothing(tmp_path):
    from tests.test_bad_input import _assert_nothing_left

    data = tmp_path.parent / f"{tmp_path.name}-data"
    data.mkdir()
    proc = run_cli(*_overrides(data, 100), "data.seq_len=7", cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: could not build data.train: "
                                                                            "TokenMemmap "), proc.stderr[-2000:]
    assert "not a whole number of rows of seq_len=7" in lines[0]
    _assert_nothing_left(tmp_path)


@pytest.mark.parametrize("rows", [10**6, 10**8])
def test_a_memmap_trains_reading_only_the_rows_each_step_drew(tmp_path, monkeypatch, rows):
    from workbench.data.checks import FIRST
    from workbench.step import CHECK_EXAMPLES

    reads, seed = _train(tmp_path, rows, monkeypatch)
    train_path = str(tmp_path / "train.bin")
    ours = [indices for path, indices in reads if path == train_path]
    evaluated = [indices for path, indices in reads if path != train_path]
    # The steps' batches, drawn again from the run's secret stream: the loader read exactly these rows, once each.
    shard = sampling.train_shard(rows, 0, 1, "per_rank", BATCH)
    drawn = sampling.PoissonBatchSampler(shard, STEPS, seed, 0)
    batches = [drawn.indices_for_step(t) for t in range(STEPS)]
    assert 0 < sum(map(len, batches)) < 4 * STEPS * BATCH
    assert ours[-STEPS:] == batches
    # Before them, the pre-run checks: the first FIRST rows (data check), the first CHECK_EXAMPLES (clipping check).
    assert ours[:-STEPS] == [list(range(FIRST)), list(range(CHECK_EXAMPLES))]
    assert sum(map(len, evaluated)) == FIRST + 64  # the eval file: its data check, then its first eval_rows rows


def test_peak_memory_of_the_build_and_steps_does_not_grow_with_n(tmp_path, monkeypatch):
    """tracemalloc's peak over building the job and a few steps at N = 1e6 and 1e8 rows: anything O(N) at 1e8 (a mask,
    an index list, a scan of the rows) would be >= 100 MB, 100x its size at 1e6."""
    peaks = {}
    for rows in (10**4, 10**6, 10**8):  # the first untraced: what the first run imports and caches
        (tmp_path / str(rows)).mkdir()
        if rows == 10**4:
            _train(tmp_path / str(rows), rows, monkeypatch)
            continue
        tracemalloc.start()
        try:
            _train(tmp_path / str(rows), rows, monkeypatch)
            peaks[rows] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[10**8] < peaks[10**6] + 8 * 2**20, {n: f"{p / 2**20:.1f} MiB" for n, p in peaks.items()}


def test_the_in_memory_scan_reads_the_first_scan_rows_only():
    """An in-memory tensor dataset is scanned for non-finite values and labels up to SCAN rows (bounded memory
    whatever N); a bad row past them is named when its step fails (blame_example), not before the run."""
    from torch import nn

    model, criterion = nn.Linear(1, 2), nn.CrossEntropyLoss(reduction="none")
    for at, refused in [(SCAN - 1, True), (SCAN, False)]:
        x, y = torch.zeros(SCAN + 1, 1), torch.zeros(SCAN + 1, dtype=torch.long)
        x[at] = float("nan")
        if refused:
            with pytest.raises(WorkbenchError, match=f"example {at} has a non-finite input value"):
                check_fit(ArrayDataset(x, y), "data.train", model, criterion, torch.device("cpu"))
        else:
            check_fit(ArrayDataset(x, y), "data.train", model, criterion, torch.device("cpu"))


def _direct_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=DEFAULT_PLD_DISCRETIZATION)
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


@pytest.mark.slow
def test_torchrun_trains_a_1e8_row_memmap_and_reports_dp_accountings_epsilon(tmp_path):
    rows = 10**8
    proc = run_cli("--nproc-per-node=2", "-m", "workbench", "backend=gloo", *_overrides(tmp_path, rows),
                   cwd=tmp_path, timeout=600, module=("-m", "torch.distributed.run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("workbench").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    m = runs[0].data.metrics
    assert m["world_size"] == 2 and int(m["steps"]) == STEPS
    assert m["sample_rate"] == pytest.approx(2 * BATCH / rows)  # per_rank: B / (N / W), N public from the file's size
    assert m["epsilon"] == pytest.approx(_direct_epsilon(2 * BATCH / rows, 1.0, STEPS, m["delta"]), rel=1e-6)
    assert np.isfinite(m["eval_loss"])
