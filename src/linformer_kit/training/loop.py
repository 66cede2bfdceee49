"""The training loop: gradient accumulation, clipping, bf16 autocast, DDP, periodic validation,
metrics (JSONL, TensorBoard when installed), best / last checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .. import hub, native
from ..data.tokenizer import TextTokenizer
from ..files import exclusive
from ..kernel_rule import use_kernel
from ..models import LinformerPreTrainedModel
from ..precision import bf16_autocast
from .batches import mix_seed, real_tokens
from .checkpoint import Checkpoint, check_run_dir, restore_links, restore_rng, save_checkpoint
from .distributed import Distributed, peak_memory_mb
from .interfaces import (
    BatchSource,
    Evaluator,
    SavedConfig,
    TrainingInterrupted,
    TrainResult,
    mark_stopped,
)
from .metrics_log import MetricsLog
from .optim import apply_settings, build_optimizer, build_scheduler, load_optimizer_state
from .resume import check_resumable, check_same_source, checkpoint_to_resume
from .settings import (
    RUN_CONFIG_NAME,
    TrainSettings,
    check_compile,
    compiled,
    compiled_backward,
    cuda_graphs,
    keep_freed_memory,
    use_threads,
)

logger = logging.getLogger(__name__)


def _model_loss(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The loss the model computes itself from the batch (labels included)."""
    return model(**batch).loss


class Trainer:
    """Trains `model` on `batches` for `settings.max_steps` steps.

    With `settings.compile` the training steps run the model under `torch.compile`
    (wrapped after DDP, as torch's DDP optimiser expects), and with a "+autograd" setting
    each micro-batch's backward under compiled autograd (`compiled_backward`); validation
    and checkpoints use the model itself, so a compiled run's checkpoints load into an
    eager one and back.

    Args:
        model: the unwrapped model (seeded identically on every rank before construction).
        batches: the training micro-batches.
        evaluator: validation metrics; its `key` metric (lower is better) picks `best`.
        settings: the recipe.
        dist: this process's place in the job.
        run_config: saved into every checkpoint.
        tokenizer: saved into every checkpoint.
        loss_fn: the training loss of (model, micro-batch); default the model's own
            (`model(**batch).loss`).
        checkpoint: with `settings.resume`, the checkpoint to go on from as the caller
            verified it (`latest_checkpoint` of the run, to check the resume before the data
            loads), so that it is not verified twice, unless a newer one came since
            (`checkpoint_to_resume`); None: the newest intact one, found here.
        data_source: what the training data is (pretraining: the token stream's length and
            SHA-256), saved in every checkpoint; a resume on other data is refused.
    """

    def __init__(
        self,
        *,
        model: LinformerPreTrainedModel,
        batches: BatchSource,
        evaluator: Evaluator,
        settings: TrainSettings,
        dist: Distributed,
        run_config: SavedConfig | None = None,
        tokenizer: TextTokenizer | None = None,
        loss_fn: Callable[[torch.nn.Module, dict[str, Tensor]], Tensor] | None = None,
        checkpoint: Checkpoint | None = None,
        data_source: dict[str, Any] | None = None,
    ) -> None:
        if settings.compile:
            check_compile(settings.compile, dist.device.type, processes=dist.world_size)
        self.model = model.to(dist.device)
        self.loss_fn = loss_fn or _model_loss
        self.batches, self.evaluator, self.settings, self.dist = batches, evaluator, settings, dist
        self.run_config, self.tokenizer = run_config, tokenizer
        self.checkpoint, self.data_source = checkpoint, data_source
        self.run_dir = Path(settings.output_dir)
        self.optimizer = build_optimizer(model, settings)
        self.scheduler = build_scheduler(self.optimizer, settings)
        self.step, self.tokens, self.train_s = 0, 0, 0.0
        self.best, self.best_step = math.inf, None
        self.earlier_peak_mb = 0.0  # of the processes that trained this run before a resume
        self.autocast = bf16_autocast(
            dist.device, enabled=settings.precision == "bf16", alternative="--precision fp32"
        )

    def _resume(self) -> int | None:
        checkpoint = checkpoint_to_resume(self.checkpoint, self.run_dir)
        if checkpoint is None:
            logger.warning("--resume: no checkpoint in %s, starting from scratch", self.run_dir)
            return None
        state = checkpoint.state
        check_resumable(checkpoint, self.model, self.dist.world_size)
        check_same_source(checkpoint, self.data_source)
        hub.load_weights(self.model, hub.read_weights(checkpoint.path), str(checkpoint.path))
        load_optimizer_state(self.optimizer, state["optimizer"], self.model)
        self.scheduler.load_state_dict(state["scheduler"])
        apply_settings(self.optimizer, self.scheduler, self.settings)
        self.step, self.tokens = state["step"], state["tokens"]
        self.train_s, self.best = state["train_s"], state["best"]
        self.best_step = state.get("best_step")  # not in older checkpoints
        if self.dist.is_main:
            restore_links(self.run_dir, checkpoint.path, self.best_step)
        self.earlier_peak_mb = state.get("peak_mem_mb", 0.0)  # not in older checkpoints
        restore_rng(state, self.dist.rank, self.dist.device)
        logger.info("resumed from %s at step %d", checkpoint.path, self.step)
        return self.step

    def _state(self) -> dict[str, Any]:
        cuda = self.dist.device.type == "cuda"
        rng = self.dist.gather(torch.get_rng_state())
        cuda_rng = self.dist.gather(torch.cuda.get_rng_state(self.dist.device) if cuda else None)
        schedule = getattr(self.batches, "schedule", None)
        return {
            "step": self.step,
            "tokens": self.tokens,
            "train_s": self.train_s,
            "best": self.best,
            "best_step": self.best_step,
            "peak_mem_mb": self._peak_mem_mb(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "cuda_rng": cuda_rng if cuda else [],
            "data_position": schedule.position(self.step) if schedule is not None else {},
            "data_source": self.data_source,
        }

    def _save(self, best: bool) -> None:
        if best:
            self.best_step = self.step
        state = self._state()  # every rank joins the RNG gather; rank 0 writes
        if self.dist.is_main:
            save_checkpoint(
                self.run_dir,
                self.step,
                model=self.model,
                state=state,
                run_config=self.run_config,
                tokenizer=self.tokenizer,
                best=best,
                keep_last=self.settings.keep_last,
            )
        self.dist.barrier()

    def _kernel_pin(self) -> contextlib.AbstractContextManager:
        """SDPA for the attention under CUDA graphs (`--compile reduce-overhead`): the rule's
        compiled band takes the explicit kernel, which loses there and which a trace cannot
        tell apart (`kernel_rule.choose_kernel`); no pin otherwise."""
        graphs = cuda_graphs(self.settings.compile)
        return use_kernel("sdpa") if graphs else contextlib.nullcontext()

    def _loss_weights(self, batches: list[dict[str, Tensor]]) -> tuple[list[float], float]:
        """Each micro-batch's weight in the step's gradient, and the step's scored count
        over all ranks (nan where the source does not count them). Weighed by the targets
        it scores (`BatchSource`), G micro-batches give the gradient of one batch of them
        all on every rank however the masking falls (the weights times the world size,
        which DDP's mean over ranks divides out); other sources' micro-batches, as many
        examples each, weigh 1 / G."""
        scored = getattr(self.batches, "scored", None)
        if scored is None:
            return [1.0 / len(batches)] * len(batches), math.nan
        counts = [scored(batch) for batch in batches]
        world = self.dist.world_size
        total = round(self.dist.mean(float(sum(counts))) * world)
        if total == 0:  # nothing scored on any rank: a loss of nan, zero gradients
            return [1.0 / len(batches)] * len(batches), 0.0
        return [count * world / total for count in counts], float(total)

    def _train_step(self, model: torch.nn.Module) -> tuple[float, int, float]:
        """One optimiser step over `grad_accum_steps` micro-batches.

        Returns:
            The step's loss (over every rank: the mean over its scored targets, or over
            its micro-batches where they are not counted), its real tokens (every rank's) and
            the learning rate it ran at.
        """
        accum = self.settings.grad_accum_steps
        batches = [self.batches.micro_batch(self.step, m, self.dist.rank) for m in range(accum)]
        weights, total = self._loss_weights(batches)
        weighted = 0.0
        # counted on the host batches: on a GPU a count of the moved masks waited for the
        # device each micro-batch
        tokens = sum(real_tokens(b) for b in batches)
        for micro, (batch, weight) in enumerate(zip(batches, weights)):
            batch = {k: v.to(self.dist.device) for k, v in batch.items()}
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or not self.dist.enabled else model.no_sync()
            if cuda_graphs(self.settings.compile):
                torch.compiler.cudagraph_mark_step_begin()  # the last graph's outputs are read
            with sync, compiled_backward(self.settings.compile), self._kernel_pin():
                with self.autocast:
                    loss = self.loss_fn(model, batch)
                # a micro-batch scoring nothing has a loss of nan (0 / 0) and weighs 0; its
                # backward still runs, for DDP's reduction on the last micro-batch
                (loss.nan_to_num() * 0.0 if weight == 0 else loss * weight).backward()
            weighted += 0.0 if weight == 0 else loss.item() * weight
        if self.settings.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # this step's, before the schedule moves on
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.dist.mean(weighted) if total else math.nan
        return loss, round(self.dist.mean(float(tokens)) * self.dist.world_size), lr

    def _check_finite(self, loss: float) -> None:
        """Stops a run whose weights are no longer numbers after this step's update, before
        it saves them. A loss of nan alone is not that: a batch with no scored token has a
        mean loss of nan (0 / 0) and zero gradients; and the step that breaks the weights
        can report a finite loss (it was measured before the update)."""
        params = list(self.model.parameters())
        # the largest |weight| (fused per device and dtype): finite exactly when every weight is
        if torch.nn.utils.get_total_norm(params, norm_type=math.inf).isfinite():
            return
        broken = sum(not p.isfinite().all() for p in params)
        raise ValueError(
            f"training diverged at step {self.step}: {broken} of {len(params)} weight tensors "
            f"are no longer finite after its update (the loss before it was {loss}; a lower "
            f"--lr or --clip-grad-norm may help); the checkpoints saved before it in "
            f"{self.run_dir} are intact"
        )

    def _evaluate(self, log: MetricsLog) -> tuple[dict[str, float], bool]:
        self.model.eval()
        with self.autocast:
            metrics = self.evaluator(self.model, self.dist.device)
        self.model.train()
        improved = metrics[self.evaluator.key] < self.best
        self.best = min(self.best, metrics[self.evaluator.key])
        log.write({"step": self.step, "split": "val", "train_s": self.train_s, **metrics})
        return metrics, improved

    def _loop(
        self, model: torch.nn.Module, log: MetricsLog, bar: tqdm
    ) -> tuple[dict[str, float], list[float]]:
        """Steps to `max_steps`; returns the last validation metrics and each step's time."""
        s = self.settings
        interval_tokens, interval_s, step_times = 0, 0.0, []
        final: dict[str, float] = {}
        while self.step < s.max_steps:
            start = time.perf_counter()
            loss, tokens, lr = self._train_step(model)
            elapsed = time.perf_counter() - start
            self.step += 1
            self.tokens += tokens
            self.train_s += elapsed
            interval_tokens, interval_s = interval_tokens + tokens, interval_s + elapsed
            step_times.append(elapsed)
            self._check_finite(loss)
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens / elapsed:.0f}")
            if self.step % s.log_every == 0 or self.step == s.max_steps:
                log.write(
                    {
                        "step": self.step,
                        "split": "train",
                        "loss": loss,
                        "lr": lr,
                        "tokens": self.tokens,
                        "tokens_per_s": interval_tokens / interval_s,
                        "train_s": self.train_s,
                    }
                )
                interval_tokens, interval_s = 0, 0.0
            improved = False
            if self.step % s.eval_every == 0 or self.step == s.max_steps:
                final, improved = self._evaluate(log)
                if self.dist.is_main:  # above the bar, as each validation ends
                    scores = ", ".join(f"{k} {v:.4g}" for k, v in final.items())
                    bar.write(f"{self.run_dir.name} step {self.step}: {scores}", file=sys.stderr)
            if improved or self.step % s.save_every == 0 or self.step == s.max_steps:
                self._save(best=improved)
        return final, step_times

    def fit(self) -> TrainResult:
        """Runs (or resumes) training to `max_steps`, the run folder held by this job alone
        (`exclusive`: a second run into it is refused).

        Returns:
            The run's records, final validation metrics and measured throughput.
        """
        with contextlib.ExitStack() as held:
            refusal = None
            if self.dist.is_main:  # rank 0 writes, and holds the folder for the job
                try:
                    held.enter_context(exclusive(self.run_dir, "training run"))
                except (ValueError, OSError) as err:  # OSError: no .lock could be made
                    refusal = str(err)
            # every rank learns of a refusal: the others waited at their first collective
            # until its timeout (30 minutes)
            if (refusal := self.dist.gather(refusal)[0]) is not None:
                raise ValueError(refusal)
            return self._fit()

    def _fit(self) -> TrainResult:
        s = self.settings
        use_threads(s.threads)
        if s.keep_freed_memory and self.dist.device.type == "cpu" and keep_freed_memory():
            logger.debug("glibc keeps freed memory in this process (keep_freed_memory)")
        resumed = self._resume() if s.resume else None
        if resumed is None:
            check_run_dir(self.run_dir, resume=False)
            torch.manual_seed(mix_seed(s.seed, self.dist.rank))  # dropout differs per rank
        if resumed is not None and resumed >= s.max_steps:  # it said nothing of it
            logger.warning(
                "the run is at step %d, max_steps %d: nothing to train", resumed, s.max_steps
            )
        if s.warmup_steps > s.max_steps:
            logger.warning(
                "warmup_steps (%d) > max_steps (%d): the run ends during warm-up, with the "
                "learning rate at %.0f%% of --lr %g",
                s.warmup_steps,
                s.max_steps,
                100 * s.max_steps / s.warmup_steps,
                s.lr,
            )
        log = MetricsLog(self.run_dir, self.dist.is_main, keep_until=resumed)
        if self.dist.is_main and self.run_config is not None:
            self.run_config.save(self.run_dir / RUN_CONFIG_NAME)
        if self.dist.device.type == "cpu":
            native.cpu_ops()  # a first build of the CPU kernels (~1 min) is no training step's
        model = self.dist.wrap(self.model)
        if s.compile:
            model = compiled(model, s.compile)
        model.train()
        bar = tqdm(
            total=s.max_steps,
            initial=self.step,
            disable=not self.dist.is_main,
            desc=self.run_dir.name,
            dynamic_ncols=True,
        )
        try:
            final, step_times = self._loop(model, log, bar)
        except KeyboardInterrupt:
            raise TrainingInterrupted(self.step, self.run_dir) from None
        except Exception as err:
            mark_stopped(err, self.step, self.run_dir)
            raise
        finally:
            bar.close()
            log.close()
        if not final:
            final = next((r for r in reversed(log.records) if r["split"] == "val"), {})
        return self._result(log.records, final, step_times)

    def _peak_mem_mb(self) -> float:
        """The run's peak memory: this process's, or an earlier one's if a resume came after
        it (a finished run resumed only to be tested would otherwise report the test's)."""
        return max(self.earlier_peak_mb, peak_memory_mb(self.dist.device))

    def _result(
        self, records: list[dict[str, Any]], final: dict[str, float], step_times: list[float]
    ) -> TrainResult:
        steady = sorted(step_times[len(step_times) // 10 :])  # skip warm-up
        if not steady:  # a finished run resumed: the whole run's mean, warm-up included
            steady = [self.train_s / self.step if self.step else math.nan]
        return TrainResult(
            records=records,
            final={k: v for k, v in final.items() if isinstance(v, float)},
            steps=self.step,
            params=sum(p.numel() for p in self.model.parameters()),
            tokens_per_s=self.tokens / self.train_s if self.train_s else math.nan,
            sec_per_step=steady[len(steady) // 2],
            peak_mem_mb=self._peak_mem_mb(),
            run_dir=self.run_dir,
            best_val=self.best,
        )
