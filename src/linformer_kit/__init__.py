"""linformer-kit: Linformer self-attention with linear complexity, for PyTorch."""

from .attention import CausalState, LinformerSelfAttention
from .causal import causal_attention
from .causal_lm import CausalLMOutput, LinformerForCausalLM
from .config import (
    LinformerConfig,
    linformer_base,
    linformer_small,
    linformer_tiny,
    proj_dim_schedule,
)
from .cross_attention import LinformerCrossAttention, MemoryCache, cross_attention
from .encoder import FeedForward, LinformerEncoder, LinformerEncoderLayer
from .functional import exact_attention, linformer_attention
from .losses import linear_cross_entropy
from .masked_lm import LinformerForMaskedLM, MaskedLMOutput
from .models import (
    LinformerForSequenceClassification,
    LinformerModel,
    LinformerOutput,
    LinformerPreTrainedModel,
    SequenceClassifierOutput,
)
from .precision import Bf16Support, bf16_support
from .projection import (
    AdaptivePoolProjection,
    BlockProjection,
    ExactProjection,
    MatrixProjection,
    SequenceProjection,
    build_projection,
    count_projection_matrices,
)
from .seq2seq import (
    DecoderLayerState,
    LinformerDecoder,
    LinformerDecoderLayer,
    LinformerForSeq2SeqLM,
    Seq2SeqLMOutput,
)
from .seq2seq_config import Seq2SeqConfig

__version__ = "0.1.0"

__all__ = [
    "Bf16Support",
    "AdaptivePoolProjection",
    "BlockProjection",
    "CausalLMOutput",
    "CausalState",
    "DecoderLayerState",
    "ExactProjection",
    "FeedForward",
    "LinformerConfig",
    "LinformerCrossAttention",
    "LinformerDecoder",
    "LinformerDecoderLayer",
    "LinformerEncoder",
    "LinformerEncoderLayer",
    "LinformerForCausalLM",
    "LinformerForMaskedLM",
    "LinformerForSeq2SeqLM",
    "LinformerForSequenceClassification",
    "LinformerModel",
    "LinformerOutput",
    "LinformerPreTrainedModel",
    "LinformerSelfAttention",
    "MaskedLMOutput",
    "MatrixProjection",
    "MemoryCache",
    "Seq2SeqConfig",
    "Seq2SeqLMOutput",
    "SequenceClassifierOutput",
    "SequenceProjection",
    "__version__",
    "bf16_support",
    "build_projection",
    "causal_attention",
    "count_projection_matrices",
    "cross_attention",
    "exact_attention",
    "linear_cross_entropy",
    "linformer_attention",
    "linformer_base",
    "linformer_small",
    "linformer_tiny",
    "proj_dim_schedule",
]
