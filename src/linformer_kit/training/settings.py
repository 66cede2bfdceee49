"""Training settings (dataclasses: the CLI flags and the saved run config come from them)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checks import (
    check_choice,
    check_finite_non_negative,
    check_fraction,
    check_non_negative,
    check_positive,
    check_seed,
    is_number,
)
from ..config import LinformerConfig
from ..data.pipeline import DataSettings
from ..files import save_json
from ..memory import check_batch_fits

MAX_THREADS = 4096  # beyond any CPU's cores: OpenMP would start every one of them
SCHEDULES = ("linear", "cosine", "constant")
PRECISIONS = ("fp32", "bf16")
OBJECTIVES = ("mlm", "clm")
# torch.compile settings (`compiled`): Inductor, Inductor with CUDA graphs, or dynamo's graphs
# run by the eager kernels (no code generation); each also with "+autograd" (AUTOGRAD),
# the backward then captured whole by compiled autograd and compiled the same way
# (`compiled_backward`).
AUTOGRAD = "+autograd"
COMPILES = tuple(
    f"{base}{suffix}"
    for suffix in ("", AUTOGRAD)
    for base in ("inductor", "reduce-overhead", "aot_eager")
)
RUN_CONFIG_NAME = "run_config.json"
# AdamW's first step moves a weight by about lr: 10 is far past any recipe, and lr near
# float32's range (1e38) overflowed inside AdamW with a traceback
MAX_LR = 10.0


def check_lr(name: str, value: float, zero: str = "") -> None:
    """Raises ValueError unless the learning rate `value` is in (0, MAX_LR], or 0 where
    `zero` says what 0 means (e.g. "0 = LRA's"), naming `name`, the range and the value."""
    if is_number(value) and ((value == 0 and zero) or 0 < value <= MAX_LR):  # nan fails both
        return
    allowed = f"[0, {MAX_LR:g}] ({zero})" if zero else f"(0, {MAX_LR:g}]"
    raise ValueError(f"{name} must be a number in {allowed}, got {value}")


@dataclass(kw_only=True)
class TrainSettings:
    """The optimisation recipe and the run's bookkeeping."""

    output_dir: str = field(default="runs/pretrain", metadata={"help": "run directory"})
    max_steps: int = field(default=1000, metadata={"help": "optimiser steps"})
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch per process"})
    grad_accum_steps: int = field(default=1, metadata={"help": "micro-batches per step"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW decay (not on norms/bias)"})
    beta2: float = field(default=0.98, metadata={"help": "AdamW beta2 (RoBERTa: 0.98)"})
    warmup_steps: int = field(default=100, metadata={"help": "linear warm-up steps"})
    schedule: str = field(default="linear", metadata={"help": "decay: linear, cosine, constant"})
    clip_grad_norm: float = field(default=1.0, metadata={"help": "max gradient norm (0 = off)"})
    precision: str = field(default="fp32", metadata={"help": "fp32, or bf16 autocast"})
    objective: str = field(
        default="mlm", metadata={"help": "mlm (masked LM) or clm (causal LM: next token)"}
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "share of tokens to mask (mlm)"})
    eval_every: int = field(default=100, metadata={"help": "validate every N steps"})
    eval_batches: int = field(default=8, metadata={"help": "validation batches (0 = all)"})
    save_every: int = field(default=500, metadata={"help": "checkpoint every N steps"})
    log_every: int = field(default=10, metadata={"help": "log training metrics every N steps"})
    keep_last: int = field(default=2, metadata={"help": "step checkpoints kept besides best"})
    seed: int = field(default=0, metadata={"help": "seed of weights, data order and masking"})
    resume: bool = field(default=False, metadata={"help": "continue from the last checkpoint"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    threads: int = field(
        default=0, metadata={"help": "CPU threads per process (0 = torch's default)"}
    )
    keep_freed_memory: bool = field(
        default=True,
        metadata={
            "help": "CPU: glibc keeps freed memory in the process (keep_freed_memory), so a "
            "step reuses the last step's pages instead of faulting in fresh ones"
        },
    )
    compile: str = field(
        default="",
        metadata={
            "help": "torch.compile the model for the training steps: inductor, reduce-overhead "
            "(Inductor with CUDA graphs: a GPU only) or aot_eager, each also with +autograd "
            "(the whole backward captured by compiled autograd); '' = eager"
        },
    )

    def __post_init__(self) -> None:
        check_threads(self.threads)
        for name in (
            "max_steps",
            "batch_size",
            "grad_accum_steps",
            "eval_every",
            "save_every",
            "log_every",
            "keep_last",
        ):
            check_positive(name, getattr(self, name))
        check_batch_fits(self.batch_size)  # a list of 10**12 rows grew for minutes
        check_seed("seed", self.seed)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("objective", self.objective, OBJECTIVES)
        check_choice("precision", self.precision, PRECISIONS)
        if self.compile:
            check_compile(self.compile, self.device)
        if not self.output_dir:
            raise ValueError("output_dir must name the run's directory, got ''")
        for name in ("warmup_steps", "eval_batches"):
            check_non_negative(name, getattr(self, name))
        check_lr("lr", self.lr)
        check_finite_non_negative("weight_decay", self.weight_decay, "0 = none")
        check_finite_non_negative("clip_grad_norm", self.clip_grad_norm, "0 = no clipping")
        if not is_number(self.beta2) or not 0 <= self.beta2 < 1:
            raise ValueError(f"beta2 must be a number in [0, 1), got {self.beta2}")
        check_fraction("mlm_probability", self.mlm_probability)


@dataclass(kw_only=True)
class RunConfig:
    """Everything a pretraining run needs; saved as run_config.json beside its checkpoints."""

    model: LinformerConfig
    train: TrainSettings
    data: DataSettings

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "model": self.model.to_dict(),
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Builds a run config from `to_dict` output; missing sections take their defaults.

        Raises:
            ValueError: on an unknown section or field.
        """
        unknown = sorted(set(data) - {"model", "train", "data"})
        if unknown:
            raise ValueError(f"unknown run config sections {unknown}; known: model, train, data")
        return cls.from_sections(data.get("model", {}), data.get("train", {}), data.get("data", {}))

    @classmethod
    def from_sections(
        cls, model: dict[str, Any], train: dict[str, Any], data: dict[str, Any]
    ) -> RunConfig:
        """Builds a run config from its three sections' plain-JSON forms (subclasses with
        other sections override this, not `from_dict`).

        Raises:
            ValueError: on an unknown field.
        """
        return cls(
            model=LinformerConfig.from_dict(model),
            train=_build(TrainSettings, train),
            data=_build(DataSettings, data),
        )

    def save(self, path: Path) -> None:
        """Writes the JSON form to `path`."""
        save_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Reads a run config (a run_config.json, or a directory holding one), `resume`
        off (each command asks for it).

        Raises:
            FileNotFoundError / ValueError: if it is missing or malformed.
        """
        file = Path(path)
        if file.is_dir():
            file = file / RUN_CONFIG_NAME
        if not file.is_file():
            raise FileNotFoundError(
                f"{path}: no {file} (expected a run_config.json or a run directory)"
            )
        try:
            run = cls.from_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from err
        except (ValueError, TypeError, AttributeError) as err:  # a field out of range, or of
            raise ValueError(f"{file}: {err}") from err  # another type: named with the file
        # what the command that saved it was asked, not a setting of the run: a --config of
        # a resumed run went on in its folder without --resume (and gave a run elsewhere the
        # same)
        run.train.resume = False
        return run


def check_compile(setting: str, device: str, *, processes: int = 1) -> None:
    """Checks a torch.compile setting for a device ("auto", "cpu", "cuda", "cuda:N"; "auto"
    passes, the trainer checking the device it resolves to) and a job of `processes`.

    Raises:
        ValueError: if `setting` is not one of COMPILES, records CUDA graphs (reduce-overhead)
            for a device other than a GPU, or takes compiled autograd ("+autograd") in a
            job of several processes, where DDP's C++ reducer cannot run inside the
            captured backward (torch's Python reducer for it is experimental; untested
            here).
    """
    check_choice("compile", setting, COMPILES)
    if cuda_graphs(setting) and device.split(":")[0] not in ("auto", "cuda"):
        raise ValueError(
            f"compile {setting} records CUDA graphs: it needs a CUDA device, got {device!r}"
        )
    if setting.endswith(AUTOGRAD) and processes > 1:
        raise ValueError(
            f"compile {setting}: compiled autograd does not run with DDP's reducer; "
            f"{processes} processes were asked for (use {setting.removesuffix(AUTOGRAD)!r})"
        )


def cuda_graphs(setting: str | None) -> bool:
    """Whether a compile setting (None or "": eager) records CUDA graphs."""
    return bool(setting) and setting.removesuffix(AUTOGRAD) == "reduce-overhead"


def compiled(module: torch.nn.Module, setting: str) -> torch.nn.Module:
    """`torch.compile(module)` by a setting, one of COMPILES (its "+autograd" is
    `compiled_backward`'s, around the calls).

    Raises:
        ValueError: for another setting.
    """
    check_choice("compile", setting, COMPILES)
    if cuda_graphs(setting):
        return torch.compile(module, mode="reduce-overhead")
    return torch.compile(module, backend=setting.removesuffix(AUTOGRAD))


def compiled_backward(setting: str | None) -> contextlib.AbstractContextManager:
    """Where a compile setting ends in "+autograd", compiled autograd for the block: each
    backward inside is captured whole, the gradients' accumulation into `.grad` included,
    and compiled as `compiled` compiles (with reduce-overhead: one CUDA graph for the whole
    backward instead of an AccumulateGrad call per parameter from the host). Put the
    compiled forward inside the block too, as torch's compiled autograd asks. Otherwise
    (None, "", another setting) a block that does nothing.
    """
    if not setting or not setting.endswith(AUTOGRAD):
        return contextlib.nullcontext()
    # (torch's own switch, `torch._dynamo.config.compiled_autograd`, acts on backward calls
    # made inside a compiled function; these are made outside)
    from torch._dynamo import compiled_autograd

    base = setting.removesuffix(AUTOGRAD)
    # Sizes static, as torch.compile's own switch (`torch._dynamo.config.compiled_autograd`)
    # sets them by default; a new shape captures a new graph.
    dynamic = not torch._dynamo.config.assume_static_by_default
    return compiled_autograd._enable(lambda graph: compiled(graph, base), dynamic=dynamic)


def check_threads(threads: int) -> None:
    """Raises a ValueError unless `threads` is an integer in [0, MAX_THREADS] (0 = torch's
    default)."""
    check_non_negative("threads", threads, "0 = torch's default")
    if threads > MAX_THREADS:  # 10**12: "Overflow when unpacking long", naming no flag
        raise ValueError(
            f"threads must be an integer in [0, {MAX_THREADS}] (0 = torch's default), got {threads}"
        )


def use_threads(threads: int) -> None:
    """Sets torch's intra-op CPU threads; 0 leaves torch's default (one per core). On a
    shared machine fewer threads per process can be faster: they stop competing for cores.

    Raises:
        ValueError: as `check_threads` (torch's own error was a RuntimeError).
    """
    check_threads(threads)
    if threads:
        torch.set_num_threads(threads)


# glibc's mallopt parameters, and the largest mmap threshold it takes on 64-bit systems.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


def keep_freed_memory(mmap_threshold: int = MAX_MMAP_THRESHOLD) -> bool:
    """Has glibc's malloc keep freed memory in the process (blocks below `mmap_threshold`
    bytes from its heap, the heap never trimmed), so that a training step reuses the last
    step's pages instead of faulting in fresh ones. Process-wide and not undone; the
    process's resident memory stays at its peak. An encoder layer step (n 4096, 2 threads,
    AMD EPYC): 3700-5400 page faults a step -> under 60, the median step 1.01-1.16x faster
    (the slow steps gone), the fastest unchanged; a masked-LM pretraining run (dim 256,
    depth 4, n 2048, batch 4) 1.06-1.07x the tokens/s, its resident peak no higher. The
    same as `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...`
    at start-up. `Trainer.fit` calls it on CPU (`TrainSettings.keep_freed_memory`, on by
    default), `linformer bench` while it times.

    Args:
        mmap_threshold: bytes, in [1, MAX_MMAP_THRESHOLD].

    Returns:
        Whether it took effect: False without glibc (macOS, Windows, musl).

    Raises:
        ValueError: if mmap_threshold is outside [1, MAX_MMAP_THRESHOLD].
    """
    if not isinstance(mmap_threshold, int) or not 1 <= mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(
            f"mmap_threshold must be an integer in [1, {MAX_MMAP_THRESHOLD}] bytes, "
            f"got {mmap_threshold!r}"
        )
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )


def markdown_table(
    rows: list[dict[str, Any]], columns: dict[str, str], decimals: dict[str, int] | None = None
) -> str:
    """`rows` as a Markdown table of the keys in `columns` (key -> header). A float gets
    `decimals[key]` decimals (0 where not named); a missing or NaN figure is a dash."""

    def cell(key: str, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, float):
            return f"{value:.{(decimals or {}).get(key, 0)}f}"
        return str(value)

    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(k, row.get(k)) for k in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _build(cls: type, values: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}; known: {sorted(known)}")
    return cls(**values)
