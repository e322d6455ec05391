"""The embedded model shipped in ``vllm_specexpert/assets``: a tiny Qwen3-MoE trained by
``specexpert train-tiny``, the artifacts made of it (calibration, estimator, path
predictor, analysis), and its tokenizer.

The tools default to it when no model is given (the demo, capture, calibrate, ...). The
tokenizer is a byte-level BPE with 10,240 tokens (``vllm bench latency`` draws prompt ids
below 10,000) trained once on a fixed quarter of the corpus's train split
(:mod:`vllm_specexpert.tools.corpus`) and shipped as ``assets/tokenizer.json``; the test
models of ``specexpert_testbed`` share it."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_JSON = ASSETS / "tokenizer.json"
TRAINED_MODEL_DIR = ASSETS / "tiny-qwen3-moe"
"""The model trained by ``specexpert train-tiny``."""
TRAINED_CALIBRATION_DIR = ASSETS / "tiny-qwen3-moe-calibration"
"""``specexpert calibrate`` of the trained model on its train split (for ``quasi_hidden``)."""
TRAINED_ESTIMATOR_DIR = ASSETS / "tiny-qwen3-moe-estimator"
"""``specexpert train-estimator`` of the trained model with that calibration."""
TRAINED_PATH_PREDICTOR_DIR = ASSETS / "tiny-qwen3-moe-path-predictor"
"""``specexpert train-path`` of the trained model (``plec``'s and the token scheduler's)."""
TRAINED_ANALYSIS_DIR = ASSETS / "tiny-qwen3-moe-analysis"
"""``specexpert analyze`` of the trained model with both (``hybrid``'s ``analysis``)."""
VOCAB_SIZE = 10240

TOKENIZER_SAMPLE_PERCENT = 25
"""Share of the train split's files (by path hash) the tokenizer is trained on."""


def train_tokenizer(path: Path) -> None:
    """Byte-level BPE with VOCAB_SIZE tokens, trained on a fixed quarter of the corpus's
    train split (by path hash)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vllm_specexpert.tools import corpus

    sample = (
        f.read()
        for f in corpus.corpus_files("train")
        if corpus.bucket(f.relpath, salt="tokenizer") < TOKENIZER_SAMPLE_PERCENT
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sample, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


def load_tokenizer():
    """The shared tokenizer (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_JSON))


def save_tokenizer(out: Path) -> None:
    """The shared tokenizer as a Hugging Face checkpoint's tokenizer files in ``out``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_JSON),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    tok.save_pretrained(str(out))
