"""The default job written as a user would with raw Opacus (its defaults: hooks, PRV accountant, make_private_with_epsilon):
digits, MLP 64-128-10, Poisson batches of expected size 256, 30 epochs, epsilon 8, SGD lr 1.5 momentum 0.5, test
accuracy at the end. ``benchmarks.end_to_end`` times it as a whole process beside ``python -m workbench``.
"""

import sys
import warnings

import torch
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 30  # benchmarks --quick runs fewer
torch.manual_seed(42)
x, y = load_digits(return_X_y=True)
x_tr, x_ev, y_tr, y_ev = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
train = TensorDataset(torch.tensor(x_tr, dtype=torch.float32), torch.tensor(y_tr))
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=1.5, momentum=0.5)
engine = PrivacyEngine()
model, optimizer, loader = engine.make_private_with_epsilon(
    module=model, optimizer=optimizer, data_loader=DataLoader(train, batch_size=256), target_epsilon=8.0,
    target_delta=1e-5, epochs=EPOCHS, max_grad_norm=1.0)
criterion = nn.CrossEntropyLoss()
for epoch in range(EPOCHS):
    for xb, yb in loader:
        optimizer.zero_grad()
        criterion(model(xb), yb).backward()
        optimizer.step()
model.eval()
with torch.no_grad():
    accuracy = (model(torch.tensor(x_ev, dtype=torch.float32)).argmax(1) == torch.tensor(y_ev)).float().mean()
print(f"done: accuracy={float(accuracy):.4f} epsilon={engine.get_epsilon(1e-5):.3f}")
