"""Offline stand-ins for what Accelerate's examples download or need a GPU for, under the names the examples
import, so that a ported example differs from Accelerate's file only in its imports:

- ``AutoTokenizer.from_pretrained(name)``: a BERT WordPiece tokenizer over a 45-word vocabulary, built here.
- ``AutoModelForSequenceClassification.from_pretrained(name, ...)``: a 2-layer BERT of width 32 with random
  weights from torch's RNG (so ``set_seed`` before it decides them, as the examples intend). With the variable
  ``STANDINS_DEVICE_BATCH`` set to N, its forward in training mode raises ``torch.OutOfMemoryError`` ("CUDA out
  of memory.") for a batch of more than N samples: the device a memory example needs, on the CPU.
- ``load_dataset("nyu-mll/glue", "mrpc")``: MRPC-shaped sentence pairs (96 train, 70 validation; label 1: the
  second sentence is the first one's words, a few replaced), with the ``map`` / ``rename_column`` the examples use.
- ``evaluate.load("glue", "mrpc")``: ``add_batch`` and ``compute`` giving ``{"accuracy": ..., "f1": ...}``.
- ``create_model(name, pretrained, num_classes)`` (timm) for cv_example: a tiny frozen conv base and a linear
  classifier, with ``get_classifier()`` and ``default_cfg``; ``Compose``, ``RandomResizedCrop``, ``Resize`` and
  ``ToTensor`` (torchvision's transforms, which are not installed here) on PIL images, drawing from torch's RNG;
  ``make_pets(folder)`` writes the Oxford-Pets-shaped ``<label>_<n>.jpg`` files the example reads.

Every model made here is kept in ``MODELS`` so that the examples' runner can fingerprint the trained weights.
"""

from __future__ import annotations

import math
import os
import random
from types import SimpleNamespace

import torch

MODELS: list = []
WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _sentence_pairs(n: int, seed: int) -> dict:
    rnd = random.Random(seed)
    columns = {"sentence1": [], "sentence2": [], "label": [], "idx": list(range(n))}
    for _ in range(n):
        first = [rnd.choice(WORDS) for _ in range(rnd.randint(5, 12))]
        label = rnd.randint(0, 1)
        if label:  # a paraphrase: the same words, two of them replaced
            second = list(first)
            for _ in range(2):
                second[rnd.randrange(len(second))] = rnd.choice(WORDS)
        else:
            second = [rnd.choice(WORDS) for _ in range(rnd.randint(5, 12))]
        columns["sentence1"].append(" ".join(first))
        columns["sentence2"].append(" ".join(second))
        columns["label"].append(label)
    return columns


class Dataset(torch.utils.data.Dataset):
    """A split: columns of equal length; an item is a dict of the row's values (python lists and ints)."""

    def __init__(self, columns: dict):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i):
        return {name: values[i] for name, values in self.columns.items()}

    def map(self, function, batched=False, remove_columns=()):
        assert batched, "the examples map batched"
        columns = {k: v for k, v in self.columns.items()}
        columns.update(dict(function(self.columns)))
        return Dataset({k: v for k, v in columns.items() if k not in remove_columns})

    def rename_column(self, old, new):
        return Dataset({(new if k == old else k): v for k, v in self.columns.items()})


class DatasetDict(dict):
    def map(self, function, batched=False, remove_columns=()):
        return DatasetDict({k: v.map(function, batched, remove_columns) for k, v in self.items()})

    def rename_column(self, old, new):
        return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})


def load_dataset(path, name=None):
    assert (path, name) in (("glue", "mrpc"), ("nyu-mll/glue", "mrpc")), (path, name)
    return DatasetDict(train=Dataset(_sentence_pairs(96, 1)), validation=Dataset(_sentence_pairs(70, 2)))


class AutoTokenizer:
    @staticmethod
    def from_pretrained(name, **kwargs):
        from transformers import BertTokenizer

        return BertTokenizer(vocab={word: i for i, word in enumerate(SPECIAL + WORDS)})


def _limited(cls):
    """``cls`` whose forward runs out of (stand-in) device memory above STANDINS_DEVICE_BATCH samples."""

    class Limited(cls):
        def forward(self, input_ids=None, *args, **kwargs):
            limit = os.environ.get("STANDINS_DEVICE_BATCH")
            if limit and self.training and input_ids is not None and input_ids.shape[0] > int(limit):
                raise torch.OutOfMemoryError(f"CUDA out of memory. (stand-in device: a training batch of "
                                             f"{input_ids.shape[0]} > {limit} samples)")
            return super().forward(input_ids, *args, **kwargs)

    Limited.__name__ = Limited.__qualname__ = cls.__name__
    return Limited


class AutoModelForSequenceClassification:
    @staticmethod
    def from_pretrained(name, return_dict=True, **kwargs):
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=len(SPECIAL + WORDS), hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                            num_labels=2, return_dict=return_dict)
        model = _limited(BertForSequenceClassification)(config)
        MODELS.append(model)
        return model


class _GlueMetric:
    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions += torch.as_tensor(predictions).tolist()
        self.references += torch.as_tensor(references).tolist()

    def compute(self):
        pairs = list(zip(self.predictions, self.references))
        self.predictions, self.references = [], []
        accuracy = sum(p == r for p, r in pairs) / len(pairs)
        tp = sum(p == r == 1 for p, r in pairs)
        fp = sum(p == 1 and r == 0 for p, r in pairs)
        fn = sum(p == 0 and r == 1 for p, r in pairs)
        return {"accuracy": accuracy, "f1": 2 * tp / (2 * tp + fp + fn) if tp else 0.0}


evaluate = SimpleNamespace(load=lambda path, config_name=None: _GlueMetric())


# cv_example: timm's create_model and torchvision's transforms


class _PetsModel(torch.nn.Module):
    default_cfg = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}

    def __init__(self, num_classes):
        super().__init__()
        self.base = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 8, stride=8), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(8, num_classes)

    def get_classifier(self):
        return self.fc

    def forward(self, x):
        return self.fc(self.base(x))


def create_model(name, pretrained=False, num_classes=1000):
    model = _PetsModel(num_classes)
    MODELS.append(model)
    return model


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, image):
        for transform in self.transforms:
            image = transform(image)
        return image


class Resize:
    def __init__(self, size):
        self.size = tuple(size)

    def __call__(self, image):
        return image.resize(self.size[::-1])


class RandomResizedCrop(Resize):
    """torchvision's: a crop of ``scale`` of the area and aspect ratio in [3/4, 4/3], drawn from torch's RNG."""

    def __init__(self, size, scale=(0.08, 1.0)):
        super().__init__(size)
        self.scale = scale

    def __call__(self, image):
        width, height = image.size
        for _ in range(10):
            area = width * height * torch.empty(1).uniform_(*self.scale).item()
            ratio = math.exp(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3)).item())
            w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                top = torch.randint(0, height - h + 1, (1,)).item()
                left = torch.randint(0, width - w + 1, (1,)).item()
                return super().__call__(image.crop((left, top, left + w, top + h)))
        return super().__call__(image)


class ToTensor:
    def __call__(self, image):
        import numpy as np

        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1).contiguous()


def make_pets(folder, per_class=20, seed=0):
    """``per_class`` 32x32 jpgs of each of 3 breeds, ``<breed>_<n>.jpg``: a breed's colour plus noise."""
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for breed, colour in (("abyssinian", (200, 60, 40)), ("beagle", (40, 180, 60)), ("pug", (50, 70, 200))):
        for n in range(per_class):
            pixels = np.clip(np.array(colour) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(os.path.join(folder, f"{breed}_{n}.jpg"))
