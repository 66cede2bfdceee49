"""Training: settings, the loop (accumulation, clipping, bf16, DDP), checkpoints and resume,
pretraining, fine-tuning, evaluation and the Linformer-vs-Transformer comparison."""

from .batches import LMBatches, LMEvaluator, RowSchedule, classification_metrics
from .checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, save_checkpoint
from .distributed import Distributed, distributed_job, setup_distributed, teardown_distributed
from .evaluate import EvaluateSettings, evaluate_checkpoint
from .finetune import finetune
from .finetune_settings import FinetuneSettings
from .generate import generate_texts
from .loop import Trainer, TrainResult
from .optim import build_optimizer, build_scheduler, lr_factor
from .pretrain import build_trainer, pretrain
from .settings import RunConfig, TrainSettings, keep_freed_memory

__all__ = [
    "Checkpoint",
    "Distributed",
    "EvaluateSettings",
    "FinetuneSettings",
    "LMBatches",
    "LMEvaluator",
    "RowSchedule",
    "RunConfig",
    "TrainResult",
    "TrainSettings",
    "Trainer",
    "build_optimizer",
    "build_scheduler",
    "build_trainer",
    "classification_metrics",
    "evaluate_checkpoint",
    "finetune",
    "generate_texts",
    "keep_freed_memory",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_factor",
    "pretrain",
    "save_checkpoint",
    "distributed_job",
    "setup_distributed",
    "teardown_distributed",
]
