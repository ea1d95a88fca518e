"""Image rewards, loaded by import path like text rewards (``reward.name: noria.diffusion.rewards:NAME``).

Contract (``noria.rewards.registry``): ``fn(image, label, metadata, **kwargs) -> float``, where
``image`` is the sample's uint8 array [H, W, C] (``Sample.image``) and ``label`` the condition's
label. A reward raises when it cannot score; the runner marks that sample failed.

- ``digit_classifier``: the probability a digit classifier gives the requested digit (the reward of
  ``examples/flow_grpo_digits.yaml``);
- ``digit_correct``: 1.0 when the classifier's most likely digit is the requested one, else 0.0
  (held-out class accuracy; with ``classifier="logreg"`` a second classifier the policy never
  trained against judges the images, so reward hacking of the first does not inflate it);
- ``jpeg_compressibility``: minus the size in kB of the image as a quality-95 JPEG (DDPO's reward;
  needs Pillow).

The classifiers are trained with scikit-learn on the digits' train split the first time they are
needed (seconds) and cached under ``$NORIA_HOME/diffusion/digits-<kind>/`` as safetensors (plain
arrays, never pickles: a cache is data, not code) with their held-out accuracy in ``info.json``.
Inference is numpy on those arrays: ``mlp`` (scikit-learn's MLPClassifier, one ReLU hidden layer)
or ``logreg`` (multinomial logistic regression).

Not guaranteed: a cache written by another scikit-learn version is reused as is (the arrays do
not depend on it; retrain by deleting the folder); images other than 8x8 grayscale are refused.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

CLASSIFIERS = ("mlp", "logreg")
_lock = threading.Lock()
_loaded: dict[str, dict[str, np.ndarray]] = {}


def digit_classifier(image: Any, label: Any, metadata: dict[str, Any] | None = None, classifier: str = "mlp") -> float:
    """Probability of digit ``label`` for ``image`` (uint8 [8, 8] or [8, 8, 1])."""
    return float(digit_probs(image, classifier)[_label(label)])


def digit_correct(image: Any, label: Any, metadata: dict[str, Any] | None = None, classifier: str = "mlp") -> float:
    """1.0 if the classifier's most likely digit is ``label``, else 0.0."""
    return float(int(np.argmax(digit_probs(image, classifier))) == _label(label))


def jpeg_compressibility(image: Any, label: Any = None, metadata: dict[str, Any] | None = None, quality: int = 95) -> float:
    """Minus the kB of ``image`` (uint8 [H, W] or [H, W, C]) saved as JPEG at ``quality``."""
    from PIL import Image

    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
        raise ValueError(f"jpeg_compressibility needs a uint8 image [H, W] or [H, W, C], got {arr.dtype} {arr.shape}")
    buf = io.BytesIO()
    Image.fromarray(arr[..., 0] if arr.ndim == 3 and arr.shape[2] == 1 else arr).save(buf, format="JPEG", quality=quality)
    return -len(buf.getvalue()) / 1000.0


def _prepare(classifier: str = "mlp", **_: Any) -> None:
    """Train or load the classifier once, before a run's first (timed) reward call
    (``noria.rewards.registry.prepared_reward``): training it takes seconds to tens of seconds."""
    classifier_weights(classifier)


digit_classifier.prepare = digit_correct.prepare = _prepare  # type: ignore[attr-defined]


def _label(label: Any) -> int:
    value = int(label)
    if not 0 <= value < 10:
        raise ValueError(f"digit label must be 0..9, got {label!r}")
    return value


# ----------------------------------------------------------------------------------- classifier


def digit_probs(image: Any, classifier: str = "mlp") -> np.ndarray:
    """Class probabilities [10] of one 8x8 uint8 image."""
    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.shape not in ((8, 8), (8, 8, 1)):
        raise ValueError(f"the digit classifier scores uint8 8x8 grayscale images, got {arr.dtype} {arr.shape}")
    return batch_probs(arr.reshape(1, 64), classifier)[0]


def batch_probs(images: np.ndarray, classifier: str = "mlp") -> np.ndarray:
    """Class probabilities [N, 10] of uint8 images flattened to [N, 64]."""
    weights = classifier_weights(classifier)
    x = images.reshape(len(images), 64).astype(np.float64) / 255.0
    if classifier == "mlp":
        x = np.maximum(x @ weights["w1"] + weights["b1"], 0.0)
    logits = x @ weights["w2"] + weights["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def classifier_weights(classifier: str) -> dict[str, np.ndarray]:
    """The classifier's arrays: from memory, else the cache folder, else trained now and cached."""
    if classifier not in CLASSIFIERS:
        raise ValueError(f"unknown digit classifier {classifier!r}; use one of {CLASSIFIERS}")
    with _lock:  # reward calls run on many threads at once: train and load once
        if classifier not in _loaded:
            folder = cache_folder(classifier)
            if not (folder / "info.json").is_file():
                train_classifier(classifier, folder)
            _loaded[classifier] = read_weights(folder)
        return _loaded[classifier]


def cache_folder(classifier: str) -> Path:
    from noria.models.catalog import noria_home

    return noria_home() / "diffusion" / f"digits-{classifier}"


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "weights.safetensors"))


def train_classifier(classifier: str, folder: Path) -> dict[str, Any]:
    """Fit the classifier on the digits' train split, write its arrays and info (atomically)."""
    from safetensors.numpy import save_file
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    from noria.diffusion.data import digits_split

    images, labels = digits_split("train")
    test_images, test_labels = digits_split("test")
    x, x_test = images.reshape(len(images), 64) / 255.0, test_images.reshape(len(test_images), 64) / 255.0
    if classifier == "mlp":
        model = MLPClassifier(hidden_layer_sizes=(64,), max_iter=600, random_state=0).fit(x, labels)
        arrays = {"w1": model.coefs_[0], "b1": model.intercepts_[0], "w2": model.coefs_[1], "b2": model.intercepts_[1]}
    else:
        model = LogisticRegression(max_iter=2000, C=10.0).fit(x, labels)
        arrays = {"w2": model.coef_.T.copy(), "b2": model.intercept_.copy()}
    info = {"classifier": classifier, "test_accuracy": float(model.score(x_test, test_labels)), "train_images": len(labels)}
    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float64) for k, v in arrays.items()}, str(tmp / "weights.safetensors"))
    (tmp / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
    return info
