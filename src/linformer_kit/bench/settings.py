"""Settings of `linformer bench` (`BenchSettings`), checked before anything is timed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_choice, check_finite_non_negative, check_non_negative, check_positive
from ..files import check_output_path
from ..kernel_rule import KERNELS
from ..memory import check_fits
from ..training.settings import check_compile, check_threads
from .variants import SCOPES, SHARINGS, Variant, default_variants

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype's names
MODES = {"fwd": False, "fwdbwd": True}


def split_ints(text: str) -> list[int]:
    """`"1024,4096"` -> [1024, 4096]; empty parts are dropped."""
    return [int(part) for part in text.split(",") if part.strip()]


def split_floats(text: str) -> list[float]:
    """`"0,0.1"` -> [0.0, 0.1]; empty parts are dropped."""
    return [float(part) for part in text.split(",") if part.strip()]


def split_names(text: str) -> list[str]:
    """`"kv, layerwise"` -> ["kv", "layerwise"]; empty parts are dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _parsed(name: str, text: str, split: Callable[[str], list[Any]]) -> list[Any]:
    """`split(text)`, a value that does not parse named with its setting."""
    try:
        return split(text)
    except ValueError as err:
        raise ValueError(f"{name} takes comma-separated numbers, got {text!r} ({err})") from None


@dataclass(kw_only=True)
class BenchSettings:
    """Settings of the efficiency benchmark (`linformer bench`)."""

    n: str = field(default="1024,2048,4096,8192,16384", metadata={"help": "sequence lengths"})
    proj_dim: str = field(default="256", metadata={"help": "Linformer k values"})
    dim: int = field(default=256, metadata={"help": "model width"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    batch_size: int = field(default=1, metadata={"help": "sequences per call"})
    mode: str = field(default="fwdbwd", metadata={"help": "fwd (inference) or fwdbwd"})
    dtype: str = field(
        default="float32", metadata={"help": "float32 and/or bfloat16 (autocast), interleaved"}
    )
    scope: str = field(default="attention,layer", metadata={"help": "attention and/or layer"})
    sharing: str = field(default=",".join(SHARINGS), metadata={"help": "our sharing modes to time"})
    exact: str = field(default="sdpa,naive", metadata={"help": "exact baselines to time"})
    attention_dropout: str = field(
        default="0",
        metadata={"help": "attention dropout values for ours and exact SDPA, e.g. 0,0.1"},
    )
    kernel: str = field(
        default="rule",
        metadata={"help": "attention kernels of ours: rule (choose_kernel's), sdpa, explicit"},
    )
    compile: str = field(
        default="",
        metadata={
            "help": "also time every variant under torch.compile: inductor, reduce-overhead "
            "(Inductor with CUDA graphs) and/or aot_eager (no code generation), each also "
            "with +autograd (the backward under compiled autograd); '': eager only"
        },
    )
    peers: bool = field(default=False, metadata={"help": "also time the published packages"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    threads: int = field(default=0, metadata={"help": "CPU threads (0: torch's default)"})
    warmup: int = field(default=1, metadata={"help": "untimed rounds"})
    repeats: int = field(default=3, metadata={"help": "timed rounds, at least"})
    min_time_s: float = field(
        default=3.0, metadata={"help": "more rounds (up to 100) until they take this long"}
    )
    keep_freed_memory: bool = field(
        default=True,
        metadata={
            "help": "CPU: glibc keeps freed memory while timing (training.keep_freed_memory), "
            "so no step pays page faults for the last one's freed pages"
        },
    )
    memory: bool = field(default=True, metadata={"help": "measure peak memory per config"})
    memory_budget_gb: float = field(default=8.0, metadata={"help": "skip configs above this"})
    time_budget_s: float = field(
        default=300.0, metadata={"help": "skip configs estimated above this (all rounds)"}
    )
    out: str = field(default="benchmarks/bench", metadata={"help": "output directory"})

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, tuple(MODES))
        check_choice("device", self.device, ("cpu", "cuda"))
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but torch sees no GPU")
        if not split_names(self.dtype) or not set(split_names(self.dtype)) <= set(DTYPES):
            raise ValueError(f"dtype must be among float32, bfloat16; got {self.dtype!r}")
        for scope in split_names(self.scope):
            if scope not in SCOPES:
                raise ValueError(f"scope must be among {', '.join(SCOPES)}; got {scope!r}")
        for sharing in split_names(self.sharing):
            if sharing not in SHARINGS:
                raise ValueError(f"sharing must be among {', '.join(SHARINGS)}; got {sharing!r}")
        if not set(split_names(self.exact)) <= {"sdpa", "naive"}:
            raise ValueError(f"exact must be among sdpa, naive; got {self.exact!r}")
        for name in ("n", "proj_dim"):
            for value in _parsed(name, getattr(self, name), split_ints):
                check_positive(f"every {name} value", value)
        for p in _parsed("attention_dropout", self.attention_dropout, split_floats):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"attention_dropout values must be in [0, 1); got {p}")
        for kernel in split_names(self.kernel):
            check_choice("kernel", kernel, ("rule", *KERNELS))
        for setting in split_names(self.compile):
            check_compile(setting, self.device)
        lists = ("n", "proj_dim", "scope", "kernel", "attention_dropout")
        if not all(split_names(getattr(self, name)) for name in lists):
            raise ValueError(f"{', '.join(lists)} need at least one value each")
        parsers = {"n": split_ints, "proj_dim": split_ints, "attention_dropout": split_floats}
        for name in (*lists, "sharing", "exact", "dtype", "compile"):
            # a value twice was timed once and reported twice, its n's ceiling overwritten
            values = _parsed(name, getattr(self, name), parsers.get(name, split_names))
            if len(set(values)) < len(values):
                raise ValueError(f"{name} names a value twice: {getattr(self, name)!r}")
        for name in ("dim", "num_heads", "batch_size", "repeats"):
            check_positive(name, getattr(self, name))
        if self.dim % self.num_heads:  # before the probe and the timing, not at the first layer
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        # 10**12: "Storage size calculation overflowed", a traceback
        check_fits(16 * self.dim**2, f"an attention layer of dim {self.dim} (4 dim x dim maps)")
        check_non_negative("warmup", self.warmup)
        check_threads(self.threads)
        check_finite_non_negative("min_time_s", self.min_time_s)
        for name in ("memory_budget_gb", "time_budget_s"):
            if not getattr(self, name) > 0:  # also refuses nan
                raise ValueError(
                    f"{name} must be a number > 0 (inf: none), got {getattr(self, name)}"
                )
        if not self.variants():
            raise ValueError("nothing to time: name a --sharing or an --exact (or add --peers)")
        check_output_path(self.out, directory=True)  # not after the timing

    def variants(self) -> list[Variant]:
        """The variants to time, in table order."""
        exact = split_names(self.exact)
        chosen = default_variants(
            sharings=tuple(split_names(self.sharing)),
            peers=self.peers,
            attention_dropouts=tuple(split_floats(self.attention_dropout)),
            kernels=tuple(None if k == "rule" else k for k in split_names(self.kernel)),
            compiles=(None, *split_names(self.compile)),
        )
        return [v for v in chosen if not v.exact or v.kind in exact]
