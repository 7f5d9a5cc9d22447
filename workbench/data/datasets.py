"""The datasets: in-memory tensors handed back a whole index list at once (:class:`ArrayDataset`), scikit-learn's
digits with a fixed stratified split, synthetic blobs, images and token sequences, the real CIFAR-10 read by an
unpickler that accepts arrays and lists only, and token ids in a memory-mapped file of any length. Any map-style
``Dataset`` plugs in by config (``data.train._target_``)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from workbench.errors import WorkbenchError


class ArrayDataset(TensorDataset):
    """A TensorDataset that hands a whole index list back at once (no per-item Python loop in the DataLoader)."""

    def __getitems__(self, indices: Sequence[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(t[index] for t in self.tensors)


class Digits(ArrayDataset):
    """scikit-learn's 8x8 digits, flattened to 64 features in [0, 1]; a fixed stratified split."""

    def __init__(self, split: str = "train", test_size: float = 0.2, split_seed: int = 0):
        if split not in ("train", "eval"):
            raise WorkbenchError(f"Digits split must be 'train' or 'eval', got {split!r}")
        # the file load_digits reads, read without importing scikit-learn (seconds); its split cached by its inputs
        import gzip
        import importlib.util

        from workbench import cache

        sklearn_dir = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
        with gzip.open(sklearn_dir / "datasets" / "data" / "digits.csv.gz") as f:
            raw = np.loadtxt(f, delimiter=",")
        x, y = raw[:, :-1], raw[:, -1].astype(int)
        train, evaluation = cache.cached("digits_split", lambda: _stratified_split(y, test_size, split_seed),
                                         test_size=test_size, split_seed=split_seed, labels=y.tolist(),
                                         code=cache.code_version(packages=("scikit-learn",)))
        rows = train if split == "train" else evaluation
        super().__init__(torch.tensor(x[rows] / 16.0, dtype=torch.float32), torch.tensor(y[rows], dtype=torch.long))


def _stratified_split(y, test_size: float, seed: int) -> list[list[int]]:
    """scikit-learn's stratified train_test_split of the row indices (train, eval)."""
    from sklearn.model_selection import train_test_split

    train, evaluation = train_test_split(list(range(len(y))), test_size=test_size, random_state=seed, stratify=y)
    return [train, evaluation]


class Synthetic(ArrayDataset):
    """Gaussian class blobs: learnable, deterministic, any size."""

    def __init__(self, size: int = 2048, in_features: int = 64, num_classes: int = 10, seed: int = 0, spread: float = 1.0):
        g = torch.Generator().manual_seed(1234)  # class centres shared by every split
        centres = torch.randn(num_classes, in_features, generator=g) * 2.0
        g.manual_seed(seed)
        y = torch.randint(0, num_classes, (size,), generator=g)
        x = centres[y] + spread * torch.randn(size, in_features, generator=g)
        super().__init__(x, y)


class SyntheticImages(ArrayDataset):
    """CIFAR-shaped images (3x32x32 in [0, 1], 10 classes) made on the fly: each class a colour-tinted sinusoidal grating
    of its own orientation and frequency, at a random phase per image, under Gaussian pixel noise. Learnable by a
    small CNN in seconds, deterministic, any size."""

    def __init__(self, size: int = 4096, num_classes: int = 10, seed: int = 0, noise: float = 0.3,
                 image_size: int = 32):
        g = torch.Generator().manual_seed(1234)  # class patterns shared by every split
        angle = torch.arange(num_classes) * torch.pi / num_classes * 3 % torch.pi  # neighbours' angles far apart
        frequency = 2 * torch.pi * (2 + torch.arange(num_classes) % 3) / image_size
        tint = 0.5 + torch.rand(num_classes, 3, 1, 1, generator=g)
        g.manual_seed(seed)
        y = torch.randint(0, num_classes, (size,), generator=g)
        phase = 2 * torch.pi * torch.rand(size, 1, 1, generator=g)
        r = torch.arange(image_size, dtype=torch.float32)
        along = torch.cos(angle[y])[:, None, None] * r[None, :, None] + torch.sin(angle[y])[:, None, None] * r[None, None, :]
        wave = torch.cos(frequency[y][:, None, None] * along + phase)  # (size, H, W)
        x = 0.5 + 0.25 * tint[y] * wave[:, None] + noise * torch.randn(size, 3, image_size, image_size, generator=g)
        super().__init__(x.clamp(0, 1), y)


class SyntheticTokens(ArrayDataset):
    """Token sequences for causal language modelling, made on the fly without a tokenizer: walks of ``length`` tokens
    on a fixed random Markov chain over ``vocab`` ids, each id followed by one of ``branches`` successors drawn
    uniformly (the chain is shared by every split). Examples are (ids, ids): the labels are the inputs, for
    ``workbench.losses.TokenCrossEntropy(shift=True)``. The best possible perplexity is ``branches``; uniform
    guessing's is ``vocab``."""

    def __init__(self, size: int = 4096, length: int = 32, vocab: int = 32, branches: int = 2, seed: int = 0):
        if not 1 <= branches <= vocab or length < 2:
            raise WorkbenchError(f"SyntheticTokens needs 1 <= branches <= vocab and length >= 2, got "
                                 f"branches={branches}, vocab={vocab}, length={length}")
        g = torch.Generator().manual_seed(1234)  # the chain shared by every split
        successors = torch.stack([torch.randperm(vocab, generator=g)[:branches] for _ in range(vocab)])
        g.manual_seed(seed)
        ids = torch.empty(size, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (size,), generator=g)
        choice = torch.randint(0, branches, (size, length), generator=g)
        for t in range(1, length):
            ids[:, t] = successors[ids[:, t - 1], choice[:, t]]
        super().__init__(ids, ids)


class SyntheticSequences(ArrayDataset):
    """Token sequences at any vocabulary size (the benchmark presets' 30k and 50k; SyntheticTokens' Markov chain costs
    vocab^2 to build): ids drawn uniformly. ``num_classes``: examples are (ids, class), the class read off the first
    token (ids[0] mod num_classes); None: (ids, ids), labels the inputs, for a causal language model."""

    def __init__(self, size: int = 1024, length: int = 256, vocab: int = 30522, num_classes: int | None = None,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (size, length), generator=g)
        super().__init__(ids, ids if num_classes is None else ids[:, 0] % num_classes)


class CIFAR10(ArrayDataset):
    """The real CIFAR-10 from its python-pickle folder, as ``torchvision.datasets.CIFAR10(root, train,
    download=False)`` reads it: ``root/cifar-10-batches-py/data_batch_1..5`` (train) or ``test_batch`` (eval), each a
    pickled dict with ``data`` (N x 3072 uint8, channel-major) and ``labels``. Images as 3x32x32 floats in [0, 1]."""

    FOLDER = "cifar-10-batches-py"

    def __init__(self, root: str, train: bool = True):
        folder = Path(root).expanduser() / self.FOLDER
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WorkbenchError(f"CIFAR-10 not found: {folder / missing[0]} is missing (extract the python version, "
                                 f"cifar-10-python.tar.gz, under {root}; nothing is downloaded)")
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as f:
                batch = _ArraysOnly(f, encoding="latin1").load()  # written by Python 2: latin1, as torchvision reads it
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch["labels"])
        x = torch.from_numpy(np.concatenate(images)).float() / 255
        super().__init__(x, torch.tensor(labels, dtype=torch.long))


class _ArraysOnly(pickle.Unpickler):
    """Unpickles dicts, lists and numpy arrays only: a downloaded file cannot run code when it is read."""

    def find_class(self, module: str, name: str):
        if (module.split(".")[0] == "numpy" and name in ("_reconstruct", "ndarray", "dtype", "_frombuffer", "scalar")
                or (module, name) == ("_codecs", "encode")):  # how Python 3 writes bytes at protocol 2
            return super().find_class(module, name)
        raise WorkbenchError(f"refusing to unpickle {module}.{name}: a CIFAR-10 batch holds only arrays and lists")


class TokenMemmap(Dataset):
    """Token ids in a flat binary file, read through a numpy memmap: rows of ``seq_len`` ids of ``dtype`` back to back
    (``np.memmap(path, dtype, mode="w+", shape=(rows, seq_len))`` writes one; nanoGPT's ``train.bin`` cut into rows).
    Its length is public and fixed, the file's size over the size of a row; only the rows a batch asks for are read
    (``__getitems__``: one fancy index into the map), so a file of 1e8+ rows trains in memory independent of its
    length. Examples are (ids, ids) as :class:`SyntheticTokens`' (``workbench.losses.TokenCrossEntropy(shift=True)``).
    ``start`` and ``max_rows``: rows [start, start + max_rows) only, e.g. a bounded eval slice."""

    DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", start: int = 0, max_rows: int | None = None):
        if dtype not in self.DTYPES:
            raise WorkbenchError(f"TokenMemmap dtype={dtype!r} is not a token id type; choose one of "
                                 f"{', '.join(self.DTYPES)}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise WorkbenchError(f"TokenMemmap seq_len must be an int >= 2 (the loss shifts by one), got {seq_len!r}")
        file = Path(str(path)).expanduser()
        if not file.is_file():
            raise WorkbenchError(f"TokenMemmap path={str(path)!r} is not a file (rows of seq_len token ids of dtype)")
        row_bytes = seq_len * np.dtype(dtype).itemsize
        size = file.stat().st_size
        if size == 0 or size % row_bytes:
            raise WorkbenchError(f"TokenMemmap {str(file)!r} holds {size} bytes, not a whole number of rows of "
                                 f"seq_len={seq_len} {dtype} ids ({row_bytes} bytes each); check seq_len and dtype")
        self.total = size // row_bytes
        if not 0 <= start < self.total or (max_rows is not None and max_rows < 1):
            raise WorkbenchError(f"TokenMemmap start={start}, max_rows={max_rows} select no row of the {self.total} "
                                 f"in {str(file)!r}")
        self.path, self.seq_len, self.dtype, self.start = str(file), seq_len, dtype, start
        self.rows = self.total - start if max_rows is None else min(max_rows, self.total - start)
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return self.rows

    def _read(self, index: np.ndarray) -> torch.Tensor:
        if index.size and (index.min() < 0 or index.max() >= self.rows):  # numpy would wrap a negative index
            raise IndexError(f"TokenMemmap index out of range [0, {self.rows})")
        if self._map is None:  # opened on first read, in each process (a worker unpickles it without the map)
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.total, self.seq_len))
        return torch.from_numpy(self._map[index + self.start].astype(np.int64))

    def __getitems__(self, indices: Sequence[int]):
        ids = self._read(np.asarray(indices, dtype=np.int64).reshape(-1))
        return ids, ids

    def __getitem__(self, i: int):
        ids = self._read(np.asarray([i], dtype=np.int64))[0]
        return ids, ids

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}
