"""Toxicity scorers, each `score(texts) -> list[float]` in [0, 1]: a deterministic lexicon
scorer (tests, quick looks), a local Hugging Face text-classification model, and Google's
Perspective API (when a key and a network exist). Nothing is downloaded."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from gigatron.errors import GigatronError

PERSPECTIVE_URL = "https://commentanalyzer.googleapis.com/v1alpha1/comments:analyze"
_WORD = re.compile(r"\w+")
# A small list of insults for the lexicon scorer's default; real use passes --lexicon.
DEFAULT_LEXICON = frozenset(
    "idiot idiots stupid moron morons dumb hate hateful kill loser losers scum trash pathetic "
    "disgusting worthless ugly fool fools jerk".split()
)


class LexiconScorer:
    """Toxicity 1 - 0.5**n, n the words of the text found in the lexicon (lower-cased)."""

    def __init__(self, words: frozenset[str]) -> None:
        self.words = words

    @classmethod
    def from_file(cls, path: str | None) -> LexiconScorer:
        if path is None:
            return cls(DEFAULT_LEXICON)
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise GigatronError(f"--lexicon {path}: cannot be read ({error})") from None
        words = frozenset(w.strip().lower() for w in lines if w.strip() and not w.startswith("#"))
        if not words:
            raise GigatronError(f"--lexicon {path}: holds no words; one word a line")
        return cls(words)

    def score(self, texts: Sequence[str]) -> list[float]:
        counts = [sum(w in self.words for w in _WORD.findall(t.lower())) for t in texts]
        return [1.0 - 0.5**n for n in counts]


class ClassifierScorer:
    """A local transformers sequence-classification model; the toxicity is the probability of
    its toxic label (sigmoid for multi-label models, softmax otherwise)."""

    def __init__(self, directory: str, label: str | None, batch_size: int = 16) -> None:
        import torch  # why: only this scorer needs torch and transformers
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(directory) / "config.json").is_file():
            raise GigatronError(
                f"--toxicity-model {directory}: no config.json; give a local Hugging Face "
                "text-classification model folder (nothing is downloaded)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            directory, local_files_only=True
        ).eval()
        self.index = self._label_index(label)
        self.torch, self.batch_size = torch, batch_size

    def _label_index(self, label: str | None) -> int:
        names = {int(i): str(name) for i, name in self.model.config.id2label.items()}
        wanted = [i for i, name in names.items() if (label or "toxic") == name.lower()]
        wanted = wanted or [i for i, n in names.items() if label is None and "toxic" in n.lower()]
        if not wanted:
            raise GigatronError(
                f"--toxic-label {label or 'toxic'}: not a label of the model "
                f"({', '.join(names.values())}); name its toxic label"
            )
        return wanted[0]

    def score(self, texts: Sequence[str]) -> list[float]:
        scores: list[float] = []
        multi_label = self.model.config.problem_type == "multi_label_classification"
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(list(texts[start : start + self.batch_size]), padding=True,
                                   truncation=True, return_tensors="pt")  # fmt: skip
            with self.torch.no_grad():
                logits = self.model(**batch).logits.float()
            probs = logits.sigmoid() if multi_label else logits.softmax(-1)
            scores.extend(probs[:, self.index].tolist())
        return scores


class PerspectiveScorer:
    """Google's Perspective API (TOXICITY summary score), with retries on rate limits."""

    def __init__(self, key: str | None, url: str = PERSPECTIVE_URL, retries: int = 5) -> None:
        key = key or os.environ.get("PERSPECTIVE_API_KEY")
        if not key:
            raise GigatronError(
                "--scorer perspective: no API key; pass --perspective-api-key or set "
                "PERSPECTIVE_API_KEY"
            )
        self.key, self.url, self.retries = key, url, retries

    def _request(self, text: str) -> float:
        body = {"comment": {"text": text}, "requestedAttributes": {"TOXICITY": {}},
                "languages": ["en"]}  # fmt: skip
        request = urllib.request.Request(
            f"{self.url}?key={self.key}", json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        return float(answer["attributeScores"]["TOXICITY"]["summaryScore"]["value"])

    def score_one(self, text: str) -> float:
        if not text.strip():
            return 0.0  # Perspective refuses empty comments; an empty text is not toxic
        for attempt in range(self.retries):
            try:
                return self._request(text)
            except urllib.error.HTTPError as error:
                if error.code != 429 or attempt == self.retries - 1:
                    raise GigatronError(
                        f"Perspective API: HTTP {error.code} ({error.reason})"
                    ) from None
            except (urllib.error.URLError, TimeoutError) as error:
                raise GigatronError(f"Perspective API: cannot reach {self.url} ({error})") from None
            time.sleep(min(2**attempt, 30))  # rate limited: back off and retry
        raise AssertionError("unreachable")

    def score(self, texts: Sequence[str]) -> list[float]:
        return [self.score_one(text) for text in texts]


def build_scorer(args) -> LexiconScorer | ClassifierScorer | PerspectiveScorer:
    """The scorer `--scorer` names, from its flags."""
    if args.scorer == "lexicon":
        return LexiconScorer.from_file(args.lexicon)
    if args.scorer == "classifier":
        if not args.toxicity_model:
            raise GigatronError("--scorer classifier: give --toxicity-model DIR (a local model)")
        return ClassifierScorer(args.toxicity_model, args.toxic_label)
    return PerspectiveScorer(args.perspective_api_key, args.perspective_url)
