"""Long Range Arena's per-task recipes (LRA's published configs, scaled by one knob) and the
settings of a run (`linformer lra TASK`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..checks import check_choice, check_non_negative, check_positive
from ..config import PROJECTIONS, SHARINGS
from ..data.lra import TASKS
from .compare import MODELS
from .distributed import resolve_device
from .settings import check_lr, check_threads


@dataclass(frozen=True)
class Recipe:
    """A task's model and optimisation settings, and LRA's published accuracies (%)."""

    dim: int
    num_heads: int
    depth: int
    ffn_dim: int
    batch_size: int
    steps: int
    warmup_steps: int
    lr: float
    weight_decay: float
    dropout: float
    schedule: str
    pooling: str
    published: dict[str, float]

    def scaled(self, scale: float) -> Recipe:
        """Width (model and feed-forward) and steps times `scale`; depth and batch kept. The
        head size is kept too (fewer heads): attention's cost grows with the number of heads,
        not their size, and at width 64 LRA's 8 heads of 8 made a CPU step 4x slower (2.9 vs
        11.6 s, ListOps n = 1000, batch 32) for heads too narrow to score much."""
        heads = max(1, round(self.num_heads * scale))
        return dataclasses.replace(
            self,
            dim=heads * max(1, round(self.dim * scale / heads)),
            num_heads=heads,
            ffn_dim=max(1, round(self.ffn_dim * scale)),
            steps=max(1, round(self.steps * scale)),
            warmup_steps=round(self.warmup_steps * scale),
        )


# LRA's configs (github.com/google-research/long-range-arena, lra_benchmarks/*/configs). Their
# ListOps and text runs use lr 0.05 under "constant * linear_warmup * rsqrt_decay", whose peak
# is 0.05 / sqrt(warmup): that peak is the AdamW learning rate here. Pooling at their position:
# the first for ListOps and text (theirs a learned "CLS" vector prepended there, ours the first
# token itself: ListOps' outermost operator, a text's first byte), the mean for Pathfinder.
# Published accuracies: their Table 1 (Linformer vs Transformer).
RECIPES = {
    "listops": Recipe(
        dim=512, num_heads=8, depth=6, ffn_dim=2048, batch_size=32, steps=5000,
        warmup_steps=1000, lr=0.05 / math.sqrt(1000), weight_decay=0.1, dropout=0.1,
        schedule="linear", pooling="cls", published={"linformer": 35.70, "transformer": 36.37},
    ),
    "text": Recipe(
        dim=256, num_heads=4, depth=4, ffn_dim=1024, batch_size=32, steps=20000,
        warmup_steps=8000, lr=0.05 / math.sqrt(8000), weight_decay=0.1, dropout=0.1,
        schedule="linear", pooling="cls", published={"linformer": 53.94, "transformer": 64.27},
    ),
    # Pathfinder-32: 200 epochs of 160K images at batch 512, one warm-up epoch, cosine decay.
    "pathfinder": Recipe(
        dim=128, num_heads=4, depth=1, ffn_dim=128, batch_size=512, steps=62400,
        warmup_steps=312, lr=1e-3, weight_decay=0.0, dropout=0.2,
        schedule="cosine", pooling="mean", published={"linformer": 76.34, "transformer": 71.40},
    ),
}  # fmt: skip


@dataclass(kw_only=True)
class LRASettings:
    """How to run one Long Range Arena task (`linformer lra TASK`)."""

    output_dir: str = field(default="runs/lra", metadata={"help": "where runs and reports go"})
    scale: float = field(
        default=1.0, metadata={"help": "multiplies LRA's model width and steps (0, 1]"}
    )
    steps: int = field(default=0, metadata={"help": "optimiser steps (0 = LRA's x scale)"})
    warmup_steps: int = field(
        default=-1, metadata={"help": "learning-rate warm-up (-1 = LRA's share of the steps)"}
    )
    batch_size: int = field(default=0, metadata={"help": "sequences per step (0 = LRA's)"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate (0 = LRA's)"})
    proj_dim: int = field(default=256, metadata={"help": "Linformer's k (at most the length)"})
    sharing: str = field(default="layerwise", metadata={"help": "none, headwise, kv, layerwise"})
    projection: str = field(
        default="linear",
        metadata={
            "help": "Linformer's sequence projection: linear (the paper's), conv, pool, "
            "random or adaptive"
        },
    )
    num_train: int = field(default=0, metadata={"help": "training examples (0 = LRA's)"})
    num_eval: int = field(
        default=0, metadata={"help": "validation and test examples each (0 = LRA's)"}
    )
    min_length: int = field(default=500, metadata={"help": "listops: shortest expression"})
    max_length: int = field(
        default=0, metadata={"help": "listops: longest expression; text: bytes (0 = LRA's)"}
    )
    max_depth: int = field(default=10, metadata={"help": "listops: operator nesting"})
    contour_length: int = field(default=14, metadata={"help": "pathfinder: dashes (hard: 14)"})
    data: str = field(default="", metadata={"help": "text: class folders or a label,text CSV"})
    data_where: str = field(
        default="",
        metadata={"help": "text: COLUMN=VALUE keeps only those rows of a CSV with a header"},
    )
    eval_every: int = field(default=0, metadata={"help": "validate every N steps (0 = 10 per run)"})
    seed: int = field(default=0, metadata={"help": "seed of the data, weights and order"})
    threads: int = field(default=0, metadata={"help": "CPU threads (0 = torch's default)"})
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    isolate: bool = field(
        default=True, metadata={"help": "train each model in a fresh process (own peak memory)"}
    )
    cache_dir: str = field(default="", metadata={"help": "data cache (empty: the default)"})
    models: str = field(
        default=",".join(MODELS),
        metadata={"help": "the models to train, comma-separated: linformer, transformer"},
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "continue each model's run in output_dir from its last checkpoint (saved "
            "at every validation); a finished one is only tested again"
        },
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.scale <= 1.0:
            raise ValueError(f"scale must be in (0, 1], got {self.scale!r}")
        for name in ("steps", "batch_size", "num_train", "num_eval", "max_length", "eval_every"):
            check_non_negative(name, getattr(self, name))
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < -1:
            raise ValueError(
                f"warmup_steps must be an integer >= 0, or -1 for LRA's share of the steps; "
                f"got {self.warmup_steps!r}"
            )
        check_lr("lr", self.lr, zero="0 = LRA's")
        check_positive("proj_dim", self.proj_dim)
        check_non_negative("seed", self.seed)  # numpy's generators take no negative seed
        resolve_device(self.device)  # before the data is made or an earlier run replaced
        check_choice("sharing", self.sharing, SHARINGS)  # here, not after the data is made
        check_choice("projection", self.projection, PROJECTIONS)
        names = self.model_names
        unknown = [name for name in names if name not in MODELS]
        if not names or unknown or len(set(names)) < len(names):
            raise ValueError(
                f"models must name each of {', '.join(MODELS)} at most once, comma-separated; "
                f"got {self.models!r}"
            )
        check_threads(self.threads)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The models to train, in the order given."""
        return tuple(name.strip() for name in self.models.split(",") if name.strip())

    def recipe(self, task: str) -> Recipe:
        """The task's recipe, scaled, with this run's overrides. Fewer or more `steps` keep
        LRA's warm-up share of them (text: 8K of 20K), so the peak learning rate is reached."""
        lra = RECIPES[check_task(task)]
        recipe = lra.scaled(self.scale)
        steps = self.steps or recipe.steps
        # the share from LRA's own figures: the scaled recipe's are rounded (at scale 0.001
        # pathfinder's warm-up rounds to 0 steps, which --steps 2000 kept at 0)
        warmup = round(lra.warmup_steps * steps / lra.steps) if self.steps else recipe.warmup_steps
        return dataclasses.replace(
            recipe,
            steps=steps,
            warmup_steps=warmup if self.warmup_steps < 0 else self.warmup_steps,
            batch_size=self.batch_size or recipe.batch_size,
            lr=self.lr or recipe.lr,
        )


# the settings of one task's data, and the tasks that read them
TASK_FLAGS = {
    "min_length": ("listops",),
    "max_depth": ("listops",),
    "max_length": ("listops", "text"),
    "contour_length": ("pathfinder",),
    "data": ("text",),
    "data_where": ("text",),
}


def check_task(task: str) -> str:
    """Returns `task`, or raises a ValueError naming the known tasks."""
    if task not in TASKS:
        raise ValueError(f"unknown LRA task {task!r}; known: {', '.join(TASKS)}")
    return task


def check_task_flags(task: str, settings: LRASettings) -> None:
    """Raises ValueError for a setting of another task's data given (not its default) to
    `task`, which would ignore it (`--data` on listops, `--contour-length` on text...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LRASettings)}
    for name, tasks in TASK_FLAGS.items():
        if task not in tasks and getattr(settings, name) != defaults[name]:
            raise ValueError(
                f"--{name.replace('_', '-')} sets the data of {' and '.join(tasks)} only; "
                f"{task} does not read it"
            )
