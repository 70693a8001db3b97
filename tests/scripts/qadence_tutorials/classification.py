"""qadence's tutorial page docs/tutorials/qml/classification.md (a hybrid QNN classifying the Iris dataset), its
Trainer parts, qadence 1.11.5 at commit 5b6c7d2, run as a reader pastes its Python blocks, on qadence's Trainer or
on qaccel's.

Usage: ``python classification.py qadence|qaccel``. Prints one line ``RESULT <json>`` at the end (also after an
error, with what was recorded up to it): the epochs trained, the training set's cross entropy before and after
training, each epoch's training loss where the Trainer keeps them (qaccel's ``trainer.history``), and the test
accuracy the page computes.

Changes from the page:

- imports: ``qadence.ml_tools`` -> ``qaccel``, in a second import block next to qadence's;
- sizes: ``n_epochs = 50`` (tutorial: ``n_epochs = 1000``);
- left out: the circuit drawing (``html_string``, hidden on the page);
- lines marked ``# test:`` only record values for the RESULT line.
"""

import atexit
import json
import sys

QADENCE = {"qadence": True, "qaccel": False}[sys.argv[1]]  # test: whose Trainer
RESULT: dict = {"library": sys.argv[1]}  # test
atexit.register(lambda: print("RESULT " + json.dumps(RESULT), flush=True))  # test: printed last, even after an error

# ---- Dataset ----

import random

import torch
import torch.nn as nn
from sklearn.datasets import load_iris
from sklearn.preprocessing import StandardScaler
from sklearn.model_selection import train_test_split
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from qadence import QNN, RX, FeatureParameter, QuantumCircuit, Z, chain, hea, kron
if QADENCE:
    from qadence.ml_tools import TrainConfig, Trainer
else:
    from qaccel import TrainConfig, Trainer

class IrisDataset(Dataset):
    """The Iris dataset split into a training set and a test set.

    A StandardScaler is applied prior to applying models.
    """

    def __init__(self):
        X, y = load_iris(return_X_y=True)
        X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.33, random_state=42)

        self.scaler = StandardScaler()
        self.scaler.fit(X_train)
        self.X = torch.tensor(self.scaler.transform(X_train), requires_grad=False)
        self.y = torch.tensor(y_train, requires_grad=False)

        self.X_test = torch.tensor(self.scaler.transform(X_test), requires_grad=False)
        self.y_test = torch.tensor(y_test, requires_grad=False)

    def __getitem__(self, index) -> tuple[Tensor, Tensor]:
        return self.X[index], self.y[index]

    def __len__(self) -> int:
        return len(self.y)

n_features = 4  # sepal length, sepal width, petal length, petal width
n_layers = 3
n_neurons_final_linear_layer = 3
n_epochs = 50  # tutorial: n_epochs = 1000
lr = 1e-1
dataset = IrisDataset()

dataloader = DataLoader(dataset, batch_size=20, shuffle=True)

# ---- Hybrid QNN ----

feature_parameters = [FeatureParameter(f"x_{i}") for i in range(n_features)]
fm_layer = RX(0, feature_parameters[0])
for q in range(1, n_features):
    fm_layer = kron(fm_layer, RX(q, feature_parameters[q]))

ansatz_layers = [
    hea(n_qubits=n_features, depth=1, param_prefix=f"theta_{layer}")
    for layer in range(n_layers)
]
blocks = chain(fm_layer, ansatz_layers[0])
for layer in range(1, n_layers):
    blocks = chain(blocks, fm_layer, ansatz_layers[layer])

qc = QuantumCircuit(n_features, blocks)
qnn = QNN(circuit=qc, observable=Z(0), inputs=[f"x_{i}" for i in range(n_features)])
model = nn.Sequential(qnn, nn.Linear(1, n_neurons_final_linear_layer))

# ---- Training ----

opt = torch.optim.Adam(model.parameters(), lr=lr)
criterion = nn.CrossEntropyLoss()

def cross_entropy(model: nn.Module, data: Tensor) -> tuple[Tensor, dict]:
    x, y = data
    out = model(x)
    loss = criterion(out, y)
    return loss, {}

train_config = TrainConfig(max_iter=n_epochs, print_every=10, create_subfolder_per_run=True)
Trainer.set_use_grad(True)
trainer = Trainer(model=model, optimizer=opt, config=train_config, loss_fn=cross_entropy)


with torch.no_grad():  # test
    RESULT["initial_loss"] = criterion(model(dataset.X), dataset.y).item()  # test
res_train = trainer.fit(dataloader)

with torch.no_grad():  # test
    RESULT["final_loss"] = criterion(model(dataset.X), dataset.y).item()  # test
history = getattr(trainer, "history", None)  # test
RESULT.update(current_epoch=trainer.current_epoch, max_iter=n_epochs,  # test
              train_loss=[epoch["train_loss"] for epoch in history] if history else None)  # test

# ---- Inference ----

X_test, y_test = dataset.X_test, dataset.y_test
preds_test = torch.argmax(torch.softmax(model(X_test), dim=1), dim=1)
accuracy_test = (preds_test == y_test).type(torch.float32).mean()
## Should reach higher than 0.9
print(f"Test Accuracy: {accuracy_test.item()}") # markdown-exec: hide
RESULT["accuracy_test"] = accuracy_test.item()  # test
