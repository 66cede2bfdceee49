"""Every setting with a fixed set of values rejects an unknown one with the same message:
the setting's name, the allowed values, and the value given (checks.check_choice); counts
likewise name the setting, the range and the value (checks.check_positive / check_non_negative)."""

import pytest
import torch

from linformer_kit import linformer_tiny
from linformer_kit.bench.settings import BenchSettings
from linformer_kit.bench.variants import build_variant
from linformer_kit.data.lra.listops import load_listops
from linformer_kit.data.pipeline import DataSettings
from linformer_kit.data.seq2seq import Seq2SeqDataSettings, synthetic_pairs
from linformer_kit.interop.distill import DistillSettings, set_trainable
from linformer_kit.interop.distill_run import DistillData
from linformer_kit.interop.projection_init import init_projections
from linformer_kit.interop.report import ConversionReport, stdlib_files
from linformer_kit.interop.task_bench_settings import TaskBenchSettings
from linformer_kit.models import LinformerForSequenceClassification, LinformerModel
from linformer_kit.projection import build_projection
from linformer_kit.training.compare import ComparisonSettings
from linformer_kit.training.finetune_settings import FinetuneSettings
from linformer_kit.training.lra_settings import LRASettings
from linformer_kit.training.seq2seq import evaluate_seq2seq
from linformer_kit.training.settings import TrainSettings

TINY = linformer_tiny(vocab_size=32, max_seq_len=16, proj_dim=4)

CASES = {
    "pooling": lambda: LinformerForSequenceClassification(TINY, pooling="bogus"),
    "scope": lambda: build_variant(None, None, scope="bogus"),
    "split": lambda: evaluate_seq2seq("no-such-run", split="bogus"),
    "sharing": lambda: LRASettings(sharing="bogus"),
    "task": lambda: Seq2SeqDataSettings(task="bogus"),
    "mode": lambda: BenchSettings(mode="bogus"),
    "projection": lambda: build_projection(projection="bogus", max_seq_len=16, proj_dim=4),
    "trainable": lambda: DistillSettings(trainable="bogus"),
    "init": lambda: init_projections(LinformerModel(TINY), init="bogus"),
    "schedule": lambda: TrainSettings(schedule="bogus"),
    "precision": lambda: TrainSettings(precision="bogus"),
    # library functions check their choice before doing any work
    "task (synthetic_pairs)": lambda: synthetic_pairs(
        "bogus", 1, min_len=1, max_len=2, num_symbols=4, seed=0
    ),
    "trainable (set_trainable)": lambda: set_trainable(LinformerModel(TINY), "bogus"),
    "split (stdlib_files)": lambda: stdlib_files("bogus"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unknown_choice_names_the_setting_the_choices_and_the_value(case):
    name = case.split()[0]
    with pytest.raises(ValueError, match=rf"^{name} must be one of \w+(, \w+)+; got 'bogus'$"):
        CASES[case]()


COUNTS = {
    "max_steps": (lambda: TrainSettings(max_steps=True), ">= 1, got True"),
    "eval_batches": (lambda: TrainSettings(eval_batches=-1), ">= 0, got -1"),
    "threads": (lambda: TrainSettings(threads=-2), r">= 0 \(0 = torch's default\), got -2"),
    "max_documents": (lambda: DataSettings(max_documents=-1), r">= 0 \(0 = no limit\), got -1"),
    "proj_dim": (lambda: LRASettings(proj_dim=0), ">= 1, got 0"),
    "num_eval": (lambda: LRASettings(num_eval=-1), ">= 0, got -1"),
    "seed": (lambda: LRASettings(seed=-1), ">= 0, got -1"),  # text's numpy generator took none
    "epochs": (lambda: FinetuneSettings(epochs=0), ">= 1, got 0"),
    # the run's names and values, not the user's: max_val_blocks -2, max_steps
    "steps": (lambda: ComparisonSettings(steps=0), ">= 1, got 0"),
    "batch_size": (lambda: ComparisonSettings(batch_size=-1), ">= 1, got -1"),
    "max_seq_len": (lambda: FinetuneSettings(max_seq_len=-1), ">= 0, got -1"),
    "distill_steps": (lambda: TaskBenchSettings(distill_steps=-1), ">= 0, got -1"),
}


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_a_bad_count_names_the_setting_its_range_and_the_value(case):
    make, message = COUNTS[case]
    with pytest.raises(ValueError, match=rf"^{case} must be an integer {message}$"):
        make()


NAN = float("nan")
NUMBERS = {  # each refused before any work (data parsed, a model converted, a run started)
    "lra lr nan": (lambda: LRASettings(lr=NAN), r"lr must be a number in \[0, 10\] \(0 = LRA's\)"),
    "lra lr 1e38": (lambda: LRASettings(lr=1e38), r"lr .* \(0 = LRA's\), got 1e\+38"),
    "task-bench lr": (
        lambda: TaskBenchSettings(train="a", val="b", test="c", lr=-1.0),
        r"lr must be a number in \[0, 10\] \(0 = finetune's\), got -1.0",
    ),
    "distill layer_weight": (
        lambda: DistillSettings(layer_weight=NAN),
        "layer_weight must be a finite number >= 0, got nan",
    ),
    "val_fraction": (lambda: DataSettings(val_fraction=1.0), r"val_fraction must be in \(0, 1\)"),
    "docstrings fractions": (
        lambda: Seq2SeqDataSettings(task="docstrings", val_fraction=0.6, test_fraction=0.6),
        "need val_fraction > 0, test_fraction > 0 and their sum < 1; got 0.6 and 0.6",
    ),
    "bench n": (lambda: BenchSettings(n="1024,0"), "every n value must be an integer >= 1, got 0"),
    "bench proj_dim": (
        lambda: BenchSettings(proj_dim="64,x"),
        "proj_dim takes comma-separated numbers, got '64,x'",
    ),
    "bench min_time_s": (
        lambda: BenchSettings(min_time_s=NAN),
        "min_time_s must be a finite number >= 0, got nan",
    ),
    "bench time_budget_s": (
        lambda: BenchSettings(time_budget_s=-5.0),
        r"time_budget_s must be a number > 0 \(inf: none\), got -5.0",
    ),
    "bench memory_budget_gb": (
        lambda: BenchSettings(memory_budget_gb=NAN),
        r"memory_budget_gb must be a number > 0 \(inf: none\), got nan",
    ),
    "finetune temperature inf": (  # went on into the feature extraction
        lambda: FinetuneSettings(temperature=float("inf")),
        "temperature must be a finite number > 0, got inf",
    ),
    "distill texts 0": (  # converted and saved a student, then calibrated on nothing
        lambda: DistillData(texts=0),
        "texts must be an integer >= 1, got 0",
    ),
    "demo seq_len": (  # said "block_size (64) must be below seq_len (-1)"
        lambda: ComparisonSettings(seq_len=-1),
        "seq_len must be an integer >= 1, got -1",
    ),
}


@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_a_bad_number_names_the_setting_its_range_and_the_value(case):
    # Before, each was accepted (a nan loss, a skipped sweep) or refused only after the work.
    make, message = NUMBERS[case]
    with pytest.raises(ValueError, match=f"^{message}"):
        make()


def test_an_lra_device_is_checked_before_data_is_made_or_a_run_replaced():
    with pytest.raises(ValueError, match=r"^device must be auto, cpu, cuda or cuda:N; got 'tpu'$"):
        LRASettings(device="tpu")


def tiny(**sizes):
    return TINY.replace(**sizes)


HUGE = 10**12
SIZES = {  # each failed in the allocator (a traceback, a bare MemoryError) or, for the
    # tokenizer's vocabulary, aborted the process; the batch grew a list for minutes
    "dim": (lambda: LinformerModel(tiny(dim=HUGE, num_heads=1)), rf"dim {HUGE}, depth"),
    "depth": (lambda: LinformerModel(tiny(depth=HUGE)), rf"depth {HUGE},"),
    "ffn_dim": (lambda: LinformerModel(tiny(ffn_dim=HUGE)), rf"ffn_dim {HUGE} \("),
    "vocab_size": (lambda: LinformerModel(tiny(vocab_size=HUGE)), rf"vocab_size {HUGE},"),
    "max_seq_len": (lambda: LinformerModel(tiny(max_seq_len=HUGE)), rf"max_seq_len {HUGE},"),
    "type_vocab_size": (
        lambda: LinformerModel(tiny(type_vocab_size=HUGE)),
        rf"type_vocab_size {HUGE},",
    ),
    "num_labels": (
        lambda: LinformerForSequenceClassification(TINY, num_labels=HUGE),
        rf"ffn_dim 256, num_labels {HUGE} \(",
    ),
    "batch_size": (
        lambda: TrainSettings(batch_size=HUGE),
        rf"a batch of batch_size {HUGE} \(an 8-byte token id per sequence\)",
    ),
    "convert --report batch_size": (  # its memory probe's process: a CalledProcessError
        lambda: ConversionReport(batch_size=HUGE),
        rf"a batch of batch_size {HUGE} \(",
    ),
    "seq2seq num_train": (
        lambda: Seq2SeqDataSettings(task="copy", num_train=HUGE),
        rf"{HUGE + 1000} pairs \(num_train \+ 2 x num_eval\) of 4 tokens or more",
    ),
    "listops num_train": (  # numpy's _ArrayMemoryError
        lambda: load_listops(num_train=HUGE, cache_dir="/nonexistent"),
        rf"listops: {HUGE + 4000} rows of 2000 bytes",
    ),
    "bench dim": (  # "Storage size calculation overflowed"
        lambda: BenchSettings(dim=HUGE, num_heads=1),
        rf"an attention layer of dim {HUGE} \(4 dim x dim maps\)",
    ),
}


@pytest.mark.parametrize("case", sorted(SIZES))
def test_a_size_no_machine_here_could_hold_is_named_before_anything_is_allocated(case):
    make, named = SIZES[case]
    with pytest.raises(ValueError, match=rf"{named}.* takes at least [\d,.]+ GiB: more than "):
        make()


def test_a_seed_a_generator_cannot_take_is_named():
    for seed in (-(2**63) - 1, 2**64, 1.5):  # 10**21 said "Overflow when unpacking long long"
        with pytest.raises(
            ValueError, match=r"^seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\], got"
        ):
            TrainSettings(seed=seed)
    for seed in (-1, 2**64 - 1):  # torch's range: an earlier run's -1 still resumes
        assert TrainSettings(seed=seed).seed == seed


def test_a_model_built_on_the_meta_device_has_no_memory_to_fit():
    with torch.device("meta"):  # shapes alone: a model larger than this machine is fine
        model = LinformerModel(tiny(dim=2**15, num_heads=1, depth=8))
    assert next(model.parameters()).is_meta


def test_the_demo_names_its_own_flags_and_threads_have_a_ceiling():
    # "max_val_blocks must be an integer >= 0 (0 = no limit), got -2": a name and a value
    # of the runs it sets up, not the flag given
    with pytest.raises(ValueError, match=r"^eval_batches must be an integer >= 0, got -1$"):
        ComparisonSettings(eval_batches=-1)
    # 10**12 was "Overflow when unpacking long" from torch, naming no flag
    for make in (lambda t: TrainSettings(threads=t), lambda t: BenchSettings(threads=t)):
        with pytest.raises(ValueError, match=r"^threads must be an integer in \[0, 4096\] \(0 = "):
            make(10**12)
