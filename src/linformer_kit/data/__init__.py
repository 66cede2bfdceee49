"""Data: corpora, tokenizers, the memory-mapped token cache, MLM masking, task datasets."""

from .cache import PackedBlocks, build_token_cache, open_token_cache, split_blocks
from .classification import ClassificationData, load_classification, read_labelled
from .corpus import STDLIB, Document, iter_documents, stdlib_root
from .masking import IGNORE_INDEX, mask_tokens
from .pipeline import DataSettings, PretrainingData, prepare_pretraining_data, prepare_tokenizer
from .tokenizer import TOKENIZER_NAME, TextTokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "STDLIB",
    "TOKENIZER_NAME",
    "ClassificationData",
    "DataSettings",
    "Document",
    "PackedBlocks",
    "PretrainingData",
    "TextTokenizer",
    "build_token_cache",
    "iter_documents",
    "load_classification",
    "load_tokenizer",
    "mask_tokens",
    "open_token_cache",
    "prepare_pretraining_data",
    "prepare_tokenizer",
    "read_labelled",
    "split_blocks",
    "stdlib_root",
    "train_tokenizer",
]
